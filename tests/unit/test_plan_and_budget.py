"""Plans for every change class, and the budget arithmetic (no Ray)."""

from __future__ import annotations

import pytest

from atomr_infer.control.budget import ClusterView, check_budget
from atomr_infer.control.cluster_view import prices_from_env
from atomr_infer.control.managed import runtime_key
from atomr_infer.control.plan import plan_apply, plan_remove
from atomr_infer.errors import BudgetExceeded, DeviceUnavailable
from atomr_infer.spec import Deployment

GiB = 1 << 30


def spec(**kw) -> Deployment:
    return Deployment.model_validate({"name": "d", "model": "org/m", **kw})


def test_create_unchanged_and_each_change_class():
    base = spec(replicas=2, runtime_config={"max_model_len": 2048})
    assert plan_apply(None, base).summary == "create 2 replicas"
    same = plan_apply(base, spec(replicas=2, runtime_config={"max_model_len": 2048}))
    assert not same.changed and same.summary == "unchanged"
    assert plan_apply(base, spec(replicas=4, runtime_config={"max_model_len": 2048})).summary == "scale 2 → 4"
    roll = plan_apply(base, spec(replicas=2, runtime_config={"max_model_len": 4096}))
    assert roll.restart and roll.summary == "roll 2 replicas (runtime_config.max_model_len: 2048 → 4096)"
    inplace = plan_apply(base, spec(replicas=2, runtime_config={"max_model_len": 2048}, serving={"max_concurrent": 64}))
    assert not inplace.restart and inplace.summary == "update in place (serving.max_concurrent: 32 → 64)"


def test_combined_changes_list_every_action():
    base = spec(replicas=2)
    plan = plan_apply(base, spec(replicas=3, model="org/other", budget={"max_spend_per_hour_usd": 9}))
    kinds = [a.kind for a in plan.actions]
    assert kinds == ["roll", "scale", "update_in_place"]


def test_restart_on_apply_forces_a_roll():
    base = spec(restart_on_apply=True)
    plan = plan_apply(base, spec(restart_on_apply=True), force_restart=True)
    assert plan.changed and plan.restart and "restart_on_apply: true" in plan.summary


def test_runtime_key_ignores_in_place_and_scale_fields():
    base = spec()
    assert runtime_key(base, 0) == runtime_key(spec(replicas=5, serving={"max_concurrent": 3}), 0)
    assert runtime_key(base, 0) != runtime_key(spec(gpus=2), 0)
    assert runtime_key(base, 0) != runtime_key(base, 1)


def test_vllm_server_options_roll_the_replicas_and_plan_agrees_with_the_runtime_key():
    base = spec()
    changed = spec(serving={"openai": {"tool_call_parser": "hermes", "enable_auto_tool_choice": True}})
    plan = plan_apply(base, changed)
    assert plan.restart and "serving.openai.tool_call_parser" in plan.summary
    assert runtime_key(base, 0) != runtime_key(changed, 0)  # the replicas do roll
    limits = spec(serving={"max_concurrent": 3, "on_capacity_exhausted": "reject"})
    assert not plan_apply(base, limits).restart and runtime_key(base, 0) == runtime_key(limits, 0)


def test_a_name_or_alias_answers_for_one_deployment_only():
    from atomr_infer.control.plan import check_names
    from atomr_infer.errors import SpecError

    other = Deployment.model_validate(
        {"name": "other", "model": "org/m", "serving": {"openai": {"served_model_name": ["shared"]}}}
    )
    check_names(spec(serving={"openai": {"served_model_name": ["mine"]}}), [other])
    for clash in ("shared", "other"):
        with pytest.raises(SpecError, match=f"'{clash}' already names deployment 'other'") as info:
            check_names(spec(serving={"openai": {"served_model_name": [clash]}}), [other])
        assert info.value.problems[0].field == "serving.openai.served_model_name"
    # the clash is the spec's own name: said on `name`, and that it is the other's alias
    with pytest.raises(SpecError) as info:
        check_names(spec(name="shared"), [other])
    problem = info.value.problems[0]
    assert problem.field == "name", problem
    assert problem.message == "'shared' already names deployment 'other' (one of its serving.openai.served_model_name)"


def test_remove_plans():
    assert not plan_remove(None, "x").changed
    assert plan_remove(spec(replicas=3), "d").summary == "drain and remove 3 replicas"


def test_gpu_check_counts_every_deployment():
    cluster = ClusterView(total_gpus=4)
    others = [spec(name="a", device="cuda", gpus=2)]
    check_budget(spec(device="cuda", gpus=2), others, cluster)
    with pytest.raises(BudgetExceeded) as info:
        check_budget(spec(device="cuda", gpus=2, replicas=2), others, cluster)
    err = info.value
    assert (err.check, err.requested, err.available) == ("gpus", 6, 4)
    assert "others hold 2" in err.hint


def test_a_replica_larger_than_every_node_is_refused_whatever_the_total():
    """gpus: 2 on two 1-GPU nodes (2 in all) passed, and the replica was never placed: Ray takes
    one actor's GPUs from one node. So did cpu_threads above every node's CPUs."""
    two_small = ClusterView(total_gpus=2, largest_node_gpus=1, largest_node_cpus=2)
    with pytest.raises(BudgetExceeded, match="needs 2 GPUs on one node, 1 GPUs on one node available") as info:
        check_budget(spec(device="cuda", gpus=2), [], two_small)
    assert "lower gpus, or add a node with 2 GPUs" in info.value.hint
    verdict = check_budget(spec(device="cuda", gpus=2), [], two_small, raise_on_fail=False)
    assert not verdict.ok and "must be on one node; the largest has 1" in str(verdict.checks)
    assert check_budget(spec(device="cuda", gpus=1, replicas=2), [], two_small).ok
    with pytest.raises(BudgetExceeded, match="cpus budget: needs 8 CPUs on one node"):
        check_budget(spec(device="cpu", runtime_config={"cpu_threads": 8}), [], two_small)
    assert check_budget(spec(device="cpu", runtime_config={"cpu_threads": 2}), [], two_small).ok
    assert check_budget(spec(device="cuda", gpus=8), [], ClusterView(total_gpus=8)).ok  # nodes unknown: not checked


def test_a_change_that_asks_no_more_than_before_goes_ahead_on_a_cluster_that_lost_a_node():
    """2 replicas x 2 GPUs, then a node is lost (1 GPU left, or none): the GPU and one-node checks
    refused any apply of the deployment, an in-place one too; it is let through with a warning.
    A replica asking for more GPUs than before is still refused."""
    before = spec(device="cuda", gpus=2, replicas=2)
    same = spec(device="cuda", gpus=2, replicas=2, serving={"max_concurrent": 8})
    shrunk = ClusterView(total_gpus=1, largest_node_gpus=1, largest_node_cpus=8)
    verdict = check_budget(same, [], shrunk, before=before)
    assert not verdict.ok and len(verdict.warnings) == 2, verdict
    assert "the cluster has 1 GPUs, fewer than the 4" in verdict.warnings[0]
    assert "a replica's 2 GPUs must be on one node; the largest has 1 (a node lost?)" in verdict.warnings[1]
    with pytest.raises(BudgetExceeded, match="needs 4 GPUs on one node"):
        check_budget(spec(device="cuda", gpus=4, replicas=1), [], shrunk, before=before)
    with pytest.raises(BudgetExceeded, match="needs 4 GPUs, 1 GPUs available"):
        check_budget(same, [], shrunk)  # new, it asks for them all
    none_left = ClusterView(total_gpus=0, largest_node_gpus=0, largest_node_cpus=8)
    assert check_budget(same, [], none_left, before=before).warnings
    with pytest.raises(DeviceUnavailable):
        check_budget(spec(device="cuda", gpus=2, replicas=3), [], none_left, before=before)


def test_cpu_and_auto_on_gpu_less_cluster_need_no_gpus():
    cluster = ClusterView(total_gpus=0)
    assert check_budget(spec(device="cpu", replicas=3), [], cluster).ok
    assert check_budget(spec(device="auto"), [], cluster).ok
    with pytest.raises(DeviceUnavailable, match="no GPUs"):
        check_budget(spec(device="cuda"), [], cluster)


def test_memory_fit_with_offload_and_hint():
    cluster = ClusterView(total_gpus=1, gpu_memory_bytes=16 * GiB)
    d = spec(device="cuda", runtime_config={"gpu_memory_utilization": 0.5, "max_model_len": 4096})
    with pytest.raises(BudgetExceeded) as info:
        check_budget(d, [], cluster, weights_bytes=10 * GiB, kv_bytes_per_token=64 * 1024)
    assert info.value.check == "memory" and info.value.available == 8.0
    assert "cpu_offload_gb" in info.value.hint and "quantiz" in info.value.hint
    offloaded = spec(device="cuda", runtime_config={"gpu_memory_utilization": 0.5, "cpu_offload_gb": 4})
    assert check_budget(offloaded, [], cluster, weights_bytes=10 * GiB, kv_bytes_per_token=0).ok


def test_spend_hourly_daily_and_warn():
    cluster = ClusterView(total_gpus=8, accelerator_type="H100")
    d = spec(device="cuda", replicas=2, budget={"max_spend_per_hour_usd": 7.5})
    with pytest.raises(BudgetExceeded) as info:
        check_budget(d, [], cluster)
    assert (info.value.check, info.value.requested, info.value.unit) == ("spend", 8.0, "USD/hour")
    daily = spec(device="cuda", budget={"max_spend_per_day_usd": 90})
    with pytest.raises(BudgetExceeded, match="96"):
        check_budget(daily, [], cluster)
    warn = spec(device="cuda", replicas=2, budget={"max_spend_per_hour_usd": 7.5, "on_exceeded": "warn"})
    verdict = check_budget(warn, [], cluster)
    assert verdict.warnings and "on_exceeded: warn" in verdict.warnings[0]


def test_verdict_without_raising_for_plans():
    verdict = check_budget(spec(device="cuda", gpus=8), [], ClusterView(total_gpus=4), raise_on_fail=False)
    assert not verdict.ok and "8 of 4 GPUs" in str(verdict)


def test_price_table_override():
    prices = prices_from_env({"ATOMR_GPU_PRICES": '{"H100": 3.5, "MI300X": 4}'})
    assert prices["H100"] == 3.5 and prices["MI300X"] == 4.0 and prices["T4"] == 0.5
    with pytest.raises(ValueError, match="ATOMR_GPU_PRICES"):
        prices_from_env({"ATOMR_GPU_PRICES": "[1, 2]"})


@pytest.mark.parametrize("alias", ["other:x", "o:x", "mine:x"])
def test_an_alias_may_not_take_the_name_of_an_adapter(alias):
    """``"<deployment>:<adapter>"`` names an adapter; an alias of that form routed first, so it
    took the adapter's requests (and let keys limited to the deployment into another)."""
    from atomr_infer.control.plan import check_names
    from atomr_infer.errors import SpecError

    other = Deployment.model_validate(
        {"name": "other", "model": "org/m", "serving": {"openai": {"served_model_name": ["o"]}}})
    mine = spec(name="mine", serving={"openai": {"served_model_name": [alias]}})
    with pytest.raises(SpecError, match=f"'{alias}' names an adapter of deployment") as info:
        check_names(mine, [other])
    assert info.value.problems[0].field == "serving.openai.served_model_name"
    # and the other way round: a deployment named as the prefix of another's alias
    with pytest.raises(SpecError, match="has the alias 'other:x', which would take the name of an adapter"):
        check_names(other, [spec(name="mine", serving={"openai": {"served_model_name": ["other:x"]}})])
    check_names(spec(name="mine", serving={"openai": {"served_model_name": ["llama3:8b"]}}), [other])  # ollama-style


def test_cpu_offload_is_per_gpu():
    """vLLM's cpu_offload_gb is per GPU: 2 GPUs each offloading 4 GiB of 20 GiB of weights hold 6
    each, under 7 GiB of room; it was taken once for the whole (8 GiB each, refused)."""
    cluster = ClusterView(total_gpus=2, gpu_memory_bytes=14 * GiB)
    d = spec(device="cuda", gpus=2, runtime_config={"gpu_memory_utilization": 0.5, "cpu_offload_gb": 4})
    verdict = check_budget(d, [], cluster, weights_bytes=20 * GiB, kv_bytes_per_token=0)
    assert verdict.ok and "6.0 of 7.0 GiB per GPU" in str(verdict)


def test_an_auto_deployment_that_ran_on_gpus_keeps_asking_for_them_when_its_gpu_node_is_lost():
    """Its replacement, with the last GPU node gone for a while, was made a CPU replica: on a node
    with vLLM's CUDA build it failed to start three times, and the deployment gave up for good."""
    from atomr_infer.control.placement import GpuChoice

    cluster = [ClusterView(total_gpus=1)]
    choice = GpuChoice(lambda: cluster[0])
    auto, cpu = spec(device="auto"), spec(name="c", device="cpu")
    assert choice(auto) and not choice(cpu)
    cluster[0] = ClusterView(total_gpus=0)  # the GPU node lost
    assert choice(auto)  # a replacement waits for a GPU rather than running on the CPU
    choice.forget("d")  # removed: made again, it decides afresh
    assert not choice(auto)


def test_gemma_3_on_an_l4_fits_as_vllm_allocates_its_kv_cache_and_fp8_kv_halves_it(tmp_path):
    """Every layer counted as full attention, 2 bytes a value: Gemma 3 4B at its default context
    on an L4 was refused at 25 GiB (vLLM takes ~11); kv_cache_dtype fp8 changed nothing."""
    import json
    import struct

    from atomr_infer.control.budget import size_estimates
    from tests.unit.test_estimate import GEMMA3_TEXT

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "torch_dtype": "bfloat16",
                                                      "text_config": GEMMA3_TEXT}))
    header = json.dumps({"w": {"dtype": "BF16", "shape": [4_300_000_000], "data_offsets": [0, 0]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)  # 8.6 GB of weights
    l4 = ClusterView(total_gpus=1, accelerator_type="L4", gpu_memory_bytes=23034 << 20)
    gemma = spec(model=str(tmp_path), device="cuda")
    weights, kv, max_len = size_estimates(gemma, on_cpu=False)
    assert (weights, max_len) == (8_600_000_000, 131072)
    assert check_budget(gemma, [], l4, weights_bytes=weights, kv_bytes_per_token=kv, max_model_len=max_len).ok
    fp8 = spec(model=str(tmp_path), device="cuda", runtime_config={"extra_engine_args": {"kv_cache_dtype": "fp8"}})
    assert size_estimates(fp8, on_cpu=False)[1] * 2 == pytest.approx(kv, abs=2)
