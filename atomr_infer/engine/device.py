"""Pick the concrete device for a deployment: vLLM gets ``cuda`` or ``cpu``, never "auto"."""

from __future__ import annotations

from typing import Literal

from atomr_infer.errors import DeviceUnavailable
from atomr_infer.spec import Deployment

Device = Literal["cuda", "cpu"]


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def resolve_device(deployment: Deployment) -> Device:
    """``auto`` → ``cuda`` when a GPU is usable here, else ``cpu``; ``cuda`` without one raises."""
    if deployment.device == "cpu":
        return "cpu"
    if cuda_available():
        return "cuda"
    if deployment.device == "auto":
        return "cpu"
    raise DeviceUnavailable(
        deployment.name,
        "device is 'cuda' but torch sees no usable CUDA GPU on this host",
    )
