"""The manager's budget over running deployments (control/budget_checks.py): a CPU deployment's
own ready replicas hold their memory, those still starting do not yet; a deployment scaled to
zero keeps room for one; a spend limit that only warns stops no scaling; a dry-run batch counts
in the cap. The manager runs with its fakes (tests/unit/test_manager.py's ``Harness``); model
sizes are fixed, no model is read."""

from __future__ import annotations

import pytest

from atomr_infer.control import budget_checks
from atomr_infer.control.budget import ClusterView, HeldMemory, scale_cap
from atomr_infer.errors import BudgetExceeded

from .test_autoscale import set_load
from .test_manager import Harness, spec

GiB = 1 << 30


@pytest.fixture
def sizes(monkeypatch):
    """Every model 2 GiB of weights, 64 KiB of KV cache a token, 4,096 tokens of context."""
    monkeypatch.setattr(budget_checks, "size_estimates", lambda spec, on_cpu: (2 * GiB, 64 * 1024, 4096))


def on_cpu(h: Harness, available_gib: float) -> None:
    """The cluster as the manager reads it: no GPU, ``available_gib`` free on its node now."""
    h.manager._cluster_override = ClusterView(total_gpus=0, cpu_memory_available_bytes=int(available_gib * GiB))


def cpu(**kw):
    return spec(name="cpu", device="cpu", **{"runtime_config": {"cpu_kvcache_space_gb": 4}, **kw})


def test_a_running_cpu_deployment_is_not_refused_the_memory_its_own_replicas_hold(sizes) -> None:
    """2 replicas of 2 GiB weights + 4 GiB KV cache on a 16 GiB box: running, they leave 4 GiB
    available. Apply counted both again, and re-sized the KV cache against those 4 GiB: any change
    at all, a scale-down too, was refused over memory the deployment itself held."""
    h = Harness()
    on_cpu(h, 16)
    h.call("apply", cpu(replicas=2))
    h.converge()
    on_cpu(h, 4)
    assert h.call("apply", cpu(replicas=2, serving={"max_concurrent": 16})).actions[0].startswith("update in place")
    assert h.call("apply", cpu(replicas=1, serving={"max_concurrent": 16})).actions == ("scale 2 → 1",)
    h.converge()
    on_cpu(h, 10)  # one stopped: its 6 GiB are free again
    with pytest.raises(BudgetExceeded, match=r"needs 12 GiB of CPU memory, 10 GiB"):  # 2 more, not 1 more
        h.call("apply", cpu(replicas=3))
    assert h.call("apply", cpu(replicas=2)).actions[0] == "scale 1 → 2"
    h.converge()
    on_cpu(h, 4)
    # A roll replaces them: each it stops frees its 6 GiB for the new ones (16 GiB in all).
    same_size = cpu(replicas=2, runtime_config={"cpu_kvcache_space_gb": 4, "max_model_len": 2048})
    plan = h.call("plan", same_size)
    assert plan.budget_ok and "2 x 6.00 GiB of 16.0 GiB free (with the 2 it replaces)" in plan.budget, plan
    with pytest.raises(BudgetExceeded, match=r"needs 18 GiB of CPU memory, 16 GiB"):
        h.call("apply", cpu(replicas=2, runtime_config={"cpu_kvcache_space_gb": 7}))


def test_a_running_cpu_replica_that_sized_its_own_kv_cache_is_not_re_sized_against_what_it_left(
        monkeypatch) -> None:
    """14 GiB of weights on a 32 GiB box: the replica took its KV cache, 13 GiB are left; one
    sequence of 8,192 tokens needs more than 25% of 13 - 14 GiB: a change in place was refused."""
    monkeypatch.setattr(budget_checks, "size_estimates", lambda spec, on_cpu: (14 * GiB, 128 * 1024, 8192))
    h = Harness()
    on_cpu(h, 32)
    big = spec(name="big", device="cpu")
    h.call("apply", big)
    h.converge()
    on_cpu(h, 13)
    assert h.call("apply", spec(name="big", device="cpu", serving={"max_concurrent": 8})).changed
    assert "the 1 running replicas hold theirs" in h.call("plan", spec(name="big", device="cpu")).budget


def test_the_autoscaler_counts_replicas_still_starting_as_needing_their_memory(sizes) -> None:
    """10 GiB free beside the one ready replica, 4 GiB a new one (2 GiB weights, 2 GiB KV cache):
    2 more fit. Counted from its target, the replicas still loading were taken as holding their
    memory already, and every upscale_delay_s the target climbed: 1 → 3 → 5 → 7."""
    h = Harness()
    on_cpu(h, 10)
    h.call("apply", spec(name="cpu", device="cpu", runtime_config={"cpu_kvcache_space_gb": 2}, autoscaling={
        "min_replicas": 1, "max_replicas": 8, "target_ongoing_requests": 1, "upscale_delay_s": 30}))
    h.converge(passes=2)
    for _ in range(121):  # 40 requests wait; the new replicas take minutes to load
        h.call("report_demand", "router", "cpu", 40)
        h.manager.reconcile_once()
        h.clock.advance(1)
    status = h.call("status", "cpu")
    assert status.replicas_desired == 3 and len(h.launcher.started) == 3
    assert "4 replicas would exceed the budget" in status.autoscaling["limited_by_budget"]
    assert "(beside the 1 running)" in status.autoscaling["limited_by_budget"]


def test_a_deployment_scaled_to_zero_keeps_room_for_the_replica_its_next_request_starts() -> None:
    """Scaled to zero, it counted for nothing: another deployment took its 4 GPUs, and its next
    request waited cold_start_timeout_s for a replica that could never start, then 503."""
    h = Harness()  # 4 GPUs
    h.call("apply", spec(name="elastic", gpus=3, autoscaling={"min_replicas": 0, "max_replicas": 1}))
    h.converge()
    assert h.live("elastic") == []
    other = spec(name="other", gpus=2)
    assert not h.call("plan", other).budget_ok
    with pytest.raises(BudgetExceeded, match="needs 5 GPUs"):
        h.call("apply", other)
    # An autoscaled one cannot scale into them either: it has the one GPU left.
    h.call("apply", spec(name="grows", autoscaling={"min_replicas": 0, "max_replicas": 4, "upscale_delay_s": 0}))
    for _ in range(3):  # routers repeat their reports while requests wait
        h.call("report_demand", "router-a", "grows", 40)
        h.converge(passes=1)
    status = h.call("status", "grows")
    assert status.replicas_desired == 1 and "gpus 5 of 4 GPUs" in status.autoscaling["limited_by_budget"]


def test_a_spend_limit_that_only_warns_stops_no_scaling_and_the_decision_says_it_went_over() -> None:
    """on_exceeded: warn lets apply go over the spend limit, but the autoscaler stopped at it."""
    h = Harness()  # 4 L4 GPUs at $0.80/GPU-hour
    warn = {"max_spend_per_hour_usd": 1.0, "on_exceeded": "warn"}
    auto = spec(budget=warn, autoscaling={"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 1,
                                          "upscale_delay_s": 0, "downscale_delay_s": 60})
    scaling = h.call("plan", auto).scaling
    assert "stops it" not in scaling and "3 replicas go over the budget" in scaling and "warn" in scaling, scaling
    h.call("apply", auto)
    h.converge()
    set_load(h, 30)
    h.converge(passes=6)
    status = h.call("status", "demo")
    assert status.replicas_desired == 3 and status.autoscaling["limited_by_budget"] is None
    reason = status.autoscaling["last_decision"]["reason"]
    assert "spend 2.40 USD/hour over budget.max_spend_per_hour_usd=1 (on_exceeded: warn)" in reason, reason
    # reject (the default) still stops it at the limit: $1/hour is one L4
    cluster = ClusterView(total_gpus=4, accelerator_type="L4")
    rejecting = auto.model_copy(update={"budget": auto.budget.model_copy(update={"on_exceeded": "reject"})})
    assert scale_cap(rejecting, [], cluster, 1, 3)[0] == 1 and scale_cap(auto, [], cluster, 1, 3)[0] == 3


def test_plan_caps_the_autoscaling_of_a_spec_by_the_specs_deployed_alongside() -> None:
    h = Harness()  # 4 GPUs
    a, b = spec(name="a", replicas=3), spec(name="b", autoscaling={"min_replicas": 1, "max_replicas": 4})
    plan = h.call("plan", b, (a,))
    assert plan.budget_ok and "the budget stops it at 1: 2 replicas would exceed the budget: gpus 5 of 4" in (
        plan.scaling), plan.scaling


def test_scale_cap_counts_cpu_memory_for_the_replicas_not_held_only() -> None:
    cluster = ClusterView(total_gpus=0, cpu_memory_available_bytes=10 * GiB)
    dep = spec(device="cpu", runtime_config={"cpu_kvcache_space_gb": 2}, autoscaling={"max_replicas": 8})
    sizes = (2 * GiB, 64 * 1024, 4096)  # 4 GiB a replica
    assert scale_cap(dep, [], cluster, 3, 8, sizes)[0] == 5  # 3 ready: 2 more fit
    assert scale_cap(dep, [], cluster, 3, 8, sizes, HeldMemory(1))[0] == 3  # 2 still starting: none more
