"""Ctrl-C while ``start_local_head`` waits for ``ray start``: the head's daemons are stopped too.

``ray start`` runs in a session of its own, so Ctrl-C reaches only atomr, which kills ``ray
start``; the daemons it had launched (gcs_server, raylet, dashboard) kept running, and with no
marker written yet, ``atomr down`` left them running ("atomr did not start it").
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from atomr_infer.local_ray import free_port, gcs_server

# A `ray start` that launches a long-lived gcs_server (as the real one does, detached from it),
# says so, then hangs as a slow start does.
FAKE_RAY = """#!{python}
import subprocess, sys, time
port = next(a for a in sys.argv if a.startswith("--port=")).split("=", 1)[1]
subprocess.Popen(["{gcs}", f"--gcs_server_port={{port}}", "--session-dir={session}"], start_new_session=True)
open("{launched}", "w").close()
time.sleep(600)
"""
FAKE_GCS = """#!{python}
import time
time.sleep(600)
"""
START = """
from atomr_infer import cluster
cluster._ray_cli = lambda: {ray!r}
cluster.start_local_head(dashboard=False)
"""


def test_ctrl_c_while_the_head_starts_stops_what_ray_start_launched(tmp_path: Path) -> None:
    gcs, ray, launched = tmp_path / "gcs_server", tmp_path / "ray", tmp_path / "launched"
    gcs.write_text(FAKE_GCS.format(python=sys.executable))
    ray.write_text(FAKE_RAY.format(python=sys.executable, gcs=gcs, session=tmp_path / "session_1", launched=launched))
    for script in (gcs, ray):
        script.chmod(0o755)
    port = free_port()
    env = os.environ | {"ATOMR_RAY_PORT": str(port), "ATOMR_STATE_DIR": str(tmp_path / "state")}
    atomr = subprocess.Popen([sys.executable, "-c", START.format(ray=str(ray))], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not launched.exists() and atomr.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert launched.exists(), atomr.communicate()
        assert gcs_server(port) is not None  # (the fake is found as the real one would be)
        atomr.send_signal(signal.SIGINT)  # Ctrl-C in the terminal: atomr's process group, not `ray start`'s
        _, stderr = atomr.communicate(timeout=60)
        assert "KeyboardInterrupt" in stderr
        assert gcs_server(port) is None, "the head's gcs_server was left running"
    finally:
        atomr.kill()
        if (left := gcs_server(port)) is not None:
            with contextlib.suppress(psutil.Error):
                left.kill()
