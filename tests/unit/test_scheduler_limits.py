"""Scheduler limits vLLM refuses at engine start, after the model is fetched and loaded, refused
at apply instead, naming the fields (spec/scheduler.py); the replica checks again with its own
device's default before it fetches the model (engine/vllm/engine_args.py). Found by a review."""

from __future__ import annotations

import pytest

from atomr_infer.errors import SpecError
from atomr_infer.spec import parse_deployment


def spec(device="cpu", **runtime_config):
    return parse_deployment({"name": "d", "model": "bundled:smollm2-135m-instruct", "device": device,
                             "runtime_config": runtime_config})


def refusal(device="cpu", **runtime_config) -> str:
    with pytest.raises(SpecError) as info:
        spec(device, **runtime_config)
    [problem] = info.value.problems
    assert "\n" not in str(problem)
    return str(problem)


def test_more_sequences_than_a_step_batches_is_refused():
    text = refusal(max_num_seqs=512, extra_engine_args={"max_num_batched_tokens": "256"})
    assert text.startswith("<dict>: runtime_config.max_num_seqs: 512 is above "
                           "runtime_config.extra_engine_args.max_num_batched_tokens (256)")
    spec(max_num_seqs=256, extra_engine_args={"max_num_batched_tokens": 256})


def test_unchunked_batches_below_the_context_are_refused():
    text = refusal(max_model_len=4096, enable_chunked_prefill=False, extra_engine_args={"max_num_batched_tokens": 2048})
    assert text.startswith("<dict>: runtime_config.extra_engine_args.max_num_batched_tokens: 2048 is below "
                           "runtime_config.max_model_len (4096) with runtime_config.enable_chunked_prefill false")
    spec(max_model_len=4096, extra_engine_args={"max_num_batched_tokens": 2048})  # chunked: fine
    spec(max_model_len=4096, enable_chunked_prefill=False)  # vLLM raises its default to max_model_len


def test_unset_batch_is_vllm_serves_default_on_the_device():
    assert "vLLM's OpenAI server defaults to on CPU (2048)" in refusal(max_num_seqs=4096)
    spec(max_num_seqs=4096, tensor_parallel_size=2)  # 2048 per CPU worker
    spec(max_num_seqs=4096, extra_engine_args={"performance_mode": "throughput"})  # doubled
    spec(max_num_seqs=4096, max_model_len=8192, enable_chunked_prefill=False)  # raised to max_model_len
    spec(device="cuda", max_num_seqs=8192)  # 8192 on an H100: the replica knows its GPU
    assert "on any GPU (16384)" in refusal(device="cuda", max_num_seqs=20000)


def test_the_replica_checks_with_its_devices_default_before_the_model_is_fetched(monkeypatch):
    """max_num_seqs 4096 may run on an H100 (8192 batched tokens by default), not on an A100 (2048)."""
    from vllm import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    from atomr_infer.engine.vllm.engine_args import check_with_vllm

    a100 = ({context: 2048 for context in UsageContext}, {context: 256 for context in UsageContext})
    monkeypatch.setattr(EngineArgs, "get_batch_defaults", classmethod(lambda cls, world: a100))  # the GPU out of reach
    with pytest.raises(SpecError, match=r"max_num_seqs: 4096 is above .* on this device \(2048\)"):
        check_with_vllm(spec("cuda", max_num_seqs=4096), "cuda")
    assert check_with_vllm(spec("cuda", max_num_seqs=2048), "cuda").runtime_config.max_num_seqs == 2048
