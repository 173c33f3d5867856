"""deployments/smollm2.yaml on the device a run asks for: what the benchmarks (``--device``), the
GPU smoke (scripts/gpu_smoke.py) and tests/gpu deploy.

The file is a CPU spec. On ``cuda`` it becomes ``device: cuda`` with ``gpus`` GPUs and no
``cpu_kvcache_space_gb``, and ``gpu_memory_utilization`` is set where engines share one GPU
(``SHARED_GPU_MEMORY`` each: a benchmark's ``vllm serve`` or raw ``vllm.LLM`` beside atomr's
replica, or a rolling replacement beside the replica it replaces). ``graphs`` turns
``enforce_eager`` off (CUDA graphs and torch.compile; on an H100 the bundled model was ready in
82 s with them, 27 s eager); eager is the default, as in the file. On ``cpu`` without
``graphs`` the spec is the file's, unchanged.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import yaml

from atomr_infer.spec import Deployment, load_deployments

SMOLLM2 = Path(__file__).resolve().parents[1] / "deployments" / "smollm2.yaml"
DEVICES = ("cpu", "cuda")
SHARED_GPU_MEMORY = 0.3  # two engines on one GPU (an H100 80GB: 24 GiB each, ~20 for KV cache)


def smollm2_fields(device: str = "cpu", *, graphs: bool = False, gpus: int = 1,
                   gpu_memory_utilization: float | None = None, **top: Any) -> dict[str, Any]:
    """The spec's fields as YAML would hold them (to write a file ``atomr deploy`` reads);
    ``top``: top-level fields to set (``name``, ``replicas``, ...)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, not {device!r}")
    data = yaml.safe_load(SMOLLM2.read_text())
    config = data["runtime_config"]
    if device == "cuda":
        data.update(device="cuda", gpus=gpus)
        config.pop("cpu_kvcache_space_gb", None)
        if gpu_memory_utilization is not None:
            config["gpu_memory_utilization"] = gpu_memory_utilization
    if graphs:
        config["enforce_eager"] = False
    data.update(top)
    return data


def smollm2_on(device: str = "cpu", **options: Any) -> Deployment:
    """``smollm2_fields`` validated as ``atomr deploy`` validates a file."""
    return load_deployments(smollm2_fields(device, **options))[0]


def add_device_options(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--graphs``, the same on every benchmark."""
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="Where the engines run (default cpu: deployments/smollm2.yaml as it is). cuda: "
                        f"device cuda, gpus 1, no cpu_kvcache_space_gb, gpu_memory_utilization {SHARED_GPU_MEMORY} "
                        "(two engines share the GPU).")
    parser.add_argument("--graphs", action="store_true",
                        help="enforce_eager false: CUDA graphs and torch.compile (default: eager, as the spec). "
                        "vLLM 0.32's compiled CPU path answers the bundled model wrongly.")
