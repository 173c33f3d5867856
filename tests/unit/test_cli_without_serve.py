"""A host whose Ray cannot import Serve, or cannot import at all (issue 31: met on a GPU host
with an incomplete environment). ``atomr serve`` fails in one line; ``atomr down``'s first step
(stopping the API) says why it could not and goes on to remove deployments and stop Ray; every
command that needs Ray says in one line that it cannot be imported, and ``down`` still stops
the head atomr started. Run as a user runs them, in fresh interpreters where the imports really
fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BLOCKER = '''
import sys
import tempfile

class _NoServe:
    def find_spec(self, name, path=None, target=None):
        if name == "ray.serve" or name.startswith("ray.serve."):
            raise ModuleNotFoundError("No module named 'grpc_reflection'")  # as the GPU host had it
        return None

sys.meta_path.insert(0, _NoServe())
'''


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "RAY_ADDRESS": "127.0.0.1:1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, env=env)


def test_atomr_serve_fails_in_one_line_without_ray_serve(tmp_path: Path) -> None:
    proc = run(tmp_path, "-m", "atomr_infer.cli.main", "serve", "--port", "1")
    said = (proc.stdout + proc.stderr).strip()
    assert proc.returncode != 0
    assert "Traceback" not in said, said[-2000:]
    assert "Ray Serve cannot be imported here: ModuleNotFoundError: No module named 'grpc_reflection'" in said
    assert len([line for line in said.splitlines() if line.strip()]) == 1, said


def test_stopping_the_api_without_ray_serve_says_why_and_goes_on(tmp_path: Path) -> None:
    code = "from atomr_infer.cli import lifecycle; lifecycle._stop_api(); print('went on')"
    proc = run(tmp_path, "-c", code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout + proc.stderr
    assert "not checked: Ray Serve cannot be imported here" in said and "went on" in proc.stdout, said


NO_RAY = '''
import sys
import tempfile

class _NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("libray.so: undefined symbol: ncclCommSuspend", name=name)
        return None

sys.meta_path.insert(0, _NoRay())
'''


def atomr_without_ray(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    (tmp_path / "blocker").mkdir(exist_ok=True)
    (tmp_path / "blocker" / "sitecustomize.py").write_text(NO_RAY)
    env = {**(env or os.environ), "PYTHONPATH": str(tmp_path / "blocker"), "ATOMR_STATE_DIR": str(tmp_path / "state")}
    return subprocess.run([sys.executable, "-m", "atomr_infer.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env={**env, "RAY_ADDRESS": env.get("RAY_ADDRESS", "127.0.0.1:1")})


def test_every_command_that_needs_ray_says_so_in_one_line(tmp_path: Path) -> None:
    for args in (["status"], ["deploy", "deployments/smollm2.yaml"], ["chat", "smollm2", "hi"], ["logs", "smollm2"],
                 ["remove", "smollm2"], ["up"]):
        proc = atomr_without_ray(tmp_path, *args)
        said = (proc.stdout + proc.stderr).strip()
        assert proc.returncode != 0 and "Traceback" not in said, (args, said[-2000:])
        assert "cannot be imported here: ImportError: libray.so: undefined symbol" in said, (args, said)
        assert len([line for line in said.splitlines() if line.strip()]) == 1, (args, said)


def test_down_without_ray_still_stops_the_head_atomr_started(tmp_path: Path) -> None:
    from atomr_infer.local_ray import free_port, head_processes, stop_head

    port = free_port()
    temp = tempfile.mkdtemp(prefix="atomr-noray-", dir="/tmp")  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(ATOMR_RAY_PORT=str(port), ATOMR_RAY_TEMP_DIR=temp, ATOMR_STATE_DIR=str(tmp_path / "state"),
               ATOMR_INFER_GEMMA_AUTO="skip-quietly")
    try:
        up = subprocess.run([sys.executable, "-m", "atomr_infer.cli.main", "up", "--no-gemma"], capture_output=True,
                            text=True, timeout=180, env=env)
        assert up.returncode == 0, up.stdout + up.stderr
        assert head_processes(port)
        down = atomr_without_ray(tmp_path, "down", env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"})
        said = down.stdout + down.stderr
        assert down.returncode == 0 and "Traceback" not in said, said
        assert "cannot be imported here" in said and "stopped the local head atomr started" in said, said
        assert not head_processes(port)
    finally:
        stop_head(port)
        shutil.rmtree(temp, ignore_errors=True)
