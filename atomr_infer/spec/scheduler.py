"""vLLM's scheduler limits, checked from the spec before anything runs.

vLLM's ``SchedulerConfig`` refuses ``max_num_seqs`` above ``max_num_batched_tokens`` and, with
chunked prefill off, ``max_num_batched_tokens`` below ``max_model_len`` (vllm/config/scheduler.py),
but only at engine start, after the replica has fetched the model. Where ``max_num_batched_tokens``
is unset, vLLM picks it by usage context and device (``EngineArgs.get_batch_defaults``); a replica
runs vLLM's OpenAI server and gets that server's defaults, as ``vllm serve`` does: 2048 per
worker on CPU; on a GPU 2048, 8192 (70 GiB or more, not an A100: H100, H200) or 16384 (160 GiB or
more: B200); each doubled by ``performance_mode: throughput``. The spec knows the device's kind
but not the GPU, so there the check takes the largest and refuses only what fails on every GPU;
the replica checks again with its own GPU's default before it fetches the model
(engine/vllm/engine_args.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from pydantic import TypeAdapter, ValidationError

from atomr_infer.models.estimate import BATCHED_TOKENS  # the largest: the KV estimate's too


class EngineLimits(Protocol):
    """What these checks read of ``spec.deployment.VllmConfig`` (which imports this module)."""

    @property
    def max_num_seqs(self) -> int | None: ...
    @property
    def max_model_len(self) -> int | None: ...
    @property
    def enable_chunked_prefill(self) -> bool | None: ...
    @property
    def tensor_parallel_size(self) -> int | None: ...
    @property
    def runner(self) -> str | None: ...
    @property
    def convert(self) -> str | None: ...
    @property
    def extra_engine_args(self) -> dict[str, Any]: ...


_INT: TypeAdapter[int] = TypeAdapter(int)
# vLLM 0.32's OpenAI-server defaults (EngineArgs.get_batch_defaults, UsageContext.OPENAI_API_SERVER).
CPU_MAX_NUM_BATCHED_TOKENS = 2048  # per CPU worker
CPU_MAX_NUM_SEQS = 128  # per CPU worker
GPU_MAX_NUM_BATCHED_TOKENS = (2048, 8192, BATCHED_TOKENS)  # by the GPU's memory (see above)


def engine_arg_int(extra: Mapping[str, Any], key: str) -> int | None:
    """An ``extra_engine_args`` value of one of vLLM's ``int`` fields as vLLM's types read it
    (``"2048"`` is 2048, as the replica passes it); None if unset or not a whole number."""
    value = extra.get(key)
    if value is None or isinstance(value, bool):
        return None
    try:
        return _INT.validate_python(value, strict=False)
    except ValidationError:  # refused by the type check (engine/vllm/arg_checks.py)
        return None


def cpu_workers(cfg: EngineLimits) -> int:
    """The CPU workers a CPU replica shards over (vLLM's world size there)."""
    return cfg.tensor_parallel_size or 1


def default_batched_tokens(cfg: EngineLimits, device: str) -> int:
    """The largest ``max_num_batched_tokens`` vLLM's OpenAI server may default to on ``device``
    (``cpu``, ``cuda``, or ``auto``: either), before ``performance_mode``."""
    cpu = CPU_MAX_NUM_BATCHED_TOKENS * cpu_workers(cfg)
    return {"cpu": cpu, "cuda": max(GPU_MAX_NUM_BATCHED_TOKENS)}.get(device, max(cpu, *GPU_MAX_NUM_BATCHED_TOKENS))


def scheduler_problem(cfg: EngineLimits, device: str, default_batched: int | None = None) -> tuple[str, str] | None:
    """The field and the reason vLLM's scheduler would refuse ``cfg`` at engine start, or None.
    ``default_batched``: vLLM's default ``max_num_batched_tokens`` where the device is known
    (the replica's), else the largest it may be on ``device``."""
    batched = engine_arg_int(cfg.extra_engine_args, "max_num_batched_tokens")
    seqs, max_len, chunked = cfg.max_num_seqs, cfg.max_model_len, cfg.enable_chunked_prefill
    if batched is not None:
        if seqs is not None and seqs > batched:
            return "runtime_config.max_num_seqs", (
                f"{seqs} is above runtime_config.extra_engine_args.max_num_batched_tokens ({batched}), which vLLM "
                "refuses (a step schedules a token of each sequence): lower max_num_seqs or raise "
                "max_num_batched_tokens"
            )
        if chunked is False and max_len is not None and batched < max_len:
            return "runtime_config.extra_engine_args.max_num_batched_tokens", (
                f"{batched} is below runtime_config.max_model_len ({max_len}) with "
                "runtime_config.enable_chunked_prefill false, which vLLM refuses (a whole prompt is one step): raise "
                "it, lower max_model_len, or leave chunked prefill on"
            )
        return None
    if seqs is None:
        return None  # vLLM lowers its default max_num_seqs to the batch
    where = "on this device" if default_batched is not None else {"cpu": "on CPU", "cuda": "on any GPU"}.get(
        device, "on any device")
    default = default_batched if default_batched is not None else default_batched_tokens(cfg, device)
    if cfg.extra_engine_args.get("performance_mode") == "throughput":
        default *= 2
    # Unchunked (chunked prefill off, or a pooling model's default), vLLM raises its default to
    # max_model_len: unknown here when the model's.
    if chunked is False or (chunked is None and (cfg.runner == "pooling" or cfg.convert in ("embed", "classify"))):
        if max_len is None:
            return None
        default = max(default, max_len)
    if seqs > default:
        return "runtime_config.max_num_seqs", (
            f"{seqs} is above the max_num_batched_tokens vLLM's OpenAI server defaults to {where} ({default}), which "
            f"vLLM refuses: set runtime_config.extra_engine_args.max_num_batched_tokens to {seqs} or more, or lower "
            "max_num_seqs"
        )
    return None
