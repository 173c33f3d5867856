"""Find or start the Ray cluster, and get or create the manager actor.

``connect()`` joins ``RAY_ADDRESS`` (or ``address``) when given, else a Ray already running on
this machine, else starts a local head with ``ray start --head`` — a separate process that
outlives the caller, so deployments survive the script or CLI command that made them.
A marker file records that atomr started it, so ``atomr down`` stops only a Ray it started.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from atomr_infer.errors import AtomrError
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


def start_local_head(dashboard: bool = True) -> str:
    """``ray start --head`` on loopback; returns the GCS address."""
    port = os.environ.get("ATOMR_RAY_PORT", "6379")
    cmd = [
        _ray_cli(), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
        "--dashboard-host=127.0.0.1", f"--include-dashboard={'true' if dashboard else 'false'}",
        "--disable-usage-stats",
    ]
    if os.environ.get("ATOMR_RAY_NUM_GPUS"):  # logical GPUs, for tests of placement on CPU hosts
        cmd.append(f"--num-gpus={os.environ['ATOMR_RAY_NUM_GPUS']}")
    log.info("ray_head_starting", port=port)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise AtomrError(f"could not start a local Ray head: {' | '.join(tail)}")
    address = f"127.0.0.1:{port}"
    marker = started_marker()
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(address)
    return address


def connect(address: str | None = None, start: bool = True) -> None:
    """Connect this process to Ray (see module docstring). No-op when already connected."""
    import ray

    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": False, "logging_level": "WARNING"}
    if target:
        ray.init(address=target, **kwargs)
        return
    try:
        ray.init(address="auto", **kwargs)
    except ConnectionError:
        if not start:
            raise AtomrError("no Ray cluster is running (hint: `atomr up`, or set RAY_ADDRESS)") from None
        ray.init(address=start_local_head(), **kwargs)


def manager(address: str | None = None, start: bool = True) -> Any:
    """The ``DeploymentManager`` actor handle, created (detached, restartable) if absent."""
    import ray

    from atomr_infer.control.manager import DeploymentManager

    connect(address, start=start)
    try:
        return ray.get_actor(MANAGER_NAME, namespace=NAMESPACE)
    except ValueError:
        if not start:
            raise AtomrError("the atomr manager is not running (hint: `atomr up` or `atomr deploy FILE`)") from None
    actor_cls = ray.remote(DeploymentManager)
    handle = actor_cls.options(
        name=MANAGER_NAME,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,  # two CLIs racing to create it get the same actor
        max_restarts=-1,  # a crashed manager comes back and re-adopts replicas
        max_task_retries=0,
        num_cpus=0,
        max_concurrency=1000,
    ).remote()
    ray.get(handle.ping.remote())
    return handle
