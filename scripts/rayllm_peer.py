#!/usr/bin/env python
"""Ray Serve LLM (``ray.serve.llm``) serving the bundled SmolLM2, the peer users would pick instead
of atomr: scripts/bench_http.py's third arm.

    .venv/bin/python scripts/rayllm_peer.py PORT     # serves until SIGINT

On a Ray head of its own (Serve has one HTTP proxy per cluster), with the engine arguments of
deployments/smollm2.yaml and one replica whose placement bundle holds as many CPUs as atomr's
CPU replica computes on. Needs ``pyarrow`` (``ray.serve.llm`` imports it; atomr does not).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests.vllm_serve import stop_group  # noqa: E402 - after the path insert

NAME = "smollm2"


@contextlib.contextmanager
def rayllm_server(wait_http, free_port) -> Iterator[tuple[str, int]]:  # noqa: ANN001 - bench_http's helpers
    """(base URL, pid of the process that owns its Ray head) while it serves."""
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="rayllm-")) / "server.log"
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, __file__, str(port)], stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    try:
        wait_http(f"{url}/v1/models", proc, str(log))
        print(f"Ray Serve LLM ready in {time.monotonic() - started:.0f}s at {url}/v1 (log: {log})", flush=True)
        yield url, proc.pid
    finally:
        stop_group(proc)


def serve_forever(port: int) -> None:
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    from atomr_infer.engine.cpu import cpu_threads
    from atomr_infer.engine.vllm.engine_args import engine_args
    from atomr_infer.models import prepare_bundled
    from atomr_infer.spec import load_deployments

    spec = load_deployments(os.path.join(REPO, "deployments", "smollm2.yaml"))[0]
    model_dir = str(prepare_bundled("smollm2-135m-instruct"))
    kwargs = engine_args(spec, model_dir, "cpu")
    kwargs.pop("model")
    os.environ.pop("RAY_ADDRESS", None)
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=4,
             log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = LLMConfig(
            model_loading_config={"model_id": NAME, "model_source": model_dir},
            engine_kwargs=kwargs,
            deployment_config={"num_replicas": 1},
            placement_group_config={"bundles": [{"CPU": cpu_threads(spec)}]},
        )
        serve.run(build_openai_app({"llm_configs": [config]}), name="rayllm", route_prefix="/", blocking=False)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # for sigwait
    serve_forever(int(sys.argv[1]))
