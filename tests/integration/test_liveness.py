"""Liveness from progress: a replica whose engine stops moving is found and replaced.

The engine here is ``BrokenEngine`` in hang mode (real tokenizer; its ``step()`` blocks forever
after a few steps, releasing the GIL as a stuck kernel would): no real engine can be made to
hang on purpose. The manager is a private ``DeploymentManager`` actor whose launcher passes
that engine to its replicas; everything else (Ray, the replica actor, the reconcile loop, the
router) is the real code.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time

import pytest
import ray

from atomr_infer.errors import EngineError, ReplicaUnavailable, unwrap
from tests.conftest import smollm2_spec
from tests.replica_http import run
from tests.waiting import wait_until

pytestmark = pytest.mark.integration
STEP_TIMEOUT_S = 3.0


def hanging_factory(model_dir):
    import cloudpickle

    from atomr_infer.engine.vllm.backend import VllmBackend
    from tests.integration import broken_engine

    cloudpickle.register_pickle_by_value(broken_engine)
    return VllmBackend.factory(broken_engine.broken_engine_factory(str(model_dir), fail_after_steps=3, hang=True))


def refused(actor) -> BaseException:
    with pytest.raises(Exception) as info:
        run(actor, {"model": "wedged", "prompt": "again", "max_tokens": 5})
    return unwrap(info.value)


def test_wedged_step_fails_open_streams_and_health(ray_cluster, bundled_model_dir):
    from atomr_infer.replica import replica_actor_class

    actor = replica_actor_class().options(num_cpus=0).remote(
        smollm2_spec(name="wedged"), "r0", hanging_factory(bundled_model_dir), STEP_TIMEOUT_S
    )
    try:
        ray.get(actor.ready.remote(300))
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            bodies = [{"model": "wedged", "prompt": f"p{i}", "max_tokens": 100} for i in range(3)]
            answers = list(pool.map(lambda body: run(actor, body), bodies))
        for answer in answers:  # vLLM's server says why the stream ended: in-band, after its start
            assert "wedged" in answer.body.decode() and answer.finish_reason is None, answer.body[-400:]
        # Found by the watchdog, well within the minute the issue allows (its limit here is 3 s).
        assert time.monotonic() - started < 60
        with pytest.raises(Exception) as info:
            ray.get(actor.health.remote(), timeout=10)  # health answers: it says the engine is stuck
        assert isinstance(unwrap(info.value), EngineError) and "has not returned" in str(unwrap(info.value))
        err = refused(actor)
        assert isinstance(err, ReplicaUnavailable) and "unhealthy" in str(err)  # the router tries another
    finally:
        ray.kill(actor)


def test_manager_notices_a_wedged_replica_within_a_minute_and_replaces_it(ray_cluster, bundled_model_dir):
    from atomr_infer.control.manager import DeploymentManager
    from atomr_infer.control.ray_replicas import RayReplicaLauncher
    from atomr_infer.control.store import MemoryStore

    launcher = RayReplicaLauncher(
        lambda spec: False,
        replica_kwargs={"backend": hanging_factory(bundled_model_dir), "step_timeout_s": STEP_TIMEOUT_S},
    )
    manager = ray.remote(DeploymentManager).options(num_cpus=0).remote(launcher=launcher, store=MemoryStore())
    name = "wedge"
    try:
        ray.get(manager.apply.remote(smollm2_spec(name=name)))
        status = ray.get(manager.wait_ready.remote(name, 300))
        first = status.replicas[0]
        replica = ray.get_actor(first.actor_name, namespace="atomr")
        answer = run(replica, {"model": name, "prompt": "hello", "max_tokens": 50})
        hung_at = time.monotonic()
        assert "wedged" in answer.body.decode(), answer.body[-400:]

        def status_if(holds):
            status = ray.get(manager.status.remote(name))
            return status if holds(status) else None

        def noticed(status):
            return any(r.actor_id == first.actor_id and r.state != "ready" for r in status.replicas)

        def replaced(status):
            ready = [r for r in status.replicas if r.state == "ready"]
            return ready and all(r.actor_id != first.actor_id for r in ready)

        # Noticed within a minute, and replaced within 300 s (a new replica's start takes minutes
        # on a busy 2-core machine).
        wait_until(lambda: status_if(noticed), hung_at + 60 - time.monotonic(), 0.5, what="noticing the wedge")
        status = wait_until(lambda: status_if(replaced), hung_at + 300 - time.monotonic(), 0.5,
                            what="replacing the wedged replica")
        old = next(r for r in status.replicas if r.actor_id == first.actor_id)
        assert old.state == "unhealthy" and "has not returned" in old.reason, old
        assert "has not returned" in status.last_failure
    finally:
        ray.get(manager.remove.remote(name))
        ray.kill(manager)
        # The wedged replica's shutdown cannot finish (its thread is stuck): kill what is left.
        for i in range(4):
            with contextlib.suppress(ValueError):
                ray.kill(ray.get_actor(f"atomr:{name}:r{i}", namespace="atomr"), no_restart=True)
