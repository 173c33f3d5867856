"""A private Ray head that ``atomr up`` starts, driven through the ``atomr`` CLI as a user drives
it: what the GPU smoke (scripts/gpu_smoke.py) and tests/gpu run their steps on.

The head listens on a free loopback port, with a state directory and a Ray temp directory of its
own, so it never meets the user's Ray, another test session's, or an in-process Ray of the
calling process (the integration tier's). Gemma provisioning is off. Every command joins it
through ``RAY_ADDRESS``. ``down()`` runs ``atomr down``, then stops whatever of the head is left
(``local_ray.stop_head``: only this head's processes). ``ray_call`` runs a few lines of Ray in a
subprocess joined to the head (killing a replica's actor, counting the cluster's GPUs), so the
caller itself never joins it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from atomr_infer.local_ray import free_port, head_processes, stop_head
from tests.atomr_serve import ATOMR_COMMAND

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"
STUCK_S = 60.0  # a rollout that says nothing new for this long while waiting for a GPU is stuck


class CommandFailed(AssertionError):
    """An ``atomr`` command exited non-zero, or said something other than what was expected."""


def left(deadline: float) -> float:
    """Seconds until ``deadline`` (``time.monotonic()``); ``TimeoutError`` once it has passed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("step timed out")
    return remaining


class AtomrHead:
    def __init__(self, workdir: Path | None = None, port: int | None = None) -> None:
        # Short: Ray puts unix sockets under its temp dir, and their paths must stay < 108 bytes.
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="atomr-gpu-", dir="/tmp"))
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        # Not the caller's Ray, nor an emulated engine (ATOMR_EMULATED_STEP_MS) in place of the real one.
        inherited = {k: v for k, v in os.environ.items()
                     if not k.startswith(("RAY_", "ATOMR_RAY_")) and k != "ATOMR_EMULATED_STEP_MS"}
        self.env = {
            **inherited,
            "ATOMR_RAY_PORT": str(self.port),
            "ATOMR_STATE_DIR": str(self.workdir / "state"),
            "ATOMR_RAY_TEMP_DIR": str(self.workdir / "ray"),
            "ATOMR_INFER_GEMMA_AUTO": "skip-quietly",
            "NO_COLOR": "1",
            "TERM": "dumb",
            "COLUMNS": "200",
            "PYTHONUNBUFFERED": "1",
        }

    def atomr(self, *args: str | Path, timeout: float = 180, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``atomr *args`` joined to this head; ``CommandFailed`` on a non-zero exit if ``check``."""
        proc = subprocess.run([*ATOMR_COMMAND, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT, env={**self.env, "RAY_ADDRESS": self.address}, stdin=subprocess.DEVNULL)
        if check and proc.returncode != 0:
            raise CommandFailed(f"atomr {' '.join(map(str, args))} exited {proc.returncode}: "
                                f"{(proc.stderr or proc.stdout).strip()[-1500:]}")
        return proc

    def up(self, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        """``atomr up --no-gemma`` with no ``RAY_ADDRESS``: it must start the head itself."""
        proc = subprocess.run([*ATOMR_COMMAND, "up", "--no-gemma"], capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise CommandFailed(f"atomr up exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-1500:]} "
                                f"(Ray's logs: {self.workdir}/ray)")
        return proc

    def write_spec(self, fields: dict[str, Any]) -> Path:
        path = self.workdir / f"{fields['name']}-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(fields, sort_keys=False))
        return path

    def deploy(self, fields: dict[str, Any], deadline: float) -> list[str]:
        """``atomr deploy`` of a spec (its fields), waiting until every replica is ready; its
        lines. Fails early, naming the replica, when a rollout waits ``STUCK_S`` for a GPU with
        nothing else happening (a roll is stop-first where the budget has no GPU to spare, so
        this is a guard against that going wrong, not an expected wait)."""
        path = self.write_spec(fields)
        cmd = [*ATOMR_COMMAND, "deploy", str(path), "--timeout", str(int(left(deadline)))]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env={**self.env, "RAY_ADDRESS": self.address}, stdin=subprocess.DEVNULL)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(ln.rstrip() for ln in proc.stdout), daemon=True)
        reader.start()
        try:
            seen, last_change = 0, time.monotonic()
            while proc.poll() is None:
                if len(lines) != seen:
                    seen, last_change = len(lines), time.monotonic()
                waiting = lines and "waiting for a node with" in lines[-1] and "GPU" in lines[-1]
                if waiting and time.monotonic() - last_change > STUCK_S:
                    raise CommandFailed(f"rollout stuck for {STUCK_S:.0f}s: {lines[-1].strip()} (with no GPU to "
                                        "spare a roll should stop the old replica first)")
                left(deadline)
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            reader.join(10)
        if proc.returncode != 0:
            raise CommandFailed(f"atomr deploy exited {proc.returncode}: " + " | ".join(lines[-6:]))
        return lines

    def status(self, name: str) -> dict[str, Any]:
        return json.loads(self.atomr("status", name, "--json").stdout)

    def ready_replicas(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.status(name)["replicas"] if r["state"] == "ready"]

    def chat(self, name: str, deadline: float, question: str = QUESTION) -> str:
        """The answer of ``atomr chat`` (greedy, 32 tokens); ``CommandFailed`` unless it says Paris."""
        answer = self.atomr("chat", name, question, "--max-tokens", "32", timeout=left(deadline)).stdout.strip()
        if "Paris" not in answer:
            raise CommandFailed(f"atomr chat {name} answered {answer!r}, not Paris")
        return answer

    def ray_call(self, code: str, *args: str, timeout: float = 60) -> str:
        """Run ``code`` in a Python process joined to the head (``ray`` imported, ``sys.argv[1:]``
        = ``args``); its stdout."""
        script = f"import sys, ray\nfrom atomr_infer.cluster import connect\nconnect({self.address!r})\n{code}\n"
        proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT, env=self.env, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise CommandFailed(f"ray call failed: {proc.stderr.strip()[-1500:]}")
        return proc.stdout

    def gpus(self) -> int:
        """GPUs the head's cluster has (Ray's count: the GPUs its nodes found)."""
        return int(float(self.ray_call("print(ray.cluster_resources().get('GPU', 0))").strip()))

    def kill_actor(self, name: str) -> None:
        """``ray.kill`` of a named actor in atomr's namespace: a replica dies as a crash kills it."""
        self.ray_call("ray.kill(ray.get_actor(sys.argv[1], namespace='atomr'))", name)

    def running(self) -> bool:
        return bool(head_processes(self.port))

    def down(self, timeout: float = 300) -> subprocess.CompletedProcess[str] | None:
        """``atomr down`` (None when no head runs), then stop whatever of the head is left;
        ``left_after_down`` says how many of its processes ``atomr down`` itself left running."""
        proc = None
        self.left_after_down = 0
        if self.running():
            try:
                proc = self.atomr("down", timeout=timeout, check=False)
                self.left_after_down = len(head_processes(self.port))
            finally:
                stop_head(self.port)
        return proc
