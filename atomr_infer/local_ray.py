"""The processes of one local Ray head, found by its GCS port, and how to stop only them.

``ray stop`` kills every Ray on the machine: the user's own, a notebook's, another test
session's. ``atomr down`` must stop only the head ``atomr`` started, so this module finds that
head's processes from its GCS port: the ``gcs_server`` listening there gives the session
directory; every process naming that session directory or that GCS address belongs to it,
and so do their children (workers, the dashboard's subprocesses, vLLM's engine processes).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
from pathlib import Path

import psutil

DEFAULT_DASHBOARD_PORT = 8265


def port_open(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


# Ports the OS never hands out on its own: below its ephemeral range, where every port-0 bind and
# every outgoing connection gets its local port, so none is taken between its pick and its bind;
# above Ray's default worker ports (10002-19999). vLLM's and torch's fixed ports are left out.
_OWN_PORTS_FROM = 20000
_FIXED_ELSEWHERE = range(29500, 29600)  # torch's and vLLM's master and data-parallel ports
_handed_out: set[int] = set()
_random = random.SystemRandom()  # vLLM and pytest seed the global one


def _ephemeral_ports_from() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def bind_error(port: int, host: str = "") -> OSError | None:
    """Why a server could not listen on ``host:port`` now (None: it could), binding as Ray's
    gRPC servers and uvicorn do (SO_REUSEADDR: a closed connection's TIME_WAIT does not count).
    An outgoing connection's local port, which no connect check sees, counts."""
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as exc:
        return exc
    return None


def free_port(preferred: int | None = None) -> int:
    """``preferred`` when it is free on every interface, else a free port from this machine's
    ``_OWN_PORTS_FROM`` up to its ephemeral range, never one this process handed out before."""
    if preferred is not None and bind_error(preferred) is None:
        return preferred
    own = [p for p in range(_OWN_PORTS_FROM, _ephemeral_ports_from()) if p not in _FIXED_ELSEWHERE]
    for port in _random.sample(own, min(64, len(own))):
        if port not in _handed_out and bind_error(port) is None:
            _handed_out.add(port)
            return port
    with socket.socket() as s:  # no such range on this machine (or all taken): let the OS pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def gcs_server(port: int) -> psutil.Process | None:
    """The ``gcs_server`` process serving GCS port ``port`` on this machine, if any."""
    flag = f"--gcs_server_port={port}"
    for proc in psutil.process_iter(["name"]):
        if "gcs_server" in (proc.info.get("name") or "") and flag in _cmdline(proc):
            return proc
    return None


def session_dir(gcs: psutil.Process) -> str | None:
    for arg in _cmdline(gcs):
        if arg.startswith("--session-dir="):
            return arg.split("=", 1)[1]
    return None


def head_processes(port: int) -> list[psutil.Process]:
    """Every process of the local Ray head whose GCS listens on ``port`` (empty if none)."""
    gcs = gcs_server(port)
    if gcs is None:
        return []
    session = session_dir(gcs)
    markers = [f":{port}"] + ([session] if session else [])
    me = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found: dict[int, psutil.Process] = {gcs.pid: gcs}
    for proc in psutil.process_iter():
        if proc.pid in me or proc.pid in found:
            continue
        args = _cmdline(proc)
        if not args or not any("ray" in a for a in args[:3]):
            continue
        joined = " ".join(args)
        if (session and session in joined) or any(
            a.startswith(("--address=", "--gcs-address=", "--gcs_address=")) and a.endswith(markers[0]) for a in args
        ):
            found[proc.pid] = proc
    for proc in list(found.values()):
        with contextlib.suppress(psutil.Error):
            for child in proc.children(recursive=True):
                if child.pid not in me:
                    found.setdefault(child.pid, child)
    return list(found.values())


def stop_head(port: int, grace_s: float = 3.0) -> int:
    """SIGTERM the head's processes, SIGKILL what is left after ``grace_s``; returns how many.

    The GCS and raylet linger for many seconds after SIGTERM (flushing events to an agent that
    is already gone); with the deployments removed there is nothing left to save, so the
    grace period is short."""
    gcs = gcs_server(port)
    session = session_dir(gcs) if gcs is not None else None
    procs = head_processes(port)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)
    # Stragglers: workers the raylet forked while it was being stopped.
    late = head_processes(port)
    for proc in late:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(late, timeout=5)
    forget_address(port, str(Path(session).parent) if session else None)
    return len(procs) + len(late)


def forget_address(port: int, temp_dir: str | None) -> None:
    """Remove Ray's "latest cluster" file if it names this port (what ``ray stop`` resets)."""
    path = Path(temp_dir or "/tmp/ray") / "ray_current_cluster"
    with contextlib.suppress(OSError):
        if path.read_text().strip().endswith(f":{port}"):
            path.unlink()


def started_before(port: int, when: float) -> bool:
    """Whether the head on ``port`` was started before ``when`` (epoch s): it is the one a
    marker written at ``when`` describes, not a newer Ray that took the port since."""
    gcs = gcs_server(port)
    try:
        return gcs is not None and gcs.create_time() <= when + 1.0
    except psutil.Error:
        return False
