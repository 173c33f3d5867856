"""``atomr serve`` stops the API on SIGINT, SIGTERM and SIGHUP (a closed terminal, a dropped ssh
session), in a child process whose output is a terminal (a pty); no Ray."""

from __future__ import annotations

import os
import pty
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What serve_command does around its wait: the handlers, the wait, then its lines and the stop.
CHILD = """
import signal, sys
from atomr_infer.cli.app import out
from atomr_infer.cli.serve import stop_on_signals
if sys.argv[2] == "nohup":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
stop = stop_on_signals()
out.print("ready")
stopped = stop.wait(3.0)
out.print("stopping…")
open(sys.argv[1], "w").write("stopped the API" if stopped else "still serving")
"""


def serve_and_signal(tmp_path: Path, sig: signal.Signals, hang_up: bool, nohup: bool = False) -> tuple[int, str]:
    """(exit status, what the child did) after ``sig``; ``hang_up``: its terminal closed first."""
    done = tmp_path / "done"
    master, terminal = pty.openpty()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(done), "nohup" if nohup else "-"], cwd=ROOT,
                             stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
    os.close(terminal)
    seen = b""
    while b"ready" not in seen:
        seen += os.read(master, 1024)
    if hang_up:
        os.close(master)  # the terminal is gone: writing to it fails (EIO)
    child.send_signal(sig)
    code = child.wait(timeout=30)
    if not hang_up:
        os.close(master)
    return code, done.read_text() if done.exists() else "killed"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_and_sigterm_stop_the_api(sig, tmp_path):
    assert serve_and_signal(tmp_path, sig, hang_up=False) == (0, "stopped the API")


def test_a_closed_terminal_stops_the_api_and_its_lines_do_not_fail_the_stop(tmp_path):
    """SIGHUP killed the process without stopping the API, which went on running."""
    assert serve_and_signal(tmp_path, signal.SIGHUP, hang_up=True) == (0, "stopped the API")


def test_under_nohup_a_closed_terminal_leaves_it_serving(tmp_path):
    assert serve_and_signal(tmp_path, signal.SIGHUP, hang_up=False, nohup=True) == (0, "still serving")


def test_a_signal_that_lands_while_the_main_thread_waits_stops_it(tmp_path):
    """The stop was a threading.Event set by the handler: a signal that landed while the main
    thread, in the Event's wait, held its lock hung ``atomr serve`` for good (one in a few hundred)."""
    rounds = """
import os, signal, threading
from atomr_infer.cli.serve import stop_on_signals
for _ in range(300):
    stop = stop_on_signals()
    threading.Timer(0.001, os.kill, (os.getpid(), signal.SIGINT)).start()
    while not stop.wait(0.0):
        pass
print("stopped every time")
"""
    proc = subprocess.run([sys.executable, "-c", rounds], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == "stopped every time", proc.stderr
