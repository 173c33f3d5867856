"""vLLM's CPU backend sized for the machine it runs on: the threads, the dtype and the KV cache.

Threads: Ray sets ``OMP_NUM_THREADS`` to an actor's ``num_cpus`` (1 for a CPU replica), so
torch computed on one core however many the node had: 0.84x ``vllm serve``'s output tok/s at
16 concurrent requests on a 2-core EPYC, 1.02x with 2 threads (issue 14). A replica now
computes on ``runtime_config.cpu_threads`` threads and reserves as many Ray CPUs; unset, on
the node's cores divided among the deployment's replicas (``cpu_threads``), reserving 1 CPU
so that several replicas still place on a small machine.

dtype: ``auto`` (or unset) picks what the CPU computes natively: bfloat16 where it has bf16
instructions (``avx512_bf16`` on x86, ``bf16`` on Arm), float32 elsewhere, where vLLM would
otherwise run the model's bf16 weights through emulated kernels; and float32 where the CPU has
AMX: vLLM 0.32's CPU attention takes its AMX kernel for bfloat16 there (``cpu_attn.py``), which
answered the bundled model wrongly on an Intel Xeon with AMX ("What is the capital of France?" ->
"L'Étoile, la Marseillaise, …"; float32 and float16: "… is Paris."), at 348 against 139.5 tok/s.
A spec's ``dtype: bfloat16`` still runs it.

Eager: unless the spec sets ``enforce_eager``, a CPU replica runs eager (see ``engine_args``).

KV cache: vLLM's CPU backend by default reserves ``gpu_memory_utilization`` (0.92) of the
node's memory and refuses to start when that much is not free, so a bare spec never starts on
a machine that runs anything else. With no explicit size (``runtime_config.cpu_kvcache_space_gb``
or ``extra_engine_args.kv_cache_memory_bytes``) a replica asks for what its limits can use,
``max_model_len x max_num_seqs`` tokens, capped at ``KV_SHARE`` of the memory available after
its weights. If not even one ``max_model_len`` sequence fits, or an explicit size cannot fit,
the deployment is refused with the numbers (``BudgetExceeded``, check ``memory``), at admission
by the manager and again by the replica on the node it landed on.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import Any

from atomr_infer.errors import BudgetExceeded
from atomr_infer.spec import Deployment
from atomr_infer.spec.scheduler import CPU_MAX_NUM_SEQS, cpu_workers, engine_arg_int

GiB = 1 << 30
# Share of a node's available memory (after the weights) one replica's KV cache may take when
# no size is given; a few replicas fit on one node.
KV_SHARE = 0.25
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
_X86_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}
_AMX_FLAGS = {"amx_bf16", "amx_tile"}


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (``flags`` on x86, ``Features`` on Arm)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    """The CPU's model name (``lscpu``'s "Model name"), or the machine's architecture."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.machine() or "?"


def machine_line() -> str:
    """What to quote with any figure measured here: the engine on a CPU with native bf16 runs
    10-25x faster than on one without (``avx512_bf16``)."""
    bf16 = "native bf16" if has_native_bf16() else "no native bf16"
    flag = " (avx512_bf16)" if "avx512_bf16" in cpu_flags() else ""
    amx = ", AMX (dtype auto: float32)" if has_amx() else ""
    return f"{cpu_model()}, {node_cores()} cores, {bf16}{flag}{amx}"


def has_native_bf16(flags: set[str] | None = None, machine: str | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    arch = machine or platform.machine()
    if arch in ("aarch64", "arm64"):
        return "bf16" in flags
    return bool(flags & _X86_BF16_FLAGS)


def has_amx(flags: set[str] | None = None) -> bool:
    return bool((cpu_flags() if flags is None else flags) & _AMX_FLAGS)


def auto_bf16(flags: set[str] | None = None, machine: str | None = None) -> bool:
    """Whether ``dtype: auto`` runs bfloat16 here: native bf16, and no AMX (see the module's doc)."""
    flags = cpu_flags() if flags is None else flags
    return has_native_bf16(flags, machine) and not has_amx(flags)


def node_cores() -> int:
    """Cores this process may run on (its affinity; Ray does not narrow it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_threads(deployment: Deployment, cores: int | None = None) -> int:
    """Threads a CPU replica computes on: the spec's, or the node's cores shared by its replicas."""
    explicit = deployment.runtime_config.cpu_threads
    if explicit is not None:
        return explicit
    return max(1, (node_cores() if cores is None else cores) // max(1, deployment.replicas))


def cpu_reservation(deployment: Deployment) -> int:
    """Ray CPUs a CPU replica reserves: its threads when the spec sets them, else 1."""
    return deployment.runtime_config.cpu_threads or 1


def cpu_dtype(requested: str | None, native_bf16: bool) -> str:
    """The dtype a CPU replica runs: the spec's, or for ``auto``/unset the CPU's native one."""
    if requested in (None, "auto"):
        return "bfloat16" if native_bf16 else "float32"
    return requested


@dataclass(frozen=True)
class KvCacheSize:
    bytes: int
    explicit: bool
    detail: str  # how it was chosen, for progress lines, logs and status

    def __str__(self) -> str:
        return f"KV cache {self.bytes / GiB:.2f} GiB ({self.detail})"


def explicit_kv_bytes(deployment: Deployment) -> int | None:
    cfg = deployment.runtime_config
    if cfg.cpu_kvcache_space_gb is not None:
        return int(cfg.cpu_kvcache_space_gb * GiB)
    return engine_arg_int(cfg.extra_engine_args, "kv_cache_memory_bytes")  # "2147483648" as vLLM gets it


def size_kv_cache(
    deployment: Deployment,
    *,
    kv_bytes_per_token: int | None,
    max_model_len: int | None,
    available_bytes: int,
    weights_bytes: int | None,
) -> KvCacheSize:
    """The KV-cache size for one CPU replica, or ``BudgetExceeded`` when it cannot fit."""
    free = max(0, available_bytes - (weights_bytes or 0))
    explicit = explicit_kv_bytes(deployment)
    one_seq = kv_bytes_per_token * max_model_len if kv_bytes_per_token and max_model_len else None
    where = f"{available_bytes / GiB:.1f} GiB available" + (
        f", {weights_bytes / GiB:.2f} GiB of it for weights" if weights_bytes else ""
    )
    if explicit is not None:
        if explicit > free:
            _refuse(deployment, explicit, free, f"the explicit KV cache does not fit in this node's memory ({where}); "
                    "lower runtime_config.cpu_kvcache_space_gb or free memory")
        if one_seq is not None and explicit < one_seq:
            _refuse(deployment, one_seq, explicit, f"runtime_config.cpu_kvcache_space_gb holds fewer tokens than one "
                    f"sequence of max_model_len {max_model_len}; raise it or lower runtime_config.max_model_len")
        return KvCacheSize(explicit, True, "runtime_config.cpu_kvcache_space_gb")
    cap = int(free * KV_SHARE)
    if one_seq is None:  # the model's shape is unknown: take the share
        return KvCacheSize(cap, False, f"{KV_SHARE:.0%} of {free / GiB:.1f} GiB free; model size unknown")
    if one_seq > cap:
        _refuse(deployment, one_seq, cap, f"one sequence of max_model_len {max_model_len} needs more than "
                f"{KV_SHARE:.0%} of this node's free memory ({where}); lower runtime_config.max_model_len, "
                "set runtime_config.cpu_kvcache_space_gb, or free memory")
    seqs = deployment.runtime_config.max_num_seqs or default_max_num_seqs(deployment)
    want = one_seq * seqs
    per_token = f"{kv_bytes_per_token / 1024:.1f} KiB/token"
    if want <= cap:
        return KvCacheSize(want, False, f"max_num_seqs {seqs} x max_model_len {max_model_len} x {per_token}")
    return KvCacheSize(
        cap, False, f"{cap // one_seq} of max_num_seqs {seqs} full sequences: capped at {KV_SHARE:.0%} of "
        f"{free / GiB:.1f} GiB free"
    )


def default_max_num_seqs(deployment: Deployment) -> int:
    """The ``max_num_seqs`` vLLM's OpenAI server runs a CPU replica with when the spec leaves it
    unset: 128 per CPU worker (twice that under ``performance_mode: throughput``), no more than
    ``max_num_batched_tokens`` where that is set."""
    cfg = deployment.runtime_config
    throughput = cfg.extra_engine_args.get("performance_mode") == "throughput"
    seqs = CPU_MAX_NUM_SEQS * cpu_workers(cfg) * (2 if throughput else 1)
    batched = engine_arg_int(cfg.extra_engine_args, "max_num_batched_tokens")
    return min(seqs, batched) if batched is not None else seqs


def _refuse(deployment: Deployment, need: int, have: int, hint: str) -> None:
    need_gib, have_gib = round(need / GiB, 2), round(have / GiB, 2)
    raise BudgetExceeded(deployment.name, "memory", need_gib, have_gib, "GiB of CPU memory for the KV cache", hint)


def kv_bytes_per_token(deployment: Deployment, config: dict[str, Any]) -> int | None:
    """KV-cache bytes per token in the dtype a CPU replica of ``deployment`` runs on this CPU."""
    from atomr_infer.models.estimate import config_dtype_bytes, kv_cache_bytes_per_token

    dtype = cpu_dtype(deployment.runtime_config.dtype, auto_bf16())
    try:
        return kv_cache_bytes_per_token(config, DTYPE_BYTES.get(dtype, config_dtype_bytes(config)))
    except ValueError:  # the config lacks the shapes
        return None


def model_max_len(config: dict[str, Any]) -> int | None:
    """The context length a model config declares (what vLLM uses when max_model_len is unset)."""
    text = config.get("text_config")
    for cfg in (config, text if isinstance(text, dict) else {}):
        for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
            value = cfg.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None
