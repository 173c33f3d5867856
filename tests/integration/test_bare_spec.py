"""A bare CPU spec sizes itself and answers; a spec that cannot start is failed, not retried forever.

Real Ray, real manager, real vLLM on the CPU backend with the bundled model.
"""

from __future__ import annotations

import time

import pytest
import ray

from atomr_infer.client import Client
from atomr_infer.errors import BudgetExceeded, unwrap

pytestmark = pytest.mark.integration
MODEL = "bundled:smollm2-135m-instruct"


def bare(name: str, **runtime_config) -> dict:
    """The spec of issue 12: no dtype, no memory setting."""
    return {"name": name, "model": MODEL, "device": "cpu", "runtime_config": {"max_model_len": 1024, **runtime_config}}


def test_bare_cpu_spec_deploys_sizes_itself_and_answers(manager, smollm2):
    name = "bare"
    try:
        result = ray.get(manager.apply.remote(bare(name)))
        assert result.changed
        status = ray.get(manager.wait_ready.remote(name, 600))
        assert status.replicas_ready == 1, status
        replica = status.replicas[0]
        # It says what it chose: the KV cache as vLLM settled it, and the CPU's native dtype.
        assert replica.kv_cache_bytes > 0 and replica.kv_cache_tokens >= 1024, replica
        assert replica.dtype in ("bfloat16", "float32")
        client = Client(manager=manager)
        try:
            answer = client.chat(name, [{"role": "user", "content": "What is the capital of France?"}], max_tokens=16)
        finally:
            client.close()
        assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
    finally:
        ray.get(manager.remove.remote(name))


def test_a_kv_cache_that_cannot_fit_is_refused_at_admission(manager):
    with pytest.raises(Exception) as info:
        ray.get(manager.apply.remote(bare("huge", cpu_kvcache_space_gb=4000)))
    err = unwrap(info.value)
    assert isinstance(err, BudgetExceeded) and err.check == "memory", repr(err)
    assert err.requested == 4000 and "cpu_kvcache_space_gb" in err.hint
    assert ray.get(manager.status.remote("huge")) is None  # nothing half-created


def test_a_start_failure_that_will_recur_stops_retrying(manager):
    # vLLM finds no AWQ config in a model that is not quantized: it will fail the same way each time
    # (apply cannot tell: the quantization methods are vLLM's). A context above the model's, the
    # failure this test used, is now refused at apply (spec_check.py).
    name = "not-awq"
    try:
        ray.get(manager.apply.remote(bare(name, quantization="awq")))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status = ray.get(manager.status.remote(name))
            if status.failed:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"still retrying: {status}")
        assert status.failure_kind == "recurring" and status.start_failures == 3
        assert "awq" in status.last_failure, status.last_failure
        started = len(status.replicas)
        time.sleep(3)  # past the backoff it would have used: nothing new starts
        assert len(ray.get(manager.status.remote(name)).replicas) == started
        again = ray.get(manager.apply.remote(bare(name, quantization="awq")))
        assert again.changed and again.actions[0].startswith("retry after failure")
        assert not ray.get(manager.status.remote(name)).failed
    finally:
        ray.get(manager.remove.remote(name))


def test_a_context_above_the_models_is_refused_at_apply_naming_the_field(manager):
    from atomr_infer.errors import SpecError

    with pytest.raises(SpecError, match="runtime_config.max_model_len: 100000 is above the model's context length"):
        ray.get(manager.apply.remote(bare("too-long", max_model_len=100_000, cpu_kvcache_space_gb=5)))
    assert ray.get(manager.status.remote("too-long")) is None  # nothing half-created


def test_a_replica_no_node_can_place_says_what_it_waits_for(manager, ray_cluster):
    from atomr_infer.cli import common

    # Something outside atomr holds every free CPU: the replica's actor cannot be placed.
    free = int(ray.available_resources().get("CPU", 0))
    hog = ray.remote(num_cpus=free)(_Idle).remote() if free else None
    name = "unplaceable"
    try:
        ray.get(manager.apply.remote(bare(name)))
        deadline = time.monotonic() + 60
        while True:
            status = ray.get(manager.status.remote(name))
            reasons = common.waiting_reasons(status.replicas, {})
            if reasons:
                break
            assert time.monotonic() < deadline, status
            time.sleep(1)
        assert reasons == {f"atomr:{name}:r0": "waiting for a node with 1 CPU free"}, reasons
    finally:
        ray.get(manager.remove.remote(name))
        if hog is not None:
            ray.kill(hog)


class _Idle:
    def ping(self) -> str:
        return "ok"
