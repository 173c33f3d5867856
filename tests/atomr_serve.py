"""``atomr serve`` as a user runs it in a terminal: a subprocess whose output lines are read as
they come, used by the e2e tier's session server (tests/e2e/conftest.py), the CLI tests and the
GPU smoke (scripts/gpu_smoke.py, which runs without pytest)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ATOMR = Path(sys.executable).parent / "atomr"
# The console script beside the interpreter, else the module it runs (packages installed
# without their scripts, as on a GPU host's own venv with --target).
ATOMR_COMMAND = [str(ATOMR)] if ATOMR.exists() else [sys.executable, "-m", "atomr_infer.cli.main"]
READY_LINE = "Ctrl-C to stop."  # its last line once it serves


class ServeDidNotStart(AssertionError):
    """``atomr serve`` exited or said nothing within its start timeout (a test failure)."""


class AtomrServe:
    def __init__(self, args: list[str], env: dict[str, str], start_timeout_s: float = 180.0,
                 cwd: Path | None = None) -> None:
        """Start ``atomr serve *args`` and return once it says it serves (``ServeDidNotStart`` if it
        exits or says nothing within ``start_timeout_s``, after killing it)."""
        self.proc = subprocess.Popen([*ATOMR_COMMAND, "serve", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                                     stdin=subprocess.DEVNULL)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + start_timeout_s
        while READY_LINE not in self.lines:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise ServeDidNotStart("atomr serve did not start:\n" + "\n".join(self.lines[-40:]))
            time.sleep(0.2)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        self.lines.extend(line.rstrip() for line in self.proc.stdout)

    def exit_code(self, timeout: float) -> int:
        """Its exit code, once it exits on its own and its last line is read."""
        code = self.proc.wait(timeout=timeout)
        self._reader.join(10)
        return code

    def interrupt(self, timeout: float = 60.0) -> int:
        """Ctrl-C (SIGINT), as a user stops it; killed if still running after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.exit_code(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(10)
