"""A replica Ray cannot place (no node has what it asks for free: a GPU cluster fragmented by other
deployments) says so as its reason while it starts, instead of "starting" with no reason for good."""

from __future__ import annotations

import asyncio

import pytest
import ray

from atomr_infer.control import ray_replicas
from atomr_infer.control.ray_replicas import RayReplicaHandle, Reaper

pytestmark = pytest.mark.integration


class Starting:
    """Answers ready() never, as a replica loading its engine."""

    async def ready(self, timeout=None):
        await asyncio.sleep(3600)


def test_a_replica_ray_has_not_placed_says_what_it_waits_for(ray_cluster, monkeypatch):
    monkeypatch.setattr(ray_replicas, "UNPLACED_AFTER_S", 0.0)
    monkeypatch.setattr(ray_replicas, "UNPLACED_CHECK_S", 0.0)
    nowhere = ray.remote(Starting).options(num_cpus=0, resources={"atomr-test-no-such-node": 1}).remote()
    placed = ray.remote(Starting).options(num_cpus=0).remote()
    try:
        waiting = RayReplicaHandle(nowhere, "atomr:t:r0", Reaper(), asks={"GPU": 2.0, "CPU": 1.0})
        assert "not placed by Ray" in waiting.waiting_for() and "no node has 2 GPU, 1 CPU free" in waiting.waiting_for()
        ray.get(placed.__ray_ready__.remote(), timeout=60)
        assert RayReplicaHandle(placed, "atomr:t:r1", Reaper()).waiting_for() is None  # placed, still starting
    finally:
        ray.kill(nowhere)
        ray.kill(placed)
