"""Find or start the Ray cluster (the manager actor is control/client.py's to get or create).

``connect()`` joins ``RAY_ADDRESS`` (or ``address``) when given, else the local head at
``127.0.0.1:$ATOMR_RAY_PORT`` (default 6379, Ray's own default), else — when that variable is
not set — the cluster the last ``ray start`` on this machine recorded, else starts a local head
with ``ray start --head``: a separate process that outlives the caller, so deployments survive
the script or CLI command that made them. It never attaches to another program's in-process
Ray (``ray.init(address="auto")`` would). A marker file records that atomr started the head, so
``atomr down`` stops only a Ray it started (``atomr_infer.local_ray``).

Environment: ``ATOMR_RAY_PORT`` (GCS port), ``ATOMR_RAY_DASHBOARD_PORT`` (default 8265, or a
free port when that one is taken), ``ATOMR_RAY_TEMP_DIR`` (Ray's ``--temp-dir``, default
``/tmp/ray``), ``ATOMR_RAY_NUM_GPUS`` (logical GPUs, for tests).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from atomr_infer.errors import AtomrError, NoCluster, SettingError
from atomr_infer.log import get_logger

log = get_logger(__name__)
MANAGER_NAME = "atomr-manager"
NAMESPACE = "atomr"


def state_dir() -> Path:
    base = os.environ.get("ATOMR_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME", os.path.expanduser("~/.local/state")), "atomr-infer"
    )
    return Path(base)


def started_marker() -> Path:
    return state_dir() / "ray-started-by-atomr"


def _ray_cli() -> str:
    exe = Path(sys.executable).parent / "ray"
    return str(exe) if exe.exists() else "ray"


def local_address() -> str:
    """Where atomr's local head listens (or would): ``127.0.0.1:$ATOMR_RAY_PORT``."""
    port = os.environ.get("ATOMR_RAY_PORT") or "6379"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise SettingError(f"ATOMR_RAY_PORT is {port!r}: set it to a port number (1-65535), or unset it for 6379")
    return f"127.0.0.1:{port}"


def start_local_head(dashboard: bool = True) -> str:
    """``ray start --head`` on loopback; returns the GCS address."""
    from atomr_infer.local_ray import DEFAULT_DASHBOARD_PORT, bind_error, free_port, stop_head

    port = local_address().rsplit(":", 1)[1]
    cmd = [
        _ray_cli(), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1", f"--include-dashboard={'true' if dashboard else 'false'}",
        "--disable-usage-stats",
    ]
    if dashboard:  # `ray start` fails outright when the dashboard's port is taken
        wanted = os.environ.get("ATOMR_RAY_DASHBOARD_PORT")
        cmd.append(f"--dashboard-port={wanted or free_port(DEFAULT_DASHBOARD_PORT)}")
    # The node's agent (logs, state API) dies quietly when its port is taken, by another Ray's
    # agent on Ray's default (52365) or by a connection's port from the ephemeral range.
    cmd.append(f"--dashboard-agent-listen-port={free_port()}")
    if os.environ.get("ATOMR_RAY_TEMP_DIR"):
        cmd.append(f"--temp-dir={os.environ['ATOMR_RAY_TEMP_DIR']}")
    if os.environ.get("ATOMR_RAY_NUM_GPUS"):  # logical GPUs, for tests of placement on CPU hosts
        cmd.append(f"--num-gpus={os.environ['ATOMR_RAY_NUM_GPUS']}")
    # No log monitor (45 MiB): it streams workers' output to drivers, and atomr's drivers take
    # none (log_to_driver=False); `atomr logs` and the dashboard read the log files themselves.
    if os.environ.get("ATOMR_RAY_LOG_MONITOR", "0") != "1":
        cmd.append("--include-log-monitor=false")
    if os.environ.get("ATOMR_RAY_NUM_CPUS"):  # a GPU node's core count, reproduced on a small host
        cmd.append(f"--num-cpus={os.environ['ATOMR_RAY_NUM_CPUS']}")
    # No idle workers started ahead of need: atomr starts its actors one by one, each in a
    # worker of its own, and Ray would otherwise keep up to one idle Python worker per CPU
    # (12 of 16, 0.51 GiB, on the first H100 run).
    env = {"RAY_prestart_worker_first_driver": "0", "RAY_enable_worker_prestart": "0", **os.environ}
    log.info("ray_head_starting", port=port)
    for attempt in (1, 2):  # the dashboard's start fails now and then on a busy machine
        # The GCS listens on 127.0.0.1 (--node-ip-address); where it cannot, it fails after 40 s.
        if taken := bind_error(int(port), "127.0.0.1"):
            raise AtomrError(f"cannot start a local Ray head on 127.0.0.1:{port}: {taken.strerror} "
                             "(hint: set ATOMR_RAY_PORT to a free port)")
        # A new session: the head's daemons have no controlling terminal, so closing the
        # terminal (SIGHUP) or Ctrl-C in it does not take them down with the command.
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, start_new_session=True, env=env
            )
        except BaseException:  # Ctrl-C: `ray start` is killed, the daemons it started are not
            stop_head(int(port))  # (no marker yet: `atomr down` would leave them running)
            raise
        if proc.returncode == 0:
            break
        stop_head(int(port))  # a failed `ray start` leaves some of its processes behind
        log.warning("ray_head_start_failed", port=port, attempt=attempt, error=_error_line(proc))
    if proc.returncode != 0:
        logs = f"{os.environ.get('ATOMR_RAY_TEMP_DIR', '/tmp/ray')}/session_latest/logs"
        raise AtomrError(f"could not start a local Ray head on port {port}: {_error_line(proc)} (hint: see {logs})")
    address = f"127.0.0.1:{port}"
    marker = started_marker()
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(address)
    return address


def _error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The line of a failed command's output that says what went wrong."""
    text = proc.stderr + proc.stdout
    # A GCS that did not start: Ray's last line only points at a log; the GCS's own says why.
    if gcs := re.search(r"\(gcs_server\).*?Check failed: \S+ ([^.\n]+\.(?: The specified port is \d+\.)?)", text):
        return f"its GCS did not start: {gcs.group(1)}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or "error:" in ln or "Failed" in ln]
    return (errors or lines or [f"exit code {proc.returncode}"])[-1]


def connect(address: str | None = None, start: bool = True) -> None:
    """Connect this process to Ray (see module docstring). No-op when already connected.
    Joining a cluster gives up within ``CONNECT_TIMEOUT_S`` with the address, the reason and a
    hint (``ray.init`` alone retries an unreachable GCS for many minutes, silently)."""
    import ray

    if ray.is_initialized():
        _check_same_cluster(address)
        return
    use_local_auth_token()
    target = target_address(address)
    if target:
        source = "--address" if address else ("RAY_ADDRESS" if os.environ.get("RAY_ADDRESS", "").strip() else "local")
        check_reachable(target, source)
        _init_within(target, CONNECT_TIMEOUT_S)
        return
    if not start:
        raise NoCluster("no Ray cluster is running (hint: `atomr up`, or set RAY_ADDRESS)")
    _init_within(start_local_head(), CONNECT_TIMEOUT_S)


def _check_same_cluster(address: str | None) -> None:
    """``address`` given to a process already in Ray: the cluster it is in, or ``AtomrError``.
    It was ignored: a notebook that had run ``ray.init()`` made its deployments in that throwaway
    cluster, which ``atomr status`` never sees."""
    import ray

    if not address or address == "auto" or address.startswith("ray://"):
        return
    current = ray.get_runtime_context().gcs_address
    host, _, port = address.rpartition(":")
    current_host, _, current_port = current.rpartition(":")
    try:
        resolved = socket.gethostbyname(host.strip("[]"))
    except OSError:
        resolved = host
    if port != current_port or not (current_host in (host, resolved) or (_here(resolved) and _here(current_host))):
        raise AtomrError(f"this process is already connected to Ray at {current}, not {address} (hint: "
                         "ray.shutdown() first, or leave out the address to use the cluster it is in)")


def _here(host: str) -> bool:
    """Whether ``host`` is an address of this machine (loopback, or one of its interfaces')."""
    import psutil

    return host.startswith("127.") or host in {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}


CONNECT_TIMEOUT_S = 25.0  # plus the command's own start: every command gives up within 30 s
_JOIN_HINT = ("check the address and that this machine reaches it; a cluster with token auth needs its token "
              "here (RAY_AUTH_TOKEN or ~/.ray/auth_token)")


def check_reachable(target: str, source: str) -> None:
    """Fail at once where ``ray.init`` would wait: nothing listens at the address, or it is a
    loopback address of a head that listens on loopback only (Ray swaps a loopback host for
    this machine's own address before connecting, and then retries that one for many minutes)."""
    from atomr_infer.local_ray import port_open

    if target.startswith("ray://") or target in ("auto", "local"):
        return
    host, _, port_text = target.rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise SettingError(f"{source} is {target!r}: expected host:port (or auto, or ray://host:port)")
    port = int(port_text)
    if not port_open(host, port, timeout_s=3.0):
        raise NoCluster(f"no Ray cluster answers at {target} ({source}) (hint: check the address, or `atomr up`)")
    if host not in ("127.0.0.1", "localhost", "::1"):
        return
    try:
        from ray._private.services import get_node_ip_address

        swapped = get_node_ip_address()
    except Exception:  # noqa: BLE001 - private API: without it, the join's time limit still holds
        return
    if swapped not in ("127.0.0.1", "::1") and not port_open(swapped, port, timeout_s=3.0):
        raise AtomrError(
            f"the Ray head at {target} ({source}) listens on loopback only, and Ray connects to "
            f"{swapped}:{port} (this machine's address) instead (hint: start the head with "
            f"`ray start --head --node-ip-address=127.0.0.1`, which listens on every interface)"
        )


def _init_within(target: str, timeout_s: float) -> None:
    """``ray.init(address=target)``, given up after ``timeout_s`` with what was tried."""
    import threading

    import ray

    kwargs: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": False, "logging_level": "WARNING"}
    outcome: list[BaseException | None] = []

    def join() -> None:
        try:
            # Off the main thread Ray cannot set its SIGTERM handler and says so; the CLI's own
            # default (exit) is what it would do anyway.
            with _quiet("ray._private.worker"):
                ray.init(address=target, **kwargs)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            outcome.append(exc)

    # A thread, so that the wait has a limit: ray.init itself has none we can set per call.
    worker = threading.Thread(target=join, name="atomr-ray-join", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        raise AtomrError(f"could not join the Ray cluster at {target} within {timeout_s:g}s: its GCS does not "
                         f"answer (hint: {_JOIN_HINT})")
    error = outcome[0]
    if error is not None:
        text = " ".join(str(error).split())
        raise AtomrError(f"could not join the Ray cluster at {target}: {text[:300]} (hint: {_JOIN_HINT})") from None


def target_address(address: str | None = None) -> str | None:
    """The cluster atomr joins: ``address``, else ``RAY_ADDRESS``, else a Ray head running on
    this machine (``find_local_head``); None when there is none to join."""
    return address or os.environ.get("RAY_ADDRESS", "").strip() or find_local_head()


def find_local_head() -> str | None:
    """The address of a Ray head running on this machine that ``connect()`` would join, if any."""
    from atomr_infer.local_ray import port_open

    local = local_address()
    host, port = local.rsplit(":", 1)
    if port_open(host, int(port)):
        return local
    if os.environ.get("ATOMR_RAY_PORT"):
        return None
    try:  # the cluster `ray start` last recorded here, as `ray status` finds it
        from ray._private.utils import read_ray_address

        recorded = read_ray_address()
    except Exception:  # noqa: BLE001 - private API; without it only the default port counts
        return None
    if recorded and ":" in recorded:
        host, port = recorded.rsplit(":", 1)
        if port.isdigit() and port_open(host, int(port)):
            return recorded
    return None


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """Only errors from ``logger`` while the block runs."""
    import logging

    log_ = logging.getLogger(logger)
    level = log_.level
    log_.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log_.setLevel(level)


def use_local_auth_token() -> None:
    """Send the local Ray auth token (``~/.ray/auth_token``) when one exists.

    ``ray start`` turns token authentication on whenever that file exists (any earlier local
    ``ray.init()`` creates it), but ``ray.init(address=...)`` with an explicit address does not
    turn it on by itself and then fails with ``InvalidAuthToken``. This does what Ray does for
    ``address="auto"``; an explicit ``RAY_AUTH_MODE`` is left alone.
    """
    if os.environ.get("RAY_AUTH_MODE"):
        return
    import logging

    quiet = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    except Exception:  # noqa: BLE001 - private API; a Ray without it has no token auth
        pass
    finally:
        quiet.setLevel(level)
