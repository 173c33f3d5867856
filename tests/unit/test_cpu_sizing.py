"""A CPU replica sizes itself: its dtype from the CPU, its KV cache from its limits and the
node's free memory; what cannot fit is refused with the numbers (engine/cpu.py, budget.py)."""

from __future__ import annotations

import pytest

from atomr_infer.control.budget import ClusterView, check_budget
from atomr_infer.engine.cpu import KV_SHARE, GiB, cpu_dtype, has_native_bf16, model_max_len, size_kv_cache
from atomr_infer.engine.vllm.engine_args import engine_args
from atomr_infer.errors import BudgetExceeded
from atomr_infer.spec import parse_deployment

KV_PER_TOKEN = 23_040  # SmolLM2-135M in bf16: 2 x 30 layers x 3 KV heads x 64 x 2 bytes
WEIGHTS = 270 * 1024 * 1024


def bare(**rc):
    """The bare spec of issue 12: no memory setting at all."""
    return parse_deployment(
        {"name": "bare", "model": "bundled:smollm2-135m-instruct", "device": "cpu",
         "runtime_config": {"max_model_len": 1024, **rc}}
    )


def size(dep, available=12 * GiB, max_len=1024):
    return size_kv_cache(dep, kv_bytes_per_token=KV_PER_TOKEN, max_model_len=max_len,
                         available_bytes=available, weights_bytes=WEIGHTS)


@pytest.mark.parametrize(
    ("flags", "machine", "native"),
    [({"avx2", "avx512_bf16"}, "x86_64", True), ({"avx2", "amx_bf16"}, "x86_64", True),
     ({"avx2", "avx512f"}, "x86_64", False), ({"asimd", "bf16"}, "aarch64", True), ({"asimd"}, "aarch64", False)],
)
def test_native_bf16_is_read_from_the_cpu_flags(flags, machine, native):
    assert has_native_bf16(flags, machine) is native


def test_auto_dtype_is_what_the_cpu_computes_natively():
    assert cpu_dtype(None, True) == cpu_dtype("auto", True) == "bfloat16"
    assert cpu_dtype(None, False) == cpu_dtype("auto", False) == "float32"
    assert cpu_dtype("bfloat16", False) == "bfloat16"  # an explicit dtype is kept
    assert engine_args(bare(), "/m", "cpu", native_bf16=False)["dtype"] == "float32"
    assert engine_args(bare(), "/m", "cpu", native_bf16=True)["dtype"] == "bfloat16"
    assert "dtype" not in engine_args(bare(), "/m", "cuda")  # on GPUs vLLM's auto stays


def test_cpu_runs_eager_unless_the_spec_asks_for_compilation():
    assert engine_args(bare(), "/m", "cpu", native_bf16=True)["enforce_eager"] is True
    assert engine_args(bare(enforce_eager=False), "/m", "cpu", native_bf16=True)["enforce_eager"] is False
    assert "enforce_eager" not in engine_args(bare(), "/m", "cuda")


def test_bare_spec_asks_for_its_limits_when_they_fit():
    kv = size(bare(max_num_seqs=8))
    assert kv.bytes == 8 * 1024 * KV_PER_TOKEN and not kv.explicit
    assert "max_num_seqs 8" in str(kv) and "max_model_len 1024" in str(kv)
    args = engine_args(bare(max_num_seqs=8), "/m", "cpu", kv_cache_bytes=kv.bytes, native_bf16=True)
    assert args["kv_cache_memory_bytes"] == kv.bytes


def test_bare_spec_is_capped_at_a_share_of_free_memory():
    kv = size(bare(max_model_len=8192), available=4 * GiB, max_len=8192)  # vLLM serve's 128 seqs want 22.5 GiB
    assert kv.bytes == int((4 * GiB - WEIGHTS) * KV_SHARE)
    assert "capped" in str(kv)


def test_not_even_one_sequence_fits_is_refused_with_numbers_and_a_hint():
    with pytest.raises(BudgetExceeded) as info:
        size(bare(max_model_len=131072), available=2 * GiB, max_len=131072)
    err = info.value
    assert err.check == "memory" and err.requested == round(131072 * KV_PER_TOKEN / GiB, 2)
    assert "max_model_len" in err.hint


def test_explicit_size_is_kept_or_refused():
    assert size(bare(cpu_kvcache_space_gb=1)).bytes == GiB
    with pytest.raises(BudgetExceeded, match="cpu_kvcache_space_gb"):
        size(bare(cpu_kvcache_space_gb=64))  # more than the node has
    with pytest.raises(BudgetExceeded, match="fewer tokens than one sequence"):
        size(bare(cpu_kvcache_space_gb=0.01, max_model_len=8192), max_len=8192)


def test_admission_counts_every_replica_on_the_node():
    cluster = ClusterView(total_gpus=0, cpu_memory_available_bytes=3 * GiB)
    verdict = check_budget(bare(cpu_kvcache_space_gb=1), [], cluster, True, WEIGHTS, KV_PER_TOKEN, 1024)
    assert verdict.ok and "memory: ok" in str(verdict)
    with pytest.raises(BudgetExceeded) as info:
        spec = bare(cpu_kvcache_space_gb=1).model_copy(update={"replicas": 3})
        check_budget(spec, [], cluster, True, WEIGHTS, KV_PER_TOKEN, 1024)
    assert info.value.requested > 3 and "replicas" in info.value.hint
    report = check_budget(bare(max_model_len=131072), [], cluster, False, WEIGHTS, KV_PER_TOKEN, 131072)
    assert not report.ok and "memory: OVER" in str(report)  # plan reports instead of raising
    unknown = ClusterView(total_gpus=0)
    assert check_budget(bare(max_model_len=131072), [], unknown, True, WEIGHTS, KV_PER_TOKEN, 131072).ok


def test_context_length_comes_from_the_model_config_when_unset():
    assert model_max_len({"max_position_embeddings": 8192}) == 8192
    assert model_max_len({"text_config": {"max_position_embeddings": 32768}}) == 32768
    assert model_max_len({}) is None


def test_cpu_threads_share_the_node_among_replicas_unless_the_spec_sets_them():
    from atomr_infer.engine.cpu import cpu_reservation, cpu_threads

    lone = parse_deployment({"name": "a", "model": "m", "device": "cpu"})
    pair = parse_deployment({"name": "a", "model": "m", "device": "cpu", "replicas": 2})
    three = parse_deployment({"name": "a", "model": "m", "device": "cpu", "replicas": 3})
    assert (cpu_threads(lone, cores=8), cpu_threads(pair, cores=8), cpu_threads(three, cores=2)) == (8, 4, 1)
    assert cpu_reservation(lone) == 1  # auto: placement as before, threads from the node
    pinned = parse_deployment({"name": "a", "model": "m", "device": "cpu", "runtime_config": {"cpu_threads": 3}})
    assert (cpu_threads(pinned, cores=16), cpu_reservation(pinned)) == (3, 3)
    assert "cpu_threads" not in engine_args(pinned, "/m", "cpu", native_bf16=True)  # not a vLLM EngineArgs field


def test_auto_runs_float32_where_vllms_amx_bfloat16_path_answered_wrongly():
    """An Intel Xeon with AMX: vLLM 0.32's bf16 attention takes its AMX kernel there and answered
    the bundled model wrongly ("L'Étoile, la Marseillaise, ..." for the capital of France)."""
    from atomr_infer.engine.cpu import auto_bf16

    sapphire = {"avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_int8"}
    assert has_native_bf16(sapphire, "x86_64") and not auto_bf16(sapphire, "x86_64")
    assert auto_bf16({"avx512f", "avx512_bf16"}, "x86_64")  # AMD EPYC: bf16, answered rightly
    assert not auto_bf16({"avx2"}, "x86_64") and auto_bf16({"bf16"}, "aarch64")


def test_machine_line_names_the_cpu_and_whether_it_has_native_bf16(monkeypatch):
    import atomr_infer.engine.cpu as cpu

    monkeypatch.setattr(cpu, "cpu_model", lambda: "Some CPU 9000")
    monkeypatch.setattr(cpu, "node_cores", lambda: 2)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    assert cpu.machine_line() == "Some CPU 9000, 2 cores, native bf16 (avx512_bf16)"
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx2"})
    assert cpu.machine_line() == "Some CPU 9000, 2 cores, no native bf16"


def test_cpu_model_is_this_machines():
    import platform

    from atomr_infer.engine.cpu import cpu_model

    with open("/proc/cpuinfo", encoding="utf-8") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    assert cpu_model() == (names[0] if names else platform.machine())  # Arm has no "model name"


def test_unset_max_num_seqs_is_the_one_vllm_serve_runs_and_a_quoted_size_is_the_one_vllm_gets():
    """The KV cache was sized for 256 sequences where vLLM's OpenAI server runs 128 per CPU worker
    (no more than max_num_batched_tokens), and a quoted kv_cache_memory_bytes ("1073741824"), which
    vLLM gets as that number, was skipped: the memory check sized another cache. Found by a review."""
    assert size(bare()).bytes == 128 * 1024 * KV_PER_TOKEN
    assert size(bare(extra_engine_args={"max_num_batched_tokens": "64"})).bytes == 64 * 1024 * KV_PER_TOKEN
    # performance_mode throughput: vLLM doubles an unset max_num_seqs (the cache was sized for half)
    assert "max_num_seqs 256" in str(size(bare(extra_engine_args={"performance_mode": "throughput"})))
    quoted = size(bare(extra_engine_args={"kv_cache_memory_bytes": str(GiB)}))
    assert quoted.explicit and quoted.bytes == GiB
