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
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

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


def emulated_engine(model_dir: str, step_s: float, max_model_len: int = 2048) -> Any:
    """A vLLM ``LLMEngine`` for ``model_dir``'s tokenizer and config over a ``TimedCore``."""
    from unittest import mock

    from vllm import EngineArgs
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    config = EngineArgs(model=model_dir, max_model_len=max_model_len, enforce_eager=True).create_engine_config()
    core: list[TimedCore] = []

    def make_client(**_kw: Any) -> TimedCore:
        tokenizer = _kw["renderer"].tokenizer
        core.append(TimedCore(step_s, tokenizer.encode(TOKEN_TEXT, add_special_tokens=False)[0]))
        return core[0]

    # multiprocess_mode: LLMEngine then reaches for no in-process executor; the core is ours.
    with mock.patch.object(EngineCoreClient, "make_client", staticmethod(make_client)):
        engine = LLMEngine(config, Executor.get_class(config), log_stats=False, multiprocess_mode=True)
    return engine


def emulated_engine_factory(model_dir: str, step_s: float) -> Any:
    """An engine factory of ``VllmBackend`` (``VllmBackend.factory``) for ``emulated_engine``."""

    def factory(deployment: Any, progress: Any) -> Any:
        progress(f"starting an emulated engine ({step_s * 1000:g} ms per step)")
        return emulated_engine(model_dir, step_s)

    return factory


def emulated_backend(model_dir: str, step_s: float) -> Any:
    """A replica ``backend`` (``VllmReplica(backend=...)``): the vLLM backend over ``emulated_engine``."""
    from atomr_infer.engine.vllm.backend import VllmBackend

    return VllmBackend.factory(emulated_engine_factory(model_dir, step_s))
