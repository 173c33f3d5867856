"""An engine core that fails to start in a process of its own: the user sees its own exception.

With the core in its own process (vLLM's default on GPUs, ``VLLM_ENABLE_V1_MULTIPROCESSING=1``
here on the CPU backend), vLLM's frontend only raises "Engine core initialization failed. See
root cause above."; the cause is in the core process's stderr. Real Ray, a real manager, real
vLLM with the bundled model whose config the frontend accepts
and the core's worker fails to build the model from it.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import ray

from atomr_infer.errors import EngineStartFailed, unwrap
from atomr_infer.replica import replica_actor_class

pytestmark = pytest.mark.integration
CORE_IN_ITS_OWN_PROCESS = {"runtime_env": {"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}}


@pytest.fixture(scope="module")
def unbuildable_model(bundled_model_dir: Path, tmp_path_factory) -> Path:
    """The bundled model whose config names an activation function no model code has: the
    replica's frontend reads the config, the engine's worker fails to build the model."""
    import json

    out = tmp_path_factory.mktemp("unbuildable-model")
    for item in bundled_model_dir.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item)
    config = json.loads((bundled_model_dir / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "hidden_act": "no_such_activation"}))
    return out


def spec(name: str, model: Path) -> dict:
    return {
        "name": name, "model": str(model), "device": "cpu",
        "runtime_config": {"max_model_len": 512, "enforce_eager": True, "cpu_kvcache_space_gb": 0.25},
    }


def test_the_replica_raises_the_core_processes_own_exception(ray_cluster, unbuildable_model):
    actor = replica_actor_class().options(num_cpus=0, **CORE_IN_ITS_OWN_PROCESS).remote(
        spec("unbuildable", unbuildable_model), "r0"
    )
    try:
        with pytest.raises(Exception) as info:
            ray.get(actor.ready.remote(300), timeout=320)
        err = unwrap(info.value)
        assert isinstance(err, EngineStartFailed), repr(err)
        assert "initialization failed" not in err.message, err.message
        assert "in a vLLM engine process, at " in err.message and ".py:" in err.message, err.message
        # the model code's own words, from the worker process under the core
        assert "ValueError" in err.message and "no_such_activation" in err.message, err.message
        assert err.recurring
        phase = ray.get(actor.stats.remote()).phase  # what `atomr deploy` shows: never the wrapper's name
        assert phase.startswith("failed") and "CoreStartFailed" not in phase, phase
    finally:
        with contextlib.suppress(Exception):
            ray.kill(actor)


def test_the_manager_records_it_and_stops_retrying(ray_cluster, unbuildable_model):
    from atomr_infer.control.client import manager_options
    from atomr_infer.control.manager import DeploymentManager
    from atomr_infer.control.ray_replicas import RayReplicaLauncher
    from atomr_infer.control.reconcile import ReconcileConfig

    launcher = RayReplicaLauncher(lambda _spec: False, actor_options=CORE_IN_ITS_OWN_PROCESS)
    manager = ray.remote(DeploymentManager).options(**manager_options("atomr-core-failure-test")).remote(
        launcher=launcher, reconcile_config=ReconcileConfig(max_start_failures=1)
    )
    name = "unbuildable-managed"
    try:
        ray.get(manager.apply.remote(spec(name, unbuildable_model)))
        deadline = time.monotonic() + 300
        while not (status := ray.get(manager.status.remote(name))).failed:
            assert time.monotonic() < deadline, f"still retrying: {status}"
            time.sleep(0.5)
        assert status.failure_kind == "recurring", status
        assert "in a vLLM engine process" in status.last_failure, status.last_failure
        assert "initialization failed" not in status.last_failure, status.last_failure
    finally:
        with contextlib.suppress(Exception):
            ray.get(manager.remove.remote(name))
        ray.kill(manager)
