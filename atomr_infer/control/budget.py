"""Budget checks that run before anything is created (docs/architecture.md: the control loop).

Three checks, each with the numbers and a hint when it fails:
- gpus:   GPUs requested by every deployment (gpus x replicas) vs GPUs in the cluster;
- memory: weights + KV cache for one max_model_len sequence vs per-GPU memory x utilization;
          on CPU, the KV cache the replicas will size (``engine/cpu.py``) and their weights vs
          the memory available on the manager's node (the head: where a one-box cluster runs);
- spend:  GPU-hours x price vs ``budget.max_spend_per_hour_usd`` / ``max_spend_per_day_usd``.

Pure functions over a ``ClusterView`` so they are unit-tested without Ray. Prices come from
``DEFAULT_GPU_PRICES_USD`` (on-demand cloud list prices, rounded; the ``ATOMR_GPU_PRICES``
environment variable overrides them: ``cluster_view.prices_from_env``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from atomr_infer.engine.cpu import cpu_reservation, explicit_kv_bytes, size_kv_cache
from atomr_infer.errors import CPU_DEMO_HINT, BudgetExceeded, DeviceUnavailable
from atomr_infer.log import get_logger
from atomr_infer.spec import Deployment

log = get_logger(__name__)

DEFAULT_GPU_PRICES_USD: dict[str, float] = {
    "H200": 5.00,
    "H100": 4.00,
    "A100": 2.50,
    "L40S": 1.50,
    "A10G": 1.20,
    "L4": 0.80,
    "T4": 0.50,
    "default": 2.00,  # any accelerator type not listed
}
GiB = 1 << 30


@dataclass(frozen=True)
class ClusterView:
    """What the checks need to know about the cluster."""

    total_gpus: float
    accelerator_type: str | None = None  # e.g. "H100", from Ray's accelerator_type resources
    gpu_memory_bytes: int | None = None  # per GPU; None = unknown (memory check skipped)
    prices_usd: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_GPU_PRICES_USD))
    cpu_memory_available_bytes: int | None = None  # None = unknown (CPU memory check skipped)
    # The most GPUs and CPUs one alive node has: a replica's are one actor's, on one node (None = unknown).
    largest_node_gpus: float | None = None
    largest_node_cpus: float | None = None

    def price_per_gpu_hour(self) -> float:
        key = self.accelerator_type or "default"
        return self.prices_usd.get(key, self.prices_usd.get("default", DEFAULT_GPU_PRICES_USD["default"]))


@dataclass(frozen=True)
class HeldMemory:
    """A CPU deployment's own replicas that already hold their memory (what the node reports
    available is net of it): ``replicas`` of them, each ``bytes_each`` at least; ``replaced``: a
    roll replaces them, freeing theirs as it goes (else they stay, and only more need memory)."""

    replicas: int = 0
    replaced: bool = False
    bytes_each: int = 0


@dataclass(frozen=True)
class Check:
    name: str  # "gpus" | "memory" | "spend"
    ok: bool
    detail: str


@dataclass(frozen=True)
class BudgetVerdict:
    checks: tuple[Check, ...]
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def __str__(self) -> str:
        parts = [f"{c.name}: {'ok' if c.ok else 'OVER'} ({c.detail})" for c in self.checks]
        return "; ".join(parts + [f"warning: {w}" for w in self.warnings])


def uses_gpus(spec: Deployment, cluster: ClusterView) -> bool:
    """``cuda`` always reserves GPUs; ``auto`` does when the cluster has any."""
    return spec.device == "cuda" or (spec.device == "auto" and cluster.total_gpus > 0)


def gpus_needed(spec: Deployment, cluster: ClusterView, surge: int = 0) -> float:
    return float(spec.gpus * (spec.replicas + surge)) if uses_gpus(spec, cluster) else 0.0


def _one_replica(spec: Deployment, cluster: ClusterView) -> tuple[float, str, float | None, str]:
    """What one replica takes from one node (its GPUs, or on CPU the CPUs it reserves), the unit,
    the most of it one node has, and the field that sets it."""
    if uses_gpus(spec, cluster):
        return float(spec.gpus), "GPUs", cluster.largest_node_gpus, "gpus"
    return float(cpu_reservation(spec)), "CPUs", cluster.largest_node_cpus, "cpu_threads"


def _autoscaled(spec: Deployment) -> str:
    return " (autoscaled)" if spec.autoscaling is not None else ""


def _lower(spec: Deployment) -> str:
    """What to lower for fewer replicas: autoscaled, the bounds move the target."""
    return "replicas" if spec.autoscaling is None else "autoscaling.max_replicas"


def check_budget(spec: Deployment, others: Iterable[Deployment], cluster: ClusterView, raise_on_fail: bool = True,
                 weights_bytes: int | None = None, kv_bytes_per_token: int | None = None,
                 max_model_len: int | None = None, held: HeldMemory | None = None,
                 log_warnings: bool = True, before: Deployment | None = None) -> BudgetVerdict:
    """Run every check for ``spec`` given the other deployments' desired state; ``held``: its
    own replicas already running on CPU (``HeldMemory``; None: none); ``before``: the deployment
    as applied now, at its replica count (None: new). Over the cluster's GPUs, or a replica over
    every node's, a change that asks no more than ``before`` is admitted with a warning: the
    cluster shrank under it (a node lost), and refusing would block an in-place change or a scale down.

    Raises ``DeviceUnavailable`` / ``BudgetExceeded`` on the first failing check unless
    ``raise_on_fail`` is False (``plan`` reports the verdict instead).
    """
    checks: list[Check] = []
    warnings: list[str] = []
    need, had = gpus_needed(spec, cluster), gpus_needed(before, cluster) if before is not None else 0.0
    if spec.device == "cuda" and cluster.total_gpus == 0 and (before is None or need > had):
        if raise_on_fail:
            raise DeviceUnavailable(
                spec.name,
                "device is 'cuda' but the Ray cluster has no GPUs",
                f"{CPU_DEMO_HINT}, or add GPU nodes",
            )
        checks.append(Check("gpus", False, "device is 'cuda' but the cluster has no GPUs"))
        return BudgetVerdict(tuple(checks))

    # GPUs
    others_need = sum(gpus_needed(o, cluster) for o in others if o.name != spec.name)
    ok = others_need + need <= cluster.total_gpus
    checks.append(Check("gpus", ok, f"{others_need + need:g} of {cluster.total_gpus:g} GPUs"))
    if not ok and need <= had:
        warnings.append(f"the cluster has {cluster.total_gpus:g} GPUs, fewer than the {others_need + need:g} the "
                        f"deployments hold (a node lost?): applied, as {spec.name!r} asks for "
                        + (f"no more than it held ({need:g})" if need else "none")
                        + "; replicas that do not fit wait until GPUs are added or replicas lowered")
    elif not ok and raise_on_fail:
        raise BudgetExceeded(
            spec.name, "gpus", others_need + need, cluster.total_gpus, "GPUs",
            f"this deployment needs {need:g} (gpus {spec.gpus} x replicas {spec.replicas}{_autoscaled(spec)}), others "
            f"hold {others_need:g}; lower {_lower(spec)} or gpus, remove a deployment, or add GPU nodes",
        )

    # One replica's GPUs (a CPU replica's reserved CPUs) are one actor's: Ray takes them from one
    # node, so a replica larger than every node is never placed, whatever the cluster's total.
    one, unit, largest, knob = _one_replica(spec, cluster)
    if largest is not None and one > largest:
        check = unit.lower()
        detail = f"a replica's {one:g} {unit} must be on one node; the largest has {largest:g}"
        checks.append(Check(check, False, detail))
        was, was_unit, _, _ = _one_replica(before, cluster) if before is not None else (0.0, "", None, "")
        if was_unit == unit and one <= was:  # a node that held it was lost
            warnings.append(f"{detail} (a node lost?): applied, as a replica asks for no more than before; "
                            f"replicas wait for a node with {one:g} {unit}")
        elif raise_on_fail:
            raise BudgetExceeded(spec.name, check, one, largest, f"{unit} on one node",
                                 f"lower {knob}, or add a node with {one:g} {unit}")

    # Memory fit, per GPU, when both the model size and the GPU memory are known.
    if uses_gpus(spec, cluster) and cluster.gpu_memory_bytes and weights_bytes:
        cfg = spec.runtime_config
        util = cfg.gpu_memory_utilization if cfg.gpu_memory_utilization is not None else 0.92  # vLLM 0.32's
        offload = (cfg.cpu_offload_gb or 0) * GiB
        kv = (kv_bytes_per_token or 0) * (max_model_len or cfg.max_model_len or 0)
        per_gpu_need = max(0.0, weights_bytes / spec.gpus - offload) + kv / spec.gpus  # (offload is per GPU)
        per_gpu_have = cluster.gpu_memory_bytes * util
        ok = per_gpu_need <= per_gpu_have
        detail = f"{per_gpu_need / GiB:.1f} of {per_gpu_have / GiB:.1f} GiB per GPU"
        checks.append(Check("memory", ok, detail))
        if not ok and raise_on_fail:
            raise BudgetExceeded(
                spec.name, "memory", round(per_gpu_need / GiB, 2), round(per_gpu_have / GiB, 2), "GiB per GPU",
                "use a smaller variant, a quantized model (runtime_config.quantization), more gpus per replica, "
                "runtime_config.cpu_offload_gb, or a lower max_model_len",
            )

    if not uses_gpus(spec, cluster) and cluster.cpu_memory_available_bytes:
        check, error = _cpu_memory(
            spec, cluster.cpu_memory_available_bytes, weights_bytes, kv_bytes_per_token, max_model_len, held
        )
        checks.append(check)
        if error is not None and raise_on_fail:
            raise error

    # Spend
    hourly = need * cluster.price_per_gpu_hour()
    budget = spec.budget
    if budget is not None:
        limits = [("max_spend_per_hour_usd", budget.max_spend_per_hour_usd, hourly, "USD/hour"),
                  ("max_spend_per_day_usd", budget.max_spend_per_day_usd, hourly * 24, "USD/day")]
        for field_name, limit, cost, unit in limits:
            if limit is None:
                continue
            ok = cost <= limit
            checks.append(Check("spend", ok, f"{cost:.2f} of {limit:g} {unit} (budget.{field_name})"))
            if ok:
                continue
            priced = cluster.accelerator_type or "default price"
            hint = (f"{need:g} GPUs x ${cluster.price_per_gpu_hour():.2f}/GPU-hour ({priced}); "
                    f"lower {_lower(spec)} or raise budget.{field_name}")
            if budget.on_exceeded == "warn":
                warnings.append(f"spend {cost:.2f} {unit} over budget.{field_name}={limit:g} (on_exceeded: warn)")
                if log_warnings:
                    log.warning("budget_exceeded_warn", deployment=spec.name, cost=round(cost, 2), limit=limit,
                                unit=unit)
            elif raise_on_fail:
                raise BudgetExceeded(spec.name, "spend", round(cost, 2), limit, unit, hint)
    return BudgetVerdict(tuple(checks), tuple(warnings))


def _cpu_memory(spec: Deployment, available: int, weights: int | None, kv_per_token: int | None,
                max_model_len: int | None, held: HeldMemory | None = None) -> tuple[Check, BudgetExceeded | None]:
    """CPU replicas: each new one's KV cache must fit as the replica will size it, and all the new
    ones together. Those ``held`` already running hold theirs in memory ``available`` is net of:
    they are not counted again, nor is a KV cache sized against it; a roll replaces them, and the
    memory of each it stops is the new ones' (stop-first where one would not fit beside them:
    reconcile.py), at least ``held.bytes_each``."""
    held = held or HeldMemory()
    new = spec.replicas if held.replaced else spec.replicas - held.replicas
    if new <= 0:
        return Check("memory", True, f"the {held.replicas} running replicas hold theirs; no new one"), None
    freed = held.replicas * held.bytes_each if held.replaced else 0
    max_len = max_model_len or spec.runtime_config.max_model_len
    try:  # a new replica sizes its KV cache as it starts: mid-roll, beside one stopped old one
        size = size_kv_cache(spec, kv_bytes_per_token=kv_per_token, max_model_len=max_len,
                             available_bytes=available + min(freed, held.bytes_each), weights_bytes=weights)
    except BudgetExceeded as exc:
        return Check("memory", False, str(exc)), exc
    # Sized replicas share the node: each needs its weights and at least what it cannot run without.
    least_kv = size.bytes if size.explicit else (kv_per_token or 0) * (max_len or 0)
    need, room = new * ((weights or 0) + least_kv), available + freed
    beside = (f" (with the {held.replicas} it replaces)" if held.replaced
              else f" (beside the {held.replicas} running)") if held.replicas else ""
    detail = f"{size}; {new} x {((weights or 0) + least_kv) / GiB:.2f} GiB of {room / GiB:.1f} GiB free{beside}"
    if need <= room:
        return Check("memory", True, detail), None
    error = BudgetExceeded(
        spec.name, "memory", round(need / GiB, 2), round(room / GiB, 2), "GiB of CPU memory",
        f"{new} new CPU replicas{_autoscaled(spec)}{beside} each need their weights and KV cache on this node; "
        f"lower {_lower(spec)}, runtime_config.max_model_len or runtime_config.cpu_kvcache_space_gb",
    )
    return Check("memory", False, detail), error


def least_held_bytes(spec: Deployment, weights: int | None, kv_per_token: int | None, max_model_len: int | None) -> int:
    """The least memory one running CPU replica of ``spec`` holds: its weights and its explicit
    KV cache, or one ``max_model_len`` sequence's where it sized its own (against memory then free)."""
    explicit = explicit_kv_bytes(spec)
    max_len = max_model_len or spec.runtime_config.max_model_len
    return (weights or 0) + (explicit if explicit is not None else (kv_per_token or 0) * (max_len or 0))


def size_estimates(spec: Deployment, on_cpu: bool) -> tuple[int | None, int | None, int | None]:
    """(weights bytes, KV-cache bytes per token, context length) when knowable without
    downloading; on CPU the KV cache is counted in the dtype the replica will run."""
    try:
        from atomr_infer.engine.cpu import kv_bytes_per_token, model_max_len
        from atomr_infer.models.estimate import estimate_for_spec, local_model_config
        from atomr_infer.models.resolve import revision_of

        weights, kv = estimate_for_spec(spec.model, spec.runtime_config.hf_cache_dir, revision_of(spec))
        config = local_model_config(spec.model, spec.runtime_config.hf_cache_dir, revision_of(spec))
        max_len = spec.runtime_config.max_model_len or (model_max_len(config) if config else None)
        if on_cpu and config is not None:
            kv = kv_bytes_per_token(spec, config)
        elif config is not None:
            kv = gpu_kv_bytes_per_token(spec, config, max_len)
        if weights is not None and spec.lora is not None and config is not None:
            weights += lora_bytes(spec, config, on_cpu)  # the adapters' slots, beside the weights
        return weights, kv, max_len
    except Exception as exc:  # noqa: BLE001 - unknown size skips the memory check
        log.warning("size_estimate_failed", model=spec.model, error=repr(exc))
        return None, None, None


def gpu_kv_bytes_per_token(spec: Deployment, config: dict[str, Any], max_len: int | None) -> int | None:
    """KV-cache bytes a token of one ``max_len`` sequence takes on GPUs, as vLLM 0.32 allocates
    them (models/estimate.py): in the KV dtype, 1 byte for ``kv_cache_dtype: fp8*``, else the
    run dtype (a float32 checkpoint runs in 16 bits on a GPU); a sliding-window layer holds its
    window and a step's batch (``max_num_batched_tokens``). None where the config lacks the shapes."""
    from atomr_infer.engine.cpu import DTYPE_BYTES
    from atomr_infer.models.estimate import BATCHED_TOKENS, config_dtype_bytes, kv_cache_bytes_per_token
    from atomr_infer.spec.scheduler import engine_arg_int

    extra, dtype = spec.runtime_config.extra_engine_args, spec.runtime_config.dtype
    if str(extra.get("kv_cache_dtype", "auto")).startswith("fp8"):
        dtype_bytes = 1
    else:
        dtype_bytes = DTYPE_BYTES[dtype] if dtype in DTYPE_BYTES else min(config_dtype_bytes(config), 2)
    batched = engine_arg_int(extra, "max_num_batched_tokens") or BATCHED_TOKENS  # "2048" as vLLM gets it
    try:
        return kv_cache_bytes_per_token(config, dtype_bytes, max_len, batched)
    except ValueError:
        return None


def lora_bytes(spec: Deployment, config: dict[str, Any], on_cpu: bool) -> int:
    """What LoRA takes beside the weights, per replica: ``max_loras`` slots of ``max_lora_rank``
    on the device (vLLM's defaults 1 and 16); on CPU also the ``max_cpu_loras`` adapters it caches
    in host memory."""
    from atomr_infer.models.adapters import VLLM_MAX_LORA_RANK
    from atomr_infer.models.estimate import lora_slot_bytes

    lora = spec.lora
    if lora is None:
        return 0
    slots = lora.max_loras or 1
    if on_cpu:
        slots += lora.max_cpu_loras or slots
    return slots * lora_slot_bytes(config, lora.max_lora_rank or VLLM_MAX_LORA_RANK)


def lora_summary(spec: Deployment) -> str | None:
    """For ``--dry-run``: the adapters and the memory their slots take, counted in the memory check."""
    lora = spec.lora
    if lora is None:
        return None
    try:
        from atomr_infer.models.estimate import local_model_config
        from atomr_infer.models.resolve import revision_of

        config = local_model_config(spec.model, spec.runtime_config.hf_cache_dir, revision_of(spec))
        on_cpu = spec.device != "cuda"
        size = f"{lora_bytes(spec, config, on_cpu) / 2**20:.0f} MiB per replica" if config else "size unknown"
    except Exception as exc:  # noqa: BLE001 - a summary only
        size = f"size unknown ({type(exc).__name__})"
    return (f"{len(lora.adapters)} LoRA adapters, {lora.max_loras or 1} slots of rank {lora.max_lora_rank or 16}: "
            f"{size} (in the memory check)")


def scaling_summary(spec: Deployment, cluster: ClusterView | None, cap: tuple[int, str | None] | None = None) -> str:
    """The autoscaling bounds and the worst-case cost (max_replicas at the cluster's GPU price),
    for ``atomr deploy --dry-run``; ``cap``: where the budget stops scaling (``scale_cap``)."""
    cfg = spec.autoscaling
    if cfg is None:
        return ""
    text = (f"autoscaling {cfg.min_replicas}-{cfg.max_replicas} replicas, target {cfg.target_ongoing_requests:g} "
            f"ongoing requests each (up after {cfg.upscale_delay_s:g}s, down after {cfg.downscale_delay_s:g}s)")
    if cluster is None:
        return text
    if uses_gpus(spec, cluster):
        price = cluster.price_per_gpu_hour()
        worst = cfg.max_replicas * spec.gpus * price
        text += (f"; worst case {cfg.max_replicas} x {spec.gpus} GPU x ${price:.2f}/GPU-hour "
                 f"({cluster.accelerator_type or 'default price'}) = ${worst:.2f}/hour")
    else:
        text += f"; worst case {cfg.max_replicas} CPU replicas, no GPU cost"
    if cap is not None and cap[0] < cfg.max_replicas:
        text += f"; the budget stops it at {cap[0]}: {cap[1]}"
    elif cap is not None and cap[1]:  # over a spend limit with on_exceeded: warn
        text += f"; {cap[1]}"
    return text


def scale_cap(spec: Deployment, others: Iterable[Deployment], cluster: ClusterView, current: int, wanted: int,
              sizes: tuple[int | None, int | None, int | None] = (None, None, None),
              held: HeldMemory | None = None) -> tuple[int, str | None]:
    """How many replicas (``current`` < n <= ``wanted``) the budget lets ``spec`` scale to, and why
    not more (or, where it lets all go over a spend limit with ``on_exceeded: warn``, that warning).
    GPUs and spend count every replica; CPU memory only the new ones: ``held`` (default: the
    ``current`` ones) already hold theirs in the memory the cluster reports free."""
    weights, kv, max_len = sizes
    held = HeldMemory(current) if held is None else held
    warn = spec.budget is not None and spec.budget.on_exceeded == "warn"  # proceeds over spend, as apply does
    others = list(others)
    failed: list[str] = []  # why the smallest count that failed so far failed
    for n in range(wanted, current, -1):
        verdict = check_budget(spec.model_copy(update={"replicas": n}), others,
                               replace(cluster, cpu_memory_available_bytes=None), False, weights, kv, max_len,
                               log_warnings=False)  # asked each pass: the decision's reason carries it
        over = [f"{c.name} {c.detail}" for c in verdict.checks if not c.ok and not (warn and c.name == "spend")]
        if not over and not uses_gpus(spec, cluster) and cluster.cpu_memory_available_bytes:
            check, _ = _cpu_memory(spec.model_copy(update={"replicas": n}), cluster.cpu_memory_available_bytes,
                                   weights, kv, max_len, held)
            over = [] if check.ok else [f"memory {check.detail}"]
        if not over and failed:
            return n, f"{n + 1} replicas would exceed the budget: " + "; ".join(failed)
        if not over:
            return n, (f"{n} replicas go over the budget: " + "; ".join(verdict.warnings)) if verdict.warnings else None
        failed = over
    return current, (f"{current + 1} replicas would exceed the budget: " + "; ".join(failed)) if failed else None
