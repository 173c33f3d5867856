"""The deployment spec: what a user writes in YAML and passes to ``manager.apply``.

Strict on purpose: unknown keys are rejected, scalars are not coerced across types
(``replicas: "3"`` is an error, not 3), and every number has a sane range. Unset
``VllmConfig`` fields mean "vLLM's default": we never invent defaults for the engine.
Field names follow the original atomr-infer so its users feel at home.
"""

from __future__ import annotations

import re
import warnings
from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator

from atomr_infer.models.registry import BUNDLED_MODELS, HF_REPO_ID_RE, LOCAL_PREFIXES, bundled_name
from atomr_infer.spec.base import FieldValueError, Number, Strict, int_choice
from atomr_infer.spec.lora import Lora
from atomr_infer.spec.multimodal import check_mm_limits
from atomr_infer.spec.scheduler import scheduler_problem
from atomr_infer.spec.serving import Serving

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# EngineArgs keys the spec sets from other fields, and where to set them instead
# (engine/vllm/engine_args.py applies extra_engine_args last: they would win silently).
_ENGINE_ARGS_OWNED = {
    "model": "model",
    "download_dir": "runtime_config.hf_cache_dir",
    "enable_lora": "lora",
    "distributed_executor_backend": "gpus",  # "mp" for a tensor-parallel replica on GPUs
    # The server answers to the deployment's name and its aliases (openai_app.py); vLLM's own
    # would only rename its metrics.
    "served_model_name": "serving.openai.served_model_name",
    **{name: f"lora.{name}" for name in ("max_loras", "max_lora_rank", "max_cpu_loras")},
    **{
        name: f"serving.openai.{name}"
        for name in ("generation_config", "override_generation_config", "reasoning_parser")
    },
}
# EngineArgs keys atomr needs as it sets them: the value, and why.
_ONE_NODE = "a replica is one tensor-parallel group (`gpus`) on one node: run more replicas for more copies"
_ENGINE_ARGS_FIXED = {
    "disable_log_stats": (False, "the replica reports KV-cache use from vLLM's stats"),
    # More than one would take GPUs the replica never reserved (the budget counts `gpus`):
    # vLLM's world size is pipeline x tensor x prefill-context parallel, times data parallel.
    **{name: (1, _ONE_NODE) for name in ("pipeline_parallel_size", "prefill_context_parallel_size",
                                         "data_parallel_size", "data_parallel_size_local", "nnodes")},
    "node_rank": (0, _ONE_NODE),
    # A data-parallel deployment's load balancing, across ranks a replica does not have.
    **{name: (False, _ONE_NODE) for name in ("data_parallel_hybrid_lb", "data_parallel_external_lb",
                                             "data_parallel_multi_port_external_lb")},
}
# EngineArgs keys refused whatever their value, and why.
_ENGINE_ARGS_REFUSED = {
    "device_ids": "the replica runs on the GPUs Ray reserved for it (`gpus`); vLLM would pick others: leave it out",
    # Any value, 0 included, makes vLLM run as one rank of a data-parallel deployment.
    **{name: f"{_ONE_NODE}; leave it out" for name in ("data_parallel_rank", "data_parallel_start_rank")},
}

class VllmConfig(Strict):
    """Engine settings, passed to vLLM's ``EngineArgs``. ``None`` means vLLM's default."""

    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] | None = Field(
        None, description="Weight and activation dtype; 'auto' takes it from the model config."
    )
    tensor_parallel_size: Annotated[StrictInt, Field(ge=1, le=64)] | None = Field(
        None, description="GPUs one replica shards the model over; must equal `gpus` when set."
    )
    gpu_memory_utilization: Annotated[Number, Field(gt=0, le=1)] | None = Field(
        None, description="Fraction of each GPU's memory the engine may use (0 < x <= 1)."
    )
    max_model_len: Annotated[StrictInt, Field(ge=16, le=10_485_760)] | None = Field(
        None, description="Context length (prompt + output tokens); defaults to the model's."
    )
    hf_cache_dir: StrictStr | None = Field(
        None, description="Directory for downloaded weights; defaults to HF_HUB_CACHE / HF_HOME."
    )
    enforce_eager: StrictBool | None = Field(None, description="Disable CUDA graphs (less memory, slower).")
    enable_prefix_caching: StrictBool | None = Field(None, description="Reuse KV cache across shared prefixes.")
    enable_chunked_prefill: StrictBool | None = Field(None, description="Split long prefills across steps.")
    max_num_seqs: Annotated[StrictInt, Field(ge=1, le=65_536)] | None = Field(
        None, description="Most sequences the engine schedules in one step."
    )
    block_size: int_choice(1, 8, 16, 32, 64, 128, 256) | None = Field(  # type: ignore[valid-type]
        None, description="KV-cache block size in tokens."
    )
    quantization: StrictStr | None = Field(None, description="Quantization method, e.g. 'awq', 'gptq', 'fp8'.")
    limit_mm_per_prompt: dict[StrictStr, Any] | None = Field(
        None, description="Most multimodal items per prompt, by modality, e.g. {image: 1}, or as vLLM takes "
        "them with the sizes its memory profiling assumes, e.g. {video: {count: 1, num_frames: 32}}.",
    )
    cpu_offload_gb: Annotated[Number, Field(ge=0, le=4096)] | None = Field(
        None, description="GiB of weights per GPU to keep in CPU memory."
    )
    runner: Literal["auto", "generate", "pooling", "draft"] | None = Field(
        None, description="vLLM's --runner: 'pooling' serves embeddings (/v1/embeddings)."
    )
    convert: Literal["auto", "none", "embed", "classify"] | None = Field(
        None, description="vLLM's --convert: 'embed' runs a decoder model as an embedding model."
    )
    cpu_kvcache_space_gb: Annotated[Number, Field(gt=0, le=4096)] | None = Field(
        None,
        description="KV-cache size in GiB for the CPU backend (device: cpu). Set it: vLLM's CPU "
        "default asks for more memory than a small machine has.",
    )
    cpu_threads: Annotated[StrictInt, Field(ge=1, le=1024)] | None = Field(
        None,
        description="Threads the model computes on for the CPU backend (torch/OpenMP); the "
        "replica reserves as many Ray CPUs. Unset: the node's cores shared among the "
        "deployment's replicas, with 1 Ray CPU reserved so that small machines still place them.",
    )
    engine_metrics: StrictBool = Field(
        True,
        description="Export vLLM's own engine metrics (vllm:*) on Ray's metrics port as ray_vllm_*, as Ray "
        "Serve LLM's log_engine_metrics does; false saves a Ray metrics call per metric and engine step.",
    )
    extra_engine_args: dict[StrictStr, Any] = Field(
        default_factory=dict,
        description="Any other vLLM EngineArgs field, passed through as is. Checked against "
        "EngineArgs (names, and values' types) at apply and before the replica fetches the model.",
    )

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _mm_limits(cls, limits: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_mm_limits(limits)

    @model_validator(mode="after")
    def _no_shadowing(self) -> VllmConfig:
        typed = set(type(self).model_fields) - {"extra_engine_args", "cpu_kvcache_space_gb", "cpu_threads",
                                                "engine_metrics"}
        owned = {name: f"runtime_config.{name}" for name in typed} | _ENGINE_ARGS_OWNED
        clash = sorted(set(owned) & set(self.extra_engine_args))
        if clash:
            raise FieldValueError(
                "extra_engine_args",
                f"sets {', '.join(map(repr, clash))}, which the spec sets from its own field: "
                f"set {', '.join(owned[k] for k in clash)} instead",
            )
        if self.cpu_kvcache_space_gb is not None and "kv_cache_memory_bytes" in self.extra_engine_args:
            raise FieldValueError("extra_engine_args.kv_cache_memory_bytes", "and runtime_config.cpu_kvcache_space_gb "
                                  "both size the KV cache: set one (the memory check read the one, vLLM the other)")
        for key, why in _ENGINE_ARGS_REFUSED.items():
            if key in self.extra_engine_args:
                raise FieldValueError(f"extra_engine_args.{key}", f"is {self.extra_engine_args[key]!r}, but {why}")
        for key, (value, why) in _ENGINE_ARGS_FIXED.items():
            if key in self.extra_engine_args and self.extra_engine_args[key] != value:
                raise FieldValueError(
                    f"extra_engine_args.{key}", f"is {self.extra_engine_args[key]!r}, but atomr sets {value!r}: {why}"
                )
        return self


class Autoscaling(Strict):
    """Replicas from load, within bounds (Ray Serve's names and defaults where they mean the same).

    The manager sums the requests in flight on the ready replicas and those waiting in routers,
    averages that load over ``look_back_period_s``, wants ``ceil(load / target_ongoing_requests)``
    replicas within ``[min_replicas, max_replicas]``, and moves there once that want has held for
    the delay. Scaling stops at the
    deployment's budget (GPUs, memory, spend) and says so in ``atomr status``."""

    min_replicas: Annotated[StrictInt, Field(ge=0, le=1024)] = Field(
        1, description="Fewest replicas; 0 scales to zero when idle (the next request waits for a cold start)."
    )
    max_replicas: Annotated[StrictInt, Field(ge=1, le=1024)] = Field(1, description="Most replicas.")
    target_ongoing_requests: Annotated[Number, Field(gt=0, le=65_536)] = Field(
        2, description="Requests in flight or waiting per replica that the manager aims for."
    )
    upscale_delay_s: Annotated[Number, Field(ge=0, le=86_400)] = Field(
        30, description="How long the load must call for more replicas before they start."
    )
    downscale_delay_s: Annotated[Number, Field(ge=0, le=86_400)] = Field(
        600, description="How long the load must call for fewer replicas before they drain and stop."
    )
    look_back_period_s: Annotated[Number, Field(gt=0, le=3_600)] = Field(
        30,
        description="The load the decisions read is its time-weighted mean over this many seconds (as Ray "
        "Serve's), not one look: a burst or a dip shorter than this moves it only by its share.",
    )
    cold_start_timeout_s: Annotated[Number, Field(gt=0, le=86_400)] = Field(
        300, description="With min_replicas 0: how long a request waits for the first replica to start."
    )

    @model_validator(mode="after")
    def _bounds(self) -> Autoscaling:
        if self.max_replicas < self.min_replicas:
            raise FieldValueError(
                "max_replicas", f"{self.max_replicas} is below min_replicas ({self.min_replicas})"
            )
        return self


class Routing(Strict):
    """How routers pick a replica for a request (changed in place)."""

    policy: Literal["power_of_two", "prefix_affinity", "kv_events"] = Field(
        "power_of_two",
        description="'power_of_two': the less loaded of two random replicas; 'prefix_affinity': the "
        "replica most likely to hold the prompt's prefix in its cache, within load_bound; 'kv_events': the "
        "replica holding the most of the prompt's leading blocks by vLLM's own KV-cache events, within "
        "load_bound (prefix_affinity while no replica's events are fresh).",
    )
    load_bound: Annotated[Number, Field(ge=1, le=10)] = Field(
        1.25,
        description="prefix_affinity: a replica that would hold more than this many times the mean load "
        "(and more than the mean plus 4 requests) overflows to the least loaded.",
    )
    adapter_affinity: StrictBool = Field(
        True,
        description="A LoRA adapter's requests go to its home replicas (fewer adapters per replica, "
        "fewer swaps), within load_bound; false: routed as the base model's are.",
    )


class Budget(Strict):
    """Spend limits, checked against the price of the GPUs the deployment reserves."""

    max_spend_per_hour_usd: Annotated[Number, Field(gt=0, le=1_000_000)] | None = Field(
        None, description="Most US dollars per hour the deployment's GPUs may cost."
    )
    max_spend_per_day_usd: Annotated[Number, Field(gt=0, le=24_000_000)] | None = Field(
        None, description="Most US dollars per day (24 h of the hourly cost)."
    )
    on_exceeded: Literal["reject", "warn"] = Field(
        "reject", description="'reject' refuses the apply; 'warn' logs and proceeds."
    )


class Deployment(Strict):
    """One named model served by ``replicas`` replicas of ``gpus`` GPUs each."""

    name: StrictStr = Field(
        description="DNS-label-like: 1-63 lowercase letters, digits and '-'; the OpenAI `model` field."
    )
    model: StrictStr = Field(
        description="Hugging Face repo id (org/name), a local directory, or bundled:smollm2-135m-instruct."
    )
    runtime: Literal["vllm"] = Field("vllm", description="The inference engine.")
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="'cuda' needs GPUs; 'cpu' runs vLLM's CPU backend; 'auto' picks by the host."
    )
    runtime_config: VllmConfig = Field(default_factory=VllmConfig, description="vLLM engine settings.")
    gpus: Annotated[StrictInt, Field(ge=1, le=64)] = Field(
        1, description="GPUs per replica (= tensor parallel size). On device: cpu, no GPU is used: "
        "the replica shards over CPU workers only as runtime_config.tensor_parallel_size says."
    )
    replicas: Annotated[StrictInt, Field(ge=0, le=1024)] = Field(
        1, description="Number of replicas; 0 keeps the spec but serves nothing."
    )
    autoscaling: Autoscaling | None = Field(
        None, description="Replicas from load within bounds; `replicas`, if set, is then the starting count."
    )
    placement: Literal["spread", "pack"] = Field(
        "spread",
        description="'spread' puts the replicas on as many nodes as it can (a node lost takes fewest); "
        "'pack' on as few (frees whole nodes). A replica's own GPUs are always on one node.",
    )
    serving: Serving = Field(default_factory=Serving, description="Admission limits per replica.")
    routing: Routing = Field(default_factory=Routing, description="How requests pick a replica; changed in place.")
    lora: Lora | None = Field(None, description="LoRA adapters of the model, served by every replica (spec/lora.py).")
    budget: Budget | None = Field(None, description="Spend limits; none means unlimited.")
    restart_on_apply: StrictBool = Field(
        False, description="Roll the replicas on every apply, even of an unchanged spec (default: only on change)."
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_fields(cls, data: Any) -> Any:
        """``idempotent: false`` (before 0.2) is ``restart_on_apply: true``: accepted, with a warning."""
        if not isinstance(data, dict) or "idempotent" not in data:
            return data
        data = dict(data)
        old = data.pop("idempotent")
        if not isinstance(old, bool):
            raise FieldValueError("idempotent", f"input should be a valid boolean, got {old!r}")
        if data.get("restart_on_apply", not old) != (not old):
            raise FieldValueError(
                "idempotent", f"is {old} but restart_on_apply is {data['restart_on_apply']}: keep restart_on_apply only"
            )
        data["restart_on_apply"] = not old
        warnings.warn(
            f"idempotent is deprecated: write restart_on_apply: {str(not old).lower()} instead"
            + (" (or leave it out: false is the default)" if old else ""),
            FutureWarning,
            stacklevel=2,
        )
        return data

    @model_validator(mode="before")
    @classmethod
    def _replicas_from_autoscaling(cls, data: Any) -> Any:
        """With autoscaling and no ``replicas``, start at ``min_replicas`` (Ray Serve's
        ``initial_replicas`` default); written into the spec so that its dump reads back the same."""
        if not isinstance(data, dict) or data.get("autoscaling") is None or "replicas" in data:
            return data
        scaling = data["autoscaling"]
        if isinstance(scaling, Autoscaling):
            low = scaling.min_replicas
        elif isinstance(scaling, dict):
            low = scaling.get("min_replicas", 1)
        else:  # not a mapping: the field's own validation says so
            return data
        return {**data, "replicas": low} if isinstance(low, int) and not isinstance(low, bool) else data

    @property
    def idempotent(self) -> bool:
        """Deprecated: ``not restart_on_apply``."""
        return not self.restart_on_apply

    @field_validator("name")
    @classmethod
    def _check_name(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v):
            raise ValueError(
                f"{v!r} is not a valid name: use 1-63 lowercase letters, digits and '-', "
                "starting and ending with a letter or digit"
            )
        return v

    @field_validator("model")
    @classmethod
    def _check_model(cls, v: str) -> str:
        bundled = bundled_name(v)
        if bundled is not None:
            if bundled not in BUNDLED_MODELS:
                raise ValueError(
                    f"unknown bundled model {v!r}; bundled models: "
                    + ", ".join(f"bundled:{n}" for n in BUNDLED_MODELS)
                )
            return v
        if not v.strip():
            raise ValueError("model is empty: give an HF repo id, a local directory or a bundled: model")
        if v.startswith(LOCAL_PREFIXES) or HF_REPO_ID_RE.fullmatch(v):
            return v
        raise ValueError(
            f"{v!r} is neither an HF repo id (org/name), a local path (/…, ./…, ~/…) "
            "nor a bundled: model"
        )

    @model_validator(mode="after")
    def _check_consistency(self) -> Deployment:
        tp = self.runtime_config.tensor_parallel_size
        if tp is not None and tp != self.gpus and self.device != "cpu":  # (on cpu: CPU workers, no GPU)
            raise FieldValueError(
                "runtime_config.tensor_parallel_size",
                f"is {tp} but gpus is {self.gpus}: one replica shards over its GPUs, "
                "so set them equal (or leave tensor_parallel_size unset)",
            )
        # A CPU replica's settings, read nowhere on a GPU: said, not refused (a restarted manager
        # stops the replicas of a stored spec it refuses, and these ran).
        for name in ("cpu_kvcache_space_gb", "cpu_threads"):
            if self.device == "cuda" and getattr(self.runtime_config, name) is not None:
                warnings.warn(f"runtime_config.{name} is set but device is cuda, where it does nothing (a CPU "
                              "replica's setting): leave it out, or use device: auto", FutureWarning, stacklevel=2)
        policy = self.routing.policy
        if policy != "power_of_two" and self.runtime_config.enable_prefix_caching is False:
            raise FieldValueError(
                "runtime_config.enable_prefix_caching",
                f"is false but routing.policy is {policy}, which routes to the replica whose prefix "
                "cache holds the prompt: leave it unset (vLLM's default: on) or true",
            )
        if policy == "kv_events" and "kv_events_config" in self.runtime_config.extra_engine_args:
            raise FieldValueError(
                "runtime_config.extra_engine_args.kv_events_config",
                "is set but routing.policy is kv_events, for which atomr configures each replica's KV-cache "
                "events itself (ports of its own on its node's address): leave kv_events_config out",
            )
        if (problem := scheduler_problem(self.runtime_config, self.device)) is not None:
            raise FieldValueError(*problem)
        scaling = self.autoscaling
        if scaling is not None and not scaling.min_replicas <= self.replicas <= scaling.max_replicas:
            raise FieldValueError(
                "replicas",
                f"{self.replicas} is outside autoscaling's bounds [{scaling.min_replicas}, {scaling.max_replicas}]: "
                "with autoscaling, replicas is only the starting count (or leave it out: min_replicas)",
            )
        hourly = self.budget.max_spend_per_hour_usd if self.budget else None
        daily = self.budget.max_spend_per_day_usd if self.budget else None
        if hourly and daily and daily < hourly:
            raise FieldValueError(
                "budget.max_spend_per_day_usd", f"{daily:g} is below budget.max_spend_per_hour_usd ({hourly:g})"
            )
        return self

    @property
    def tensor_parallel_size(self) -> int:
        return self.gpus

    @property
    def model_names(self) -> list[tuple[str, str]]:
        """The names the OpenAI ``model`` reaches it by, each after the field that gives it: its
        name, then its aliases. Each answers for one deployment only (loading.py, control/plan.py)."""
        aliases = self.serving.openai.served_model_name
        return [("name", self.name), *(("serving.openai.served_model_name", alias) for alias in aliases)]

