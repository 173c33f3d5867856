"""Zero-config Gemma: provision a Gemma 4 deployment when this host can run one, else say why not.

``GemmaDefaults.from_env()`` reads the settings (all optional)::

    ATOMR_INFER_GEMMA_AUTO        0/false/no/off/skip disable; skip-quietly disables and says nothing
    ATOMR_INFER_GEMMA_MODEL       google/gemma-4-E2B, -E2B-it, -E4B, -E4B-it (default google/gemma-4-E4B-it)
    ATOMR_INFER_GEMMA_DEPLOYMENT  deployment name (default gemma-local)
    ATOMR_INFER_GEMMA_GPU_UTIL    vLLM gpu_memory_utilization, 0 < x <= 1 (default 0.5)
    ATOMR_INFER_GEMMA_MAX_LEN     max_model_len, a whole number >= 16 (default: the model's)

A bad value is a ``SpecError`` naming the variable; nothing is ignored silently. An empty
value counts as unset.

``provision_if_ready(manager, defaults)`` probes, then either applies the deployment (``Ready``;
applying an unchanged spec is a no-op for the manager) or returns ``Skipped(reason, hint)``.
Checks, in order: a GPU (here, or in a reachable Ray cluster); vLLM importable, and not the CPU
build on a GPU host; VRAM; disk at the HF cache unless the weights are cached; an HF token
unless the weights are cached.

VRAM, as vLLM sees it: the engine reserves ``gpu_util x total`` memory and refuses to start
when less than that is free. So a GPU fits a variant when ``gpu_util x total`` is at least the
variant's floor (E2B 2.5 GB, E4B 4.5 GB) *and* at most the GPU's free memory. The best GPU of
this host counts: the deployment takes one.

Fallback: when ``ATOMR_INFER_GEMMA_MODEL`` is unset and E4B does not fit (VRAM or disk) but
E2B does, E2B is provisioned and ``Ready.note`` says so. A model pinned in the environment is
never swapped: the skip's hint names the E2B value to set instead.

GPUs on other Ray nodes: VRAM and disk there cannot be measured from here, so those checks are
skipped (the manager's budget check still weighs memory before anything starts).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from pydantic import ValidationError

from atomr_infer.errors import CPU_DEMO_HINT, SpecError, SpecProblem
from atomr_infer.log import get_logger
from atomr_infer.provision.facts import GpuInfo
from atomr_infer.provision.probe import GPU_INSTALL_HINT, ProbeEnv, ProbeReport, gb, probe
from atomr_infer.spec import Deployment, Serving, VllmConfig

log = get_logger(__name__)

ENV_AUTO = "ATOMR_INFER_GEMMA_AUTO"
ENV_MODEL = "ATOMR_INFER_GEMMA_MODEL"
ENV_DEPLOYMENT = "ATOMR_INFER_GEMMA_DEPLOYMENT"
ENV_GPU_UTIL = "ATOMR_INFER_GEMMA_GPU_UTIL"
ENV_MAX_LEN = "ATOMR_INFER_GEMMA_MAX_LEN"

DISABLE_VALUES = ("0", "false", "no", "off", "skip", "skip-quietly")
ENABLE_VALUES = ("1", "true", "yes", "on")
DEFAULT_MODEL = "google/gemma-4-E4B-it"
DEFAULT_DEPLOYMENT = "gemma-local"
DEFAULT_GPU_UTIL = 0.5
MAX_NUM_SEQS = 16
E4B_CPU_OFFLOAD_GB = 4.0
_MAX_LEN_RANGE = (16, 10_485_760)  # the spec's bounds for runtime_config.max_model_len
_SOURCE = "environment"

NO_GPU_HINT = f"Gemma needs a CUDA GPU; {CPU_DEMO_HINT}"


@dataclass(frozen=True)
class GemmaVariant:
    """One allowed Gemma 4 checkpoint and what it needs. Sizes in bytes (decimal GB)."""

    model: str
    size: str  # "E2B" or "E4B"
    vram_floor_bytes: int
    disk_floor_bytes: int
    cpu_offload_gb: float | None
    smaller: str | None  # the E2B checkpoint of the same kind (base / instruction-tuned)


VARIANTS: dict[str, GemmaVariant] = {
    v.model: v
    for v in (
        GemmaVariant("google/gemma-4-E2B", "E2B", 2_500_000_000, 4_000_000_000, None, None),
        GemmaVariant("google/gemma-4-E2B-it", "E2B", 2_500_000_000, 4_000_000_000, None, None),
        GemmaVariant(
            "google/gemma-4-E4B", "E4B", 4_500_000_000, 7_000_000_000, E4B_CPU_OFFLOAD_GB, "google/gemma-4-E2B"
        ),
        GemmaVariant(
            "google/gemma-4-E4B-it", "E4B", 4_500_000_000, 7_000_000_000, E4B_CPU_OFFLOAD_GB, "google/gemma-4-E2B-it"
        ),
    )
}
ALLOWED_MODELS: tuple[str, ...] = tuple(VARIANTS)


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class GemmaDefaults:
    """What to provision, read from ``ATOMR_INFER_GEMMA_*``. ``model_pinned``: the model came from
    the environment, so it is never swapped for a smaller one."""

    enabled: bool = True
    quiet: bool = False
    auto: str = ""  # the ATOMR_INFER_GEMMA_AUTO value as given, for messages
    model: str = DEFAULT_MODEL
    model_pinned: bool = False
    deployment_name: str = DEFAULT_DEPLOYMENT
    gpu_memory_utilization: float = DEFAULT_GPU_UTIL
    max_model_len: int | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> GemmaDefaults:
        """Read the settings. Every bad value is reported at once, as one ``SpecError`` whose
        problems name the variable, the value and what is allowed."""
        problems: list[SpecProblem] = []

        def bad(var: str, message: str) -> None:
            problems.append(SpecProblem(_SOURCE, var, message))

        def value(var: str) -> str | None:
            raw = environ.get(var)
            return raw.strip() if raw is not None and raw.strip() else None

        enabled, quiet, auto = True, False, value(ENV_AUTO) or ""
        if auto:
            if auto.lower() in DISABLE_VALUES:
                enabled, quiet = False, auto.lower() == "skip-quietly"
            elif auto.lower() not in ENABLE_VALUES:
                bad(
                    ENV_AUTO,
                    f"{auto!r} is not a setting: use one of {', '.join(DISABLE_VALUES)} to disable, "
                    f"{', '.join(ENABLE_VALUES)} (or unset) to enable",
                )

        model, pinned = DEFAULT_MODEL, False
        if (raw := value(ENV_MODEL)) is not None:
            if raw in VARIANTS:
                model, pinned = raw, True
            else:
                close = difflib.get_close_matches(raw, ALLOWED_MODELS, n=1, cutoff=0.8)
                guess = f" (did you mean {close[0]}?)" if close else ""
                bad(ENV_MODEL, f"{raw!r} is not an allowed Gemma model{guess}; allowed: {', '.join(ALLOWED_MODELS)}")

        name = value(ENV_DEPLOYMENT) or DEFAULT_DEPLOYMENT
        if (message := _name_problem(name)) is not None:
            bad(ENV_DEPLOYMENT, message)

        util = DEFAULT_GPU_UTIL
        if (raw := value(ENV_GPU_UTIL)) is not None:
            try:
                util = float(raw)
            except ValueError:
                util = math.nan
            if not (math.isfinite(util) and 0 < util <= 1):
                bad(ENV_GPU_UTIL, f"{raw!r} is not a fraction of GPU memory: give a number with 0 < x <= 1, e.g. 0.5")
                util = DEFAULT_GPU_UTIL

        max_len = None
        if (raw := value(ENV_MAX_LEN)) is not None:
            lo, hi = _MAX_LEN_RANGE
            try:
                max_len = int(raw)
            except ValueError:
                max_len = None
            if max_len is None or not lo <= max_len <= hi:
                bad(ENV_MAX_LEN, f"{raw!r} is not a context length: give a whole number from {lo} to {hi}")
                max_len = None

        if problems:
            raise SpecError(problems)
        return cls(
            enabled=enabled,
            quiet=quiet,
            auto=auto,
            model=model,
            model_pinned=pinned,
            deployment_name=name,
            gpu_memory_utilization=util,
            max_model_len=max_len,
        )

    def __post_init__(self) -> None:
        if self.model not in VARIANTS:
            raise ValueError(f"{self.model!r} is not an allowed Gemma model; allowed: {', '.join(ALLOWED_MODELS)}")

    @property
    def variant(self) -> GemmaVariant:
        return VARIANTS[self.model]

    def deployment(self) -> Deployment:
        """The spec to apply: one GPU, CUDA, eager mode, 16 sequences, 4 GiB offloaded for E4B."""
        return Deployment(
            name=self.deployment_name,
            model=self.model,
            device="cuda",
            gpus=1,
            replicas=1,
            runtime_config=VllmConfig(
                gpu_memory_utilization=self.gpu_memory_utilization,
                enforce_eager=True,
                max_num_seqs=MAX_NUM_SEQS,
                cpu_offload_gb=self.variant.cpu_offload_gb,
                max_model_len=self.max_model_len,
            ),
            serving=Serving(max_concurrent=MAX_NUM_SEQS),
        )


def _name_problem(name: str) -> str | None:
    try:
        Deployment(name=name, model=DEFAULT_MODEL)
    except ValidationError as exc:
        return str(exc.errors()[0]["msg"]).removeprefix("Value error, ")
    return None


# --------------------------------------------------------------------------- outcome


@dataclass(frozen=True)
class Ready:
    """The deployment was applied (or already matched). ``note`` says when E2B replaced E4B."""

    deployment_name: str
    model: str = ""
    changed: bool = False
    generation: int | None = None
    note: str = ""


@dataclass(frozen=True)
class Skipped:
    """Nothing was applied: ``reason`` is what is missing, ``hint`` how to fix it. ``quiet``:
    the user asked for silence (``ATOMR_INFER_GEMMA_AUTO=skip-quietly``)."""

    reason: str
    hint: str = ""
    quiet: bool = False


def provision_if_ready(
    manager: Any,
    defaults: GemmaDefaults,
    report: ProbeReport | None = None,
    *,
    env: ProbeEnv | None = None,
) -> Ready | Skipped:
    """Apply the Gemma deployment through ``manager`` if this host can run it, else say why not.

    ``manager``: a ``ControlPlane`` (control/client.py), or any object with ``apply(spec)``.
    ``report``: a probe already taken (one is taken for ``defaults.model`` otherwise); ``env``
    fakes the probe's facts in tests. Errors from ``apply`` itself (a budget check) propagate.
    """
    if not defaults.enabled:
        return _skip(defaults, f"disabled by {ENV_AUTO}={defaults.auto}", f"unset {ENV_AUTO} to provision Gemma")
    if report is None or report.gpu is None or report.vllm is None or report.hf is None or report.ray is None:
        report = probe(defaults.model, env)
    env = env or ProbeEnv()

    if not report.gpu_available:
        return _skip(defaults, report.no_gpu_reason, NO_GPU_HINT)
    local = bool(report.local_gpus)
    vllm = report.vllm
    if vllm is None or not vllm.importable:
        return _skip(defaults, f"vLLM is not importable: {vllm.error if vllm else 'not probed'}", GPU_INSTALL_HINT)
    if local and vllm.build == "cpu":
        label = f"{vllm.distribution} {vllm.version}"
        return _skip(
            defaults, f"the installed vLLM ({label}) is the CPU build; it cannot use this GPU", GPU_INSTALL_HINT
        )

    chosen, note = defaults, ""
    if not local:
        log.info("gemma.remote_gpus", gpus=report.cluster_gpus, unchecked="vram, disk (left to the manager's budget)")
    elif (misfit := _resource_problem(defaults, report, env)) is not None:
        outcome = _fall_back(defaults, misfit, report, env)
        if isinstance(outcome, Skipped):
            return outcome
        chosen, note = outcome

    cached = _cached(chosen.model, report, env)
    if not cached and report.hf is not None and not report.hf.token:
        return _skip(
            defaults,
            f"no Hugging Face token and {chosen.model} is not in the HF cache at {report.hf.path}",
            f"accept the Gemma license at https://huggingface.co/{chosen.model}, then run `hf auth login` "
            f"or set HF_TOKEN (or fill the cache: hf download {chosen.model})",
        )

    spec = chosen.deployment()
    result = manager.apply(spec)
    ready = Ready(
        deployment_name=getattr(result, "name", spec.name),
        model=spec.model,
        changed=bool(getattr(result, "changed", True)),
        generation=getattr(result, "generation", None),
        note=note,
    )
    log.info("gemma.ready", deployment=ready.deployment_name, model=ready.model, changed=ready.changed, note=note)
    return ready


def _fall_back(
    defaults: GemmaDefaults, misfit: _Misfit, report: ProbeReport, env: ProbeEnv
) -> tuple[GemmaDefaults, str] | Skipped:
    """E4B does not fit: take E2B if it fits and the model was not pinned, else say what to do."""
    if defaults.variant.smaller is None:
        return _skip(defaults, misfit.reason, misfit.hint)
    smaller = replace(defaults, model=defaults.variant.smaller)
    smaller_misfit = _resource_problem(smaller, report, env)
    if smaller_misfit is None and not defaults.model_pinned:
        return smaller, f"{defaults.model} does not fit ({misfit.reason}); provisioning {smaller.model} instead"
    if smaller_misfit is None:
        return _skip(defaults, misfit.reason, f"set {ENV_MODEL}={smaller.model}, which fits; or {misfit.hint}")
    if not defaults.model_pinned:
        reason = f"{misfit.reason}; the fallback {smaller.model} does not fit either: {smaller_misfit.reason}"
        return _skip(defaults, reason, smaller_misfit.hint)
    if smaller_misfit.util_that_fits is not None:
        also = f"{ENV_MODEL}={smaller.model} with {ENV_GPU_UTIL}={smaller_misfit.util_that_fits:g}, which fits"
        return _skip(defaults, misfit.reason, f"{misfit.hint}; or set {also}")
    return _skip(defaults, misfit.reason, misfit.hint)


def _skip(defaults: GemmaDefaults, reason: str, hint: str) -> Skipped:
    if defaults.quiet:
        log.debug("gemma.skipped", reason=reason)
    else:
        log.info("gemma.skipped", reason=reason, hint=hint)
    return Skipped(reason=reason, hint=hint, quiet=defaults.quiet)


def _cached(model: str, report: ProbeReport, env: ProbeEnv) -> bool:
    if report.model == model and report.weights_cached is not None:
        return report.weights_cached
    if report.hf is None:
        return False
    try:
        return bool(env.weights_cached(model, report.hf.path))
    except Exception as exc:  # an unreadable cache counts as "not cached"
        log.warning("gemma.weights_check_failed", model=model, error=str(exc))
        return False


@dataclass(frozen=True)
class _Misfit:
    """Why a variant does not fit, how to fix it, and a gpu_util that would make it fit (if any)."""

    reason: str
    hint: str
    util_that_fits: float | None = None


def _resource_problem(defaults: GemmaDefaults, report: ProbeReport, env: ProbeEnv) -> _Misfit | None:
    """Why this variant does not fit this host's GPUs or disk, or ``None`` when it does."""
    v, util = defaults.variant, defaults.gpu_memory_utilization
    misfit = _vram_problem(v, util, report.local_gpus)
    if misfit is not None:
        return misfit
    hf = report.hf
    if hf is None or hf.free_bytes is None or hf.free_bytes >= v.disk_floor_bytes:
        return None
    if _cached(v.model, report, env):
        return None
    return _Misfit(
        f"too little disk for {v.model}: {gb(hf.free_bytes)} free at {hf.path}, "
        f"{v.size} needs {gb(v.disk_floor_bytes)}",
        "free disk space there, or point HF_HOME / HF_HUB_CACHE at a larger disk",
    )


def _vram_problem(v: GemmaVariant, util: float, gpus: tuple[GpuInfo, ...]) -> _Misfit | None:
    """vLLM reserves ``util x total`` and will not start with less free: that must cover the floor."""
    if any(v.vram_floor_bytes <= util * g.total_bytes <= g.free_bytes for g in gpus):
        return None
    g = max(gpus, key=lambda g: min(g.free_bytes, util * g.total_bytes))
    ask = util * g.total_bytes
    where = f"GPU #{g.index} ({g.name}, {gb(g.total_bytes)}, {gb(g.free_bytes)} free)"
    if ask < v.vram_floor_bytes:
        reason = (
            f"too little GPU memory for {v.model}: {ENV_GPU_UTIL}={util:g} of {where} gives vLLM {gb(ask)}, "
            f"{v.size} needs {gb(v.vram_floor_bytes)}"
        )
    else:
        reason = (
            f"too little free GPU memory for {v.model}: {ENV_GPU_UTIL}={util:g} asks vLLM to reserve {gb(ask)} "
            f"of {where}, and vLLM will not start with less free"
        )
    # A utilization that fits: floor/total <= u <= free/total, rounded up to a hundredth.
    fits = math.ceil(v.vram_floor_bytes / g.total_bytes * 100) / 100
    if fits <= min(g.free_bytes / g.total_bytes, 1.0):
        return _Misfit(reason, f"set {ENV_GPU_UTIL}={fits:g}", fits)
    if g.total_bytes >= v.vram_floor_bytes:
        return _Misfit(reason, "free GPU memory: other processes hold it (see nvidia-smi)")
    return _Misfit(reason, f"this GPU is too small for {v.size}")
