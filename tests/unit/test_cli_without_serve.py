"""A host whose Ray cannot import Serve (issue 31: met on a GPU host with an incomplete
environment): ``atomr serve`` fails in one line, and ``atomr down``'s first step (stopping the
API) says why it could not and lets ``down`` go on to remove deployments and stop Ray. Run as
a user runs them, in fresh interpreters where importing ``ray.serve`` really fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BLOCKER = '''
import sys

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
