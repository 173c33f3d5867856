"""Liveness from progress: a replica whose engine stops moving is found and replaced.

The engine here is ``BrokenEngine`` in hang mode (real tokenizer; its ``step()`` blocks forever
after a few steps, releasing the GIL as a stuck kernel would): no real engine can be made to
hang on purpose. The manager is a private ``DeploymentManager`` actor whose launcher passes
that engine to its replicas; everything else (Ray, the replica actor, the reconcile loop, the
router) is the real code.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import ray

from atomr_infer.errors import EngineError, unwrap
from tests.conftest import smollm2_spec

pytestmark = pytest.mark.integration
STEP_TIMEOUT_S = 3.0


def hanging_factory(model_dir):
    import cloudpickle

    from tests.integration import broken_engine

    cloudpickle.register_pickle_by_value(broken_engine)
    return broken_engine.broken_engine_factory(str(model_dir), fail_after_steps=3, hang=True)


def drain(gen) -> BaseException:
    with pytest.raises(Exception) as info:
        for ref in gen:
            ray.get(ref)
    return unwrap(info.value)


def test_wedged_step_fails_open_streams_and_health(ray_cluster, bundled_model_dir):
    from atomr_infer.replica import replica_actor_class

    actor = replica_actor_class().options(num_cpus=0).remote(
        smollm2_spec(name="wedged"), "r0", hanging_factory(bundled_model_dir), STEP_TIMEOUT_S
    )
    try:
        ray.get(actor.ready.remote(120))
        gens = [actor.generate.remote({"prompt": f"p{i}", "max_tokens": 100}) for i in range(3)]
        started = time.monotonic()
        for gen in gens:
            err = drain(gen)
            assert isinstance(err, EngineError) and "wedged" in str(err), repr(err)
        # Found by the watchdog, well within the minute the issue allows (its limit here is 3 s).
        assert time.monotonic() - started < 60
        with pytest.raises(Exception) as info:
            ray.get(actor.health.remote(), timeout=10)  # health answers: it says the engine is stuck
        assert isinstance(unwrap(info.value), EngineError) and "has not returned" in str(unwrap(info.value))
        err = drain(actor.generate.remote({"prompt": "again", "max_tokens": 5}))
        assert isinstance(err, EngineError) and "unhealthy" in str(err)
    finally:
        ray.kill(actor)


def test_manager_replaces_a_wedged_replica_within_a_minute(ray_cluster, bundled_model_dir):
    from atomr_infer.control.manager import DeploymentManager
    from atomr_infer.control.ray_replicas import RayReplicaLauncher
    from atomr_infer.control.store import MemoryStore

    launcher = RayReplicaLauncher(
        lambda spec: False,
        replica_kwargs={"engine_factory": hanging_factory(bundled_model_dir), "step_timeout_s": STEP_TIMEOUT_S},
    )
    manager = ray.remote(DeploymentManager).options(num_cpus=0).remote(launcher=launcher, store=MemoryStore())
    name = "wedge"
    try:
        ray.get(manager.apply.remote(smollm2_spec(name=name)))
        status = ray.get(manager.wait_ready.remote(name, 120))
        first = status.replicas[0]
        replica = ray.get_actor(first.actor_name, namespace="atomr")
        gen = replica.generate.remote({"prompt": "hello", "max_tokens": 50})
        hung_at = time.monotonic()
        assert isinstance(drain(gen), EngineError)
        deadline = hung_at + 60
        while time.monotonic() < deadline:
            status = ray.get(manager.status.remote(name))
            ready = [r for r in status.replicas if r.state == "ready"]
            if ready and all(r.actor_id != first.actor_id for r in ready):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"the wedged replica was not replaced within 60 s: {status}")
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
