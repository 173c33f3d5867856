"""One local Ray and one SmolLM2 deployment per test session, shared by the integration tests.

Ray runs in-process (``ray.init``) with logical GPUs, so placement is tested on a CPU-only
host while the engines run on vLLM's CPU backend. The deployment ``smollm2`` is applied once
and reused; tests that need their own replicas create deployments with other names and remove
them at the end.
"""

from __future__ import annotations

import os

import pytest

from atomr_infer.spec import Deployment, load_deployments

LOGICAL_GPUS = 4
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    ray.init(
        num_cpus=8,
        num_gpus=LOGICAL_GPUS,
        namespace="atomr",
        include_dashboard=False,
        log_to_driver=False,
        logging_level="WARNING",
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def manager(ray_cluster):
    from atomr_infer.cluster import manager as get_manager

    return get_manager()


@pytest.fixture(scope="session")
def smollm2(manager, ray_cluster) -> str:
    """The shared CPU deployment (one replica), ready; its name."""
    spec = smollm2_spec()
    ray_cluster.get(manager.apply.remote(spec))
    status = ray_cluster.get(manager.wait_ready.remote(spec.name, 600))
    assert status is not None and status["replicas_ready"] == 1, status
    return spec.name


@pytest.fixture(scope="session")
def smollm2_replica(smollm2, manager, ray_cluster):
    """The shared deployment's replica actor handle."""
    status = ray_cluster.get(manager.status.remote(smollm2))
    name = next(r["actor_name"] for r in status["replicas"] if r["state"] == "ready")
    return ray_cluster.get_actor(name, namespace="atomr")
