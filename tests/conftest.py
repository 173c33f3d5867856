"""Fixtures shared by every test tier.

One local Ray and one SmolLM2 deployment per test session, shared by the integration and e2e
tests (defined here, once, so that running both tiers in one session starts one Ray and one
engine). Ray runs in-process (``ray.init``) with logical GPUs, so placement is tested on a
CPU-only host while the engines run on vLLM's CPU backend. The deployment ``smollm2`` is
applied once and reused; tests that need their own replicas create deployments with other
names and remove them at the end.
"""

from __future__ import annotations

import faulthandler
import os
from pathlib import Path

import pytest

from atomr_infer.spec import Deployment, load_deployments

LOGICAL_GPUS = 4
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_GRACE_S = 120


def pytest_unconfigure(config) -> None:
    """If the interpreter is still alive ``EXIT_GRACE_S`` after the session ended (a thread or
    exit hook stuck: once a request that never ended held a non-daemon thread), print every
    thread's stack and exit 1, so that CI fails at once with the reason, not at its time limit."""
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)


def pytest_terminal_summary(terminalreporter) -> None:
    """The machine, at the end of every run: the engine is 10-25x faster on a CPU with native
    bf16, so a run's durations (``--durations``) mean nothing without it."""
    from atomr_infer.engine.cpu import machine_line

    terminalreporter.write_line(f"machine: {machine_line()}")


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """tests/multinode and tests/headft run only when named (``make test`` runs each in a
    session of its own): their clusters and the other tiers' Ray cannot share one process."""
    name = collection_path.name
    if name in ("multinode", "headft") and not any(name in str(a) for a in config.args):
        return True
    return None


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    """The bundled SmolLM2 as an HF directory in the default cache (``$ATOMR_CACHE_DIR`` or
    ``~/.cache/atomr-infer``): converted once per machine (~20-30 s), reused by later sessions."""
    from atomr_infer.models import prepare_bundled

    return prepare_bundled("smollm2-135m-instruct")


def smollm2_spec(**overrides) -> Deployment:
    """deployments/smollm2.yaml, with top-level fields overridden."""
    base = load_deployments(os.path.join(REPO, "deployments", "smollm2.yaml"))[0]
    return Deployment.model_validate({**base.model_dump(), **overrides})


@pytest.fixture(scope="session")
def ray_cluster(bundled_model_dir):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    # No RAY_ADDRESS: a private cluster for this test session, never a user's cluster.
    os.environ.pop("RAY_ADDRESS", None)
    # The Hub is out of reach here: a repo id resolves from the hub cache or fails at once, the
    # same on a machine with network (its processes inherit this).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    context = ray.init(
        address="local",  # always a new private cluster, even if `ray start` runs on this host
        _node_ip_address="127.0.0.1",  # loopback only
        num_cpus=8,
        num_gpus=LOGICAL_GPUS,
        namespace="atomr",
        include_dashboard=True,  # the state API (actor names, logs) needs it
        dashboard_host="127.0.0.1",
        log_to_driver=False,
        logging_level="WARNING",
    )
    ray.dashboard_url = "http://" + context.dashboard_url  # type: ignore[attr-defined]
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def dashboard_url(ray_cluster) -> str:
    """This session's dashboard (state API) address; other Ray clusters may run beside it."""
    return ray_cluster.dashboard_url


@pytest.fixture(scope="session")
def manager(ray_cluster):
    from atomr_infer.control.client import manager_handle as get_manager

    return get_manager()


@pytest.fixture(scope="session")
def smollm2(manager, ray_cluster) -> str:
    """The shared CPU deployment (one replica), ready; its name."""
    spec = smollm2_spec()
    ray_cluster.get(manager.apply.remote(spec))
    status = ray_cluster.get(manager.wait_ready.remote(spec.name, 600))
    assert status is not None and status.replicas_ready == 1, status
    return spec.name


@pytest.fixture(scope="session")
def smollm2_replica(smollm2, manager, ray_cluster):
    """The shared deployment's replica actor handle."""
    status = ray_cluster.get(manager.status.remote(smollm2))
    name = next(r.actor_name for r in status.replicas if r.state == "ready")
    return ray_cluster.get_actor(name, namespace="atomr")
