"""What this host and cluster can run: GPUs, CUDA, vLLM, the HF cache, an HF token, Ray.

``probe()`` gathers raw facts through a :class:`ProbeEnv` (the gatherers of
:mod:`atomr_infer.provision.facts`, each replaceable in tests), concurrently, and turns them
into a :class:`ProbeReport`: the facts, typed, plus one :class:`Check` per line of
``atomr probe`` (``name``, ``ok``, ``detail``, ``hint``). Nothing here raises because a piece
is missing: a missing piece is a failed check with a reason.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from atomr_infer.errors import CPU_DEMO_HINT
from atomr_infer.log import get_logger
from atomr_infer.models.registry import BUNDLED_MODELS, bundled_name, is_local_path
from atomr_infer.models.resolve import hf_cache_location
from atomr_infer.provision.facts import (
    GpuFacts,
    GpuInfo,
    HfCacheInfo,
    RayInfo,
    VllmInfo,
    disk_free_bytes,
    gather_gpus,
    gather_ray,
    gather_vllm,
    hf_token_source,
    nearest_existing,
    weights_cached,
)

log = get_logger(__name__)

Section = Literal["gpu", "vllm", "hf", "ray"]
ALL_SECTIONS: frozenset[Section] = frozenset(("gpu", "vllm", "hf", "ray"))

GPU_INSTALL_HINT = "install the CUDA build of vLLM on a GPU host: pip install 'atomr-infer[gpu]'"
TOKEN_HINT = (
    "gated models such as Gemma need one: accept the license on huggingface.co, "
    "then run `hf auth login` or set HF_TOKEN"
)


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class Check:
    """One line of the checklist."""

    name: str
    ok: bool
    detail: str
    hint: str = ""


@dataclass(frozen=True)
class ProbeReport:
    """Facts about this host and cluster, and the checklist built from them.

    Sections not probed (see ``probe(sections=…)``) are ``None`` and have no checks.
    """

    model: str | None
    gpu: GpuFacts | None
    vllm: VllmInfo | None
    hf: HfCacheInfo | None
    ray: RayInfo | None
    weights_cached: bool | None  # for ``model``; None when no model was asked about or it cannot be told
    checks: tuple[Check, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def check(self, name: str) -> Check | None:
        return next((c for c in self.checks if c.name == name), None)

    @property
    def local_gpus(self) -> tuple[GpuInfo, ...]:
        """GPUs this process can use through CUDA (none when CUDA is not usable)."""
        return self.gpu.gpus if self.gpu and self.gpu.cuda_usable else ()

    @property
    def cluster_gpus(self) -> float:
        return (self.ray.gpus or 0.0) if self.ray is not None and self.ray.reachable else 0.0

    @property
    def gpu_available(self) -> bool:
        """A CUDA GPU can be had: usable on this host, or offered by a reachable Ray cluster.

        Ray hides GPUs from actors that reserve none, so inside the manager actor the cluster's
        resources are what count.
        """
        return bool(self.local_gpus) or self.cluster_gpus > 0

    @property
    def no_gpu_reason(self) -> str:
        """Why no GPU can be had, in one clause ("" when one can)."""
        if self.gpu_available:
            return ""
        local = _local_gpu_problem(self.gpu)
        if self.ray is not None and self.ray.reachable:
            cluster = f"the Ray cluster at {self.ray.address or 'this process'} has no GPUs"
        else:
            cluster = "no Ray cluster with GPUs is reachable"
        return f"no usable CUDA GPU on this host ({local}) and {cluster}"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready. Holds no secret: the HF token is only ever a yes/no."""
        data = asdict(self)
        data["ok"] = self.ok
        data["gpu_available"] = self.gpu_available
        if self.vllm is not None:
            data["vllm"]["build"] = self.vllm.build
        return data


def _local_gpu_problem(g: GpuFacts | None) -> str:
    if g is None:
        return "GPUs not probed"
    if g.torch_version is None:
        torch = g.torch_problem
    elif not g.torch_cuda:
        torch = f"torch {g.torch_version} is a CPU build"
    else:
        torch = f"torch {g.torch_version} cannot use CUDA"
    if not g.gpus:
        return f"no NVIDIA GPU found; {torch}"
    return f"{len(g.gpus)} GPU{'s' if len(g.gpus) != 1 else ''} seen, but {torch}"


@dataclass(frozen=True)
class ProbeEnv:
    """The raw fact gatherers ``probe()`` calls. Replace any of them to fake a host in tests."""

    gpus: Callable[[], GpuFacts] = field(default_factory=lambda: gather_gpus)
    vllm: Callable[[], VllmInfo] = field(default_factory=lambda: gather_vllm)
    hf_cache: Callable[[], tuple[str, str]] = field(default_factory=lambda: hf_cache_location)
    disk_free: Callable[[str], int | None] = field(default_factory=lambda: disk_free_bytes)
    hf_token: Callable[[], str] = field(default_factory=lambda: hf_token_source)
    weights_cached: Callable[[str, str], bool | None] = field(default_factory=lambda: weights_cached)
    ray: Callable[[], RayInfo] = field(default_factory=lambda: gather_ray)


# --------------------------------------------------------------------------- probe


def probe(
    model: str | None = None,
    env: ProbeEnv | None = None,
    *,
    sections: Collection[Section] = ALL_SECTIONS,
) -> ProbeReport:
    """Probe this host (and a running Ray cluster). ``model``: also check its weights are cached.

    ``sections`` limits the work, e.g. ``{"gpu", "ray"}`` for a device check. A missing or
    failing piece becomes a failed check, never an exception.
    """
    env = env or ProbeEnv()
    wanted = set(sections)
    unknown = wanted - ALL_SECTIONS
    if unknown:
        raise ValueError(f"unknown probe sections {sorted(unknown)}; known: {sorted(ALL_SECTIONS)}")
    with ThreadPoolExecutor(max_workers=3, thread_name_prefix="atomr-probe") as pool:
        futures = {
            "gpu": pool.submit(_safe, env.gpus, GpuFacts(notes=("GPU probe failed",))) if "gpu" in wanted else None,
            "vllm": pool.submit(_safe, env.vllm, VllmInfo(error="vLLM probe failed")) if "vllm" in wanted else None,
            "ray": pool.submit(_safe, env.ray, RayInfo(state="unreachable", error="Ray probe failed"))
            if "ray" in wanted
            else None,
        }
        hf = _hf_facts(env) if "hf" in wanted else None
        cached = _model_cached(env, model, hf.path) if hf is not None and model else None
        gpu, vllm, ray_info = (f.result() if f is not None else None for f in futures.values())

    checks: list[Check] = []
    if gpu is not None:
        checks += [_gpu_check(gpu), _cuda_check(gpu)]
    if vllm is not None:
        checks.append(_vllm_check(vllm, gpu))
    if hf is not None:
        checks += [_cache_check(hf), _disk_check(hf), _token_check(hf)]
        if model:
            checks.append(_weights_check(model, cached, hf))
    if ray_info is not None:
        checks.append(_ray_check(ray_info))
    report = ProbeReport(
        model=model, gpu=gpu, vllm=vllm, hf=hf, ray=ray_info, weights_cached=cached, checks=tuple(checks)
    )
    log.debug("probe.done", ok=report.ok, failed=[c.name for c in checks if not c.ok])
    return report


def _safe(fn: Callable[[], Any], fallback: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # a gatherer must not take the whole report down
        log.warning("probe.gatherer_failed", gatherer=getattr(fn, "__name__", repr(fn)), error=str(exc))
        return fallback


def _hf_facts(env: ProbeEnv) -> HfCacheInfo:
    path, source = _safe(env.hf_cache, hf_cache_location())
    token_source = _safe(env.hf_token, "")
    return HfCacheInfo(
        path=path,
        source=source,
        exists=os.path.isdir(path),
        writable=os.access(nearest_existing(path), os.W_OK),
        free_bytes=_safe(lambda: env.disk_free(path), None),
        token=bool(token_source),
        token_source=token_source,
    )


def _model_cached(env: ProbeEnv, model: str, cache_dir: str) -> bool | None:
    bundled = bundled_name(model)
    if bundled is not None:
        entry = BUNDLED_MODELS.get(bundled)
        if entry is None:
            return False
        try:
            importlib.metadata.version(entry.package)
            return True
        except importlib.metadata.PackageNotFoundError:
            return False
    if is_local_path(model):
        return Path(model).expanduser().is_dir()
    return _safe(lambda: env.weights_cached(model, cache_dir), None)


# --------------------------------------------------------------------------- checks


def gb(n: float | None) -> str:
    """Bytes as decimal gigabytes, e.g. ``"4.5 GB"``."""
    if n is None or not math.isfinite(n):
        return "unknown"
    return f"{n / 1e9:.1f} GB"


def _gpu_check(g: GpuFacts) -> Check:
    if g.gpus:
        names = ", ".join(f"#{x.index} {x.name} ({gb(x.free_bytes)} free of {gb(x.total_bytes)})" for x in g.gpus)
        return Check("gpu", True, f"{len(g.gpus)} GPU{'s' if len(g.gpus) != 1 else ''}: {names}")
    why = list(g.notes)
    if g.torch_version is not None and not g.torch_cuda:
        why.append("torch is a CPU build")
    detail = "no NVIDIA GPU found" + (f" ({', '.join(why)})" if why else "")
    return Check("gpu", False, detail, CPU_DEMO_HINT)


def _cuda_check(g: GpuFacts) -> Check:
    if g.torch_version is None:
        return Check("cuda", False, f"not usable: {g.torch_problem}", "run `make setup`")
    if g.cuda_usable:
        return Check("cuda", True, f"usable (torch {g.torch_version}, CUDA {g.torch_cuda})")
    if not g.torch_cuda:
        hint = "install a CUDA build of torch: pip install 'atomr-infer[gpu]'" if g.gpus else ""
        return Check("cuda", False, f"not usable: torch {g.torch_version} is a CPU build", hint)
    hint = "check the NVIDIA driver and CUDA_VISIBLE_DEVICES" if g.gpus else ""
    return Check("cuda", False, f"not usable: torch {g.torch_version} (CUDA {g.torch_cuda}) sees no GPU", hint)


def _vllm_check(v: VllmInfo, g: GpuFacts | None) -> Check:
    label = f"{v.distribution} {v.version}" if v.distribution else "vllm"
    if not v.importable:
        detail = f"{label}: {v.error}" if v.distribution else f"not installed ({v.error})"
        return Check("vllm", False, detail, "run `make setup` (CPU build) or pip install 'atomr-infer[gpu]'")
    build = v.build
    detail = f"{label}, {'CPU' if build == 'cpu' else str(build).upper()} build"
    if build == "cpu" and g is not None and g.cuda_usable:
        return Check("vllm", False, detail + ", but this host has a usable GPU", GPU_INSTALL_HINT)
    return Check("vllm", True, detail)


def _cache_check(h: HfCacheInfo) -> Check:
    state = "" if h.exists else ", not created yet"
    detail = f"{h.path} ({'from ' + h.source if h.source != 'default' else 'default'}{state})"
    if not h.writable:
        hint = "set HF_HOME or HF_HUB_CACHE to a writable directory"
        return Check("hf_cache", False, detail + ", not writable", hint)
    return Check("hf_cache", True, detail)


def _disk_check(h: HfCacheInfo) -> Check:
    if h.free_bytes is None:
        return Check("disk", False, f"cannot read free space at {h.path}", "check that the path is on a mounted disk")
    return Check("disk", True, f"{gb(h.free_bytes)} free at {h.path}")


def _token_check(h: HfCacheInfo) -> Check:
    if h.token:
        return Check("hf_token", True, f"present ({h.token_source})")
    return Check("hf_token", False, "none (HF_TOKEN unset, no stored token)", TOKEN_HINT)


def _weights_check(model: str, cached: bool | None, h: HfCacheInfo) -> Check:
    bundled = bundled_name(model)
    if bundled is not None:
        entry = BUNDLED_MODELS.get(bundled)
        package = entry.package if entry else "(unknown bundled model)"
        if cached:
            return Check("weights", True, f"{model} ships in the installed package {package}")
        return Check("weights", False, f"{model}: package {package} is not installed", "run `make setup`")
    if cached:
        return Check("weights", True, f"{model} is cached")
    if cached is None:
        return Check("weights", False, f"cannot tell whether {model} is cached")
    if is_local_path(model):
        return Check("weights", False, f"{model} is not a directory", "give the path of a model directory")
    hint = f"downloaded on first use (needs an HF token for gated models), or now: hf download {model}"
    return Check("weights", False, f"{model} is not in {h.path}", hint)


def _ray_check(r: RayInfo) -> Check:
    if r.state == "missing":
        return Check("ray", False, r.error, "run `make setup`")
    if r.reachable:
        where = f"at {r.address}" if r.address else "(this process is connected)"
        gpus = f"{r.gpus:g} GPU{'s' if r.gpus != 1 else ''}"
        return Check("ray", True, f"cluster {where}: {r.nodes} node{'s' if r.nodes != 1 else ''}, {gpus}")
    if r.state == "not-running":
        return Check("ray", True, "no cluster running; a local one starts on demand")
    return Check(
        "ray",
        False,
        f"cluster at {r.address} unreachable: {r.error}",
        "start it (`ray start --head`) or unset RAY_ADDRESS to use a local Ray",
    )
