"""An engine that computes nothing: vLLM's own front half over a core that only keeps time.

For measuring atomr's data plane at rates no CPU model reaches (scripts/bench_dataplane.py)
and for tests of it. ``emulated_engine(model_dir, step_s)`` is a real vLLM ``LLMEngine`` — its
input processor, tokenizer and output processor (detokenization), so vLLM's OpenAI server runs
in the replica over it as over a real one — whose engine core is a ``TimedCore``: a thread that,
like a GPU engine core in its own process, runs one step every ``step_s`` seconds while it has
requests (sleeping, which releases the GIL as waiting on a kernel does) and emits one token for
every running request, ending each at its ``max_tokens``. ``LLMEngine.step`` takes the next
step's outputs, waiting for them if none are ready, as it does from a core process.

So the ideal rate is running requests / ``step_s`` tokens per second on any CPU, and what is
delivered below it is the cost of everything after the core: vLLM's output processing and
serving layer, and atomr's transport.

With ``core_process=True`` the core is a process of its own, as vLLM's is on a GPU, and the
engine-core client is vLLM's own ``SyncMPClient`` (``AsyncMPClient`` under ``AsyncLLM``): its
ZMQ sockets, its msgpack encoder and decoder, and its thread that receives and decodes every
step into ``outputs_queue``. Only the process at the other end is ours (``_core_main``): it
decodes requests with vLLM's decoder, keeps the same time, and sends each step's
``EngineCoreOutputs`` with vLLM's encoder, so the front half pays what it pays over a real core.
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

# A file the core process appends "add <time>" and "end <time>" to (``time.monotonic()``) for
# each request it takes and each step that ends some: the benchmark's timeline of the core.
TIMELINE_ENV = "ATOMR_EMULATED_CORE_TIMELINE"
TOKEN_TEXT = " go"  # one token of the vocabulary, emitted for every step of every request


class TimedCore:
    """The engine-core client ``LLMEngine`` talks to, emulating a core that steps on its own."""

    def __init__(self, step_s: float, token_id: int) -> None:
        self._step_s, self._token_id = step_s, token_id
        self._lock = threading.Condition()
        self._running: dict[str, list[int]] = {}  # request id -> [emitted, max_tokens]
        # EngineCoreOutputs not yet taken, queued as vLLM's SyncMPClient queues a core process's.
        self.outputs_queue: queue.Queue[Any] = queue.Queue()
        self._stop = False
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="atomr-timed-core", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

        next_at = time.monotonic()
        while True:
            with self._lock:
                while not self._running and not self._stop:
                    self._lock.wait()
                    next_at = time.monotonic()
                if self._stop:
                    return
            next_at += self._step_s
            time.sleep(max(0.0, next_at - time.monotonic()))  # the "kernel": the GIL is free
            outputs = []
            with self._lock:
                for rid, state in list(self._running.items()):
                    # A new output per request per step, as a frontend decodes them from a core
                    # process (a cached one would change under a step not yet processed).
                    state[0] += 1
                    finished = state[0] >= state[1]
                    if finished:
                        del self._running[rid]
                    reason = FinishReason.LENGTH if finished else None
                    outputs.append(EngineCoreOutput(rid, [self._token_id], finish_reason=reason))
                self.steps += 1
            self.outputs_queue.put(EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic()))

    # -- what LLMEngine calls ------------------------------------------------------------------

    def add_request(self, request: Any) -> None:
        params = request.sampling_params
        with self._lock:
            self._running[request.request_id] = [0, (params.max_tokens if params else None) or 16]
            self._lock.notify_all()

    def abort_requests(self, request_ids: list[str]) -> None:
        with self._lock:
            for rid in request_ids:
                self._running.pop(rid, None)

    def get_output(self) -> Any:
        from vllm.v1.engine import EngineCoreOutputs

        try:
            # LLMEngine steps only while requests are unfinished; a bounded wait keeps an
            # aborted-everything corner from blocking the caller for good.
            return self.outputs_queue.get(timeout=1.0)
        except queue.Empty:
            return EngineCoreOutputs(outputs=[], timestamp=time.monotonic())

    def dp_engines_running(self) -> bool:
        return False

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def reset_mm_cache(self) -> None:
        return None

    def shutdown(self, timeout: float | None = None) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()


def emulated_engine(model_dir: str, step_s: float, max_model_len: int = 2048, core_process: bool = False) -> Any:
    """A vLLM ``LLMEngine`` for ``model_dir``'s tokenizer and config over a ``TimedCore``, or
    (``core_process``) over vLLM's ``SyncMPClient`` to the same core in a process of its own."""
    from unittest import mock

    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    from atomr_infer.engine.vllm.engine_args import engine_config

    # Started first: its imports overlap the engine's config and tokenizer here.
    core = CoreProcess.start(step_s) if core_process else None

    def make_client(vllm_config: Any, executor_class: Any, log_stats: bool, renderer: Any = None, **_kw: Any) -> Any:
        if core is not None:
            return core_process_client(False, core, token_id(renderer), vllm_config, executor_class, log_stats,
                                       renderer=renderer)
        return TimedCore(step_s, token_id(renderer))

    try:
        config = engine_config({"model": model_dir, "max_model_len": max_model_len, "enforce_eager": True})
        # multiprocess_mode: LLMEngine then reaches for no in-process executor; the core is ours.
        with mock.patch.object(EngineCoreClient, "make_client", staticmethod(make_client)):
            return LLMEngine(config, Executor.get_class(config), log_stats=False, multiprocess_mode=True)
    except BaseException:
        if core is not None:
            core.shutdown()
        raise


def token_id(renderer: Any) -> int:
    """The id of ``TOKEN_TEXT``, the token the emulated core emits."""
    return renderer.tokenizer.encode(TOKEN_TEXT, add_special_tokens=False)[0]


def emulated_engine_factory(model_dir: str, step_s: float, core_process: bool = False,
                            max_model_len: int = 2048) -> Any:
    """An engine factory of ``VllmBackend`` (``VllmBackend.factory``) for ``emulated_engine``."""

    def factory(deployment: Any, progress: Any) -> Any:
        where = "in its own process" if core_process else "in a thread"
        progress(f"starting an emulated engine ({step_s * 1000:g} ms per step, core {where})")
        return emulated_engine(model_dir, step_s, max_model_len, core_process=core_process)

    return factory


def emulated_backend(model_dir: str, step_s: float, core_process: bool = False) -> Any:
    """A replica ``backend`` (``VllmReplica(backend=...)``): the vLLM backend over ``emulated_engine``."""
    from atomr_infer.engine.vllm.backend import VllmBackend

    return VllmBackend.factory(emulated_engine_factory(model_dir, step_s, core_process))


# -- the core in a process of its own ---------------------------------------------------------

CORE_START_TIMEOUT_S = 300.0  # the child imports vLLM's engine types (torch among them)


def core_process_client(asyncio_mode: bool, core: CoreProcess, token: int, *args: Any, **kwargs: Any) -> Any:
    """vLLM's ``SyncMPClient`` (``AsyncMPClient`` when ``asyncio_mode``), built with ``args`` and
    ``kwargs`` as vLLM builds it, over ``core`` (``CoreProcess.start``): everything but the
    launch (``launch_core_engines``) is vLLM's."""
    from unittest import mock

    from vllm.v1.engine import core_client

    with mock.patch.object(core_client, "launch_core_engines", functools.partial(_launch_core, core, token)):
        cls = core_client.AsyncMPClient if asyncio_mode else core_client.SyncMPClient
        return cls(*args, **kwargs)


@contextlib.contextmanager
def _launch_core(core: CoreProcess, token: int, vllm_config: Any, executor_class: Any, log_stats: Any,
                 addresses: Any) -> Iterator[Any]:
    """vLLM's ``launch_core_engines`` for the emulated core: give it the client's sockets, let
    the client go on (vLLM yields here too), then wait until the core is up or has died, not
    vLLM's 10 minutes for a ready message that a dead process never sends."""
    from vllm.v1.engine.utils import CoreEngineLaunch

    try:
        core.connect(addresses.inputs[0], addresses.outputs[0], token)
        yield CoreEngineLaunch(core, None, addresses, None)
        core.wait_ready(CORE_START_TIMEOUT_S)
    except BaseException:
        core.shutdown()
        raise


class CoreProcess:
    """The emulated core's process, in the part vLLM's ``CoreEngineProcManager`` plays for its
    ``MPClient``: ``shutdown`` and ``monitor_engine_liveness``. A process started with the
    interpreter (``subprocess``), not ``multiprocessing``: spawn would also re-run the caller's
    main module (a Ray worker's, a script's), fork would copy a process full of threads. Its
    stdin carries the sockets to connect to, its stdout the one line that says it is up; its
    stderr is the caller's (its log)."""

    failed_proc_name: str | None = None

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self._stopped = threading.Event()

    @classmethod
    def start(cls, step_s: float) -> CoreProcess:
        code = "import sys; from atomr_infer.engine.vllm.emulated import _core_main; _core_main(sys.argv[1:])"
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])),
                   # vLLM logs to stdout by default: here stdout is the "ready" line alone, and
                   # nothing reads it after that (a chatty child would fill the pipe and block).
                   VLLM_LOGGING_STREAM="ext://sys.stderr")
        argv = [sys.executable, "-c", code, repr(step_s), str(os.getpid())]
        return cls(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def connect(self, input_address: str, output_address: str, token: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{input_address} {output_address} {token}\n".encode())
        self.proc.stdin.close()

    def wait_ready(self, timeout: float) -> None:
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if readable else b""
        if line.strip() != b"ready":
            code = self.proc.poll()
            state = f"exited with {code}" if code is not None else f"not up after {timeout:.0f} s"
            raise RuntimeError(f"the emulated engine core (pid {self.proc.pid}) {state}")

    def shutdown(self, timeout: float | None = None) -> None:
        self._stopped.set()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout or 5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()

    def monitor_engine_liveness(self) -> None:
        """Return once the process has ended (or ``shutdown`` was called), as vLLM's does."""
        while not self._stopped.is_set():
            try:
                code = self.proc.wait(1.0)
            except subprocess.TimeoutExpired:
                continue
            if code != 0 and not self._stopped.is_set():
                self.failed_proc_name = f"emulated EngineCore (pid {self.proc.pid}, exit {code})"
            break
        self.shutdown()


def _core_main(argv: list[str]) -> None:
    """The core process: vLLM's ``EngineCoreProc`` I/O (a DEALER socket for requests decoded
    by an input thread, a PUSH socket for outputs), with ``TimedCore``'s clock for a model."""
    step_s, parent = float(argv[0]), int(argv[1])
    # Its caller ends it (SIGTERM, or leaving: below), not a Ctrl-C sent to the whole group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def orphaned() -> None:  # the caller was killed (a Ray actor is, with SIGKILL): go too
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=orphaned, name="emulated-core-orphan", daemon=True).start()
    import msgspec
    import zmq
    from vllm.utils.network_utils import make_zmq_socket
    from vllm.v1.engine import (
        EngineCoreOutput,
        EngineCoreOutputs,
        EngineCoreRequest,
        EngineCoreRequestType,
        FinishReason,
        UtilityOutput,
    )
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

    line = sys.stdin.readline().split()
    if len(line) != 3:  # the caller went away before its client was built
        return
    input_address, output_address, token = line[0], line[1], int(line[2])
    ctx = zmq.Context()
    inbox: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
    identity = (0).to_bytes(2, "little")  # engine rank 0, the identity MPClient waits for
    requests = make_zmq_socket(ctx, input_address, zmq.DEALER, identity=identity, bind=False)
    outputs_socket = make_zmq_socket(ctx, output_address, zmq.PUSH, linger=4000)
    requests.send(b"")  # the ready message: no EngineCoreReadyResponse, the client's config stands

    def receive() -> None:  # vLLM's process_input_sockets
        add_decoder, generic_decoder = MsgpackDecoder(EngineCoreRequest), MsgpackDecoder()
        while True:
            type_frame, *data = requests.recv_multipart(copy=False)
            kind = EngineCoreRequestType(bytes(type_frame.buffer))
            inbox.put((kind, (add_decoder if kind == EngineCoreRequestType.ADD else generic_decoder).decode(data)))

    threading.Thread(target=receive, name="emulated-core-input", daemon=True).start()
    encoder, element = MsgpackEncoder(), msgspec.msgpack.Encoder()
    utilities = {"get_supported_tasks": ("generate",), "reset_prefix_cache": True, "is_sleeping": False}
    running: dict[str, bytes] = {}  # request id -> the output it gets every step until its last, encoded
    ends: dict[int, list[str]] = {}  # step -> the requests whose last token it makes

    def send(outputs: Any) -> None:
        outputs_socket.send_multipart(encoder.encode(outputs), copy=False)

    def take(kind: EngineCoreRequestType, request: Any, step: int) -> None:
        if kind == EngineCoreRequestType.ADD:
            params = request.sampling_params
            tokens = (params.max_tokens if params else None) or 16
            running[request.request_id] = element.encode(EngineCoreOutput(request.request_id, [token]))
            ends.setdefault(step + tokens - 1, []).append(request.request_id)
            timeline("add")
        elif kind == EngineCoreRequestType.ABORT:
            for rid in request:
                running.pop(rid, None)
        elif kind == EngineCoreRequestType.UTILITY:
            _client, call_id, method, _args = request
            out = (UtilityOutput(call_id, result=UtilityResult(utilities.get(method)))
                   if method in utilities or method.startswith("reset_") else
                   UtilityOutput(call_id, failure_message=f"the emulated engine core has no {method}"))
            send(EngineCoreOutputs(utility_output=out))

    timeline = _timeline(os.environ.get(TIMELINE_ENV))
    print("ready", flush=True)
    step, next_at = 0, time.monotonic()
    while True:
        if not running:
            take(*inbox.get(), step + 1)  # idle: wait for a request
            next_at = time.monotonic()
            continue
        next_at += step_s
        time.sleep(max(0.0, next_at - time.monotonic()))  # the "kernel"
        step += 1
        while not inbox.empty():  # what arrived meanwhile runs in this step, as TimedCore's does
            take(*inbox.get_nowait(), step)
        last = [rid for rid in ends.pop(step, ()) if running.pop(rid, None) is not None]
        if last:
            timeline("end")
        ending = (EngineCoreOutput(rid, [token], finish_reason=FinishReason.LENGTH) for rid in last)
        items = [*running.values(), *map(element.encode, ending)]
        send(EngineCoreOutputs(outputs=encoded_array(items), timestamp=time.monotonic()))


def _timeline(path: str | None) -> Any:
    """``record(event)``: the event and the time appended to ``path`` as a line (nothing without one)."""
    if not path:
        return lambda event: None
    out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the process's life
    return lambda event: out.write(f"{event} {time.monotonic()}\n")


def encoded_array(items: list[bytes]) -> Any:
    """``items``, each one msgpack value, as one msgpack array that msgspec writes as it is
    (``msgspec.Raw``): a step's outputs from each request's output encoded once, not every step.
    The bytes are those vLLM's encoder writes for the list; only the work is less: this core's
    CPU, which a GPU core spends on cores of its own, stays off the front half's."""
    import msgspec

    n = len(items)
    if n < 16:
        head = bytes([0x90 | n])  # fixarray
    elif n < 1 << 16:
        head = b"\xdc" + n.to_bytes(2, "big")  # array 16
    else:
        head = b"\xdd" + n.to_bytes(4, "big")  # array 32
    return msgspec.Raw(head + b"".join(items))
