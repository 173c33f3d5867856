#!/usr/bin/env python
"""Host memory of atomr's whole stack, per process: what a GPU node pays beside its engines.

    .venv/bin/python scripts/stack_memory.py [--cpus 16] [--gpus 1] [--engine emulated|real]

Starts a private local head the way ``atomr up`` does (advertising ``--cpus`` CPUs and ``--gpus``
GPUs, as a 16-core GPU node would), deploys the bundled SmolLM2 as a ``device: cuda`` spec,
starts ``atomr serve`` and sends it a few chat completions, then prints every process of the
stack with its memory (PSS, GiB), and whether it maps torch or vLLM's compiled code, and
stops it all. With ``--engine emulated`` (the default on a host without a GPU) the replica
serves with the emulated engine (``ATOMR_EMULATED_STEP_MS``, engine/device.py): vLLM's serving
layer and tokenizer as on a GPU, no model. The target (issue 31): everything but the replicas
and their engine cores within 1.0 GiB, and no process but those loads torch or vLLM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from atomr_infer.local_ray import free_port, head_processes  # noqa: E402 - after the path insert
from scripts.process_table import table  # noqa: E402
from tests.atomr_serve import ATOMR_COMMAND, AtomrServe  # noqa: E402


def spec_file(directory: str, device: str, gpus: int) -> str:
    lines = [
        "name: smollm2", "model: bundled:smollm2-135m-instruct", f"device: {device}", f"gpus: {gpus}",
        "runtime_config:", "  max_model_len: 2048", "  enforce_eager: true",
    ]
    path = os.path.join(directory, "smollm2-cuda.yaml")
    Path(path).write_text("\n".join(lines) + "\n")
    return path


@contextlib.contextmanager
def stack(opts: argparse.Namespace) -> Iterator[tuple[dict[str, str], int]]:
    """``atomr up`` on a private head, the cuda spec deployed; ``atomr down`` at the end."""
    tmp = tempfile.mkdtemp(prefix="am-", dir="/tmp")  # short: Ray's socket paths have a limit
    port = free_port()
    env = {
        **os.environ, "ATOMR_RAY_PORT": str(port), "ATOMR_RAY_TEMP_DIR": tmp,
        "ATOMR_RAY_DASHBOARD_PORT": str(free_port()), "ATOMR_STATE_DIR": tmp, "ATOMR_RAY_NUM_CPUS": str(opts.cpus),
        "ATOMR_RAY_NUM_GPUS": str(opts.gpus), "ATOMR_INFER_GEMMA_AUTO": "skip-quietly",
    }
    env.pop("RAY_ADDRESS", None)
    if opts.engine == "emulated":
        env["ATOMR_EMULATED_STEP_MS"] = str(opts.step_ms)

    def atomr(*args: str, timeout: float = 600) -> None:
        subprocess.run([*ATOMR_COMMAND, *args], env=env, check=True, timeout=timeout, stdin=subprocess.DEVNULL)

    try:
        atomr("up")
        atomr("deploy", spec_file(tmp, "cuda", 1))
        yield env, port
    finally:
        with contextlib.suppress(Exception):
            atomr("down", timeout=180)


def manager_imports(env: dict[str, str]) -> bool:
    """What the manager says it imported of torch and vLLM, and from where (heavy_imports.py);
    whether it imported neither."""
    code = (
        "import json; from atomr_infer.control.client import manager_handle; import ray; "
        "print(json.dumps(ray.get(manager_handle(start=False).process_report.remote())))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    report = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {}
    imports = report.get("heavy_imports")
    if imports is None:
        print(f"manager: no report ({out.stderr.strip().splitlines()[-1:] or out.returncode})")
    for module, stack in (imports or {}).items():
        print(f"manager imported {module}, from:\n{stack}")
    if imports == {}:
        print("manager: imported neither torch nor vLLM")
    return imports == {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpus", type=int, default=16, help="CPUs the head advertises (a GPU node's cores)")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs the head advertises")
    parser.add_argument("--engine", choices=("emulated", "real"), default=None,
                        help="emulated (default without CUDA) or vLLM on the GPU")
    parser.add_argument("--step-ms", type=float, default=2.0, help="the emulated engine's step")
    opts = parser.parse_args()
    if opts.engine is None:
        opts.engine = "real" if Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") else "emulated"
    import httpx

    with stack(opts) as (env, port):
        serve_port = free_port()
        server = AtomrServe(["--host", "127.0.0.1", "--port", str(serve_port)], env=env)
        try:
            url = f"http://127.0.0.1:{serve_port}/v1/chat/completions"
            for stream in (False, True, False):
                body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                        "stream": stream}
                httpx.post(url, json=body, timeout=60).raise_for_status()
            time.sleep(3)  # past the requests: what stays resident
            serve = psutil.Process(server.proc.pid)
            procs = [*head_processes(port), serve, *serve.children(recursive=True)]
            print(f"engine: {opts.engine}; head advertising {opts.cpus} CPUs and {opts.gpus} GPUs; "
                  "deployed smollm2 (device: cuda), atomr serve up, 3 requests served")
            _, loaded = table(list({p.pid: p for p in procs}.values()))
            clean = manager_imports(env)
        finally:
            server.interrupt()
    if loaded or not clean:
        sys.exit("torch or vLLM is loaded outside the replicas (see above)")


if __name__ == "__main__":
    main()
