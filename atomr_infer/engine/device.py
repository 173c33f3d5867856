"""Pick the concrete device for a deployment: vLLM gets ``cuda`` or ``cpu``, never "auto"."""

from __future__ import annotations

import os
from typing import Literal

from atomr_infer.errors import DeviceUnavailable
from atomr_infer.spec import Deployment

Device = Literal["cuda", "cpu"]
# Set (milliseconds per step) on a Ray head, its replicas serve with the emulated engine
# (engine/vllm/emulated.py), which stands in for a GPU: scripts/stack_memory.py measures a GPU
# spec's whole stack on a host without one this way. Never for serving.
EMULATED_STEP_ENV = "ATOMR_EMULATED_STEP_MS"


def emulated_step_s() -> float | None:
    value = os.environ.get(EMULATED_STEP_ENV)
    if not value:
        return None
    try:
        step_ms = float(value)
    except ValueError:
        step_ms = 0.0
    if not step_ms > 0:
        raise ValueError(f"{EMULATED_STEP_ENV}={value!r}: milliseconds per step, a number above 0")
    return step_ms / 1000


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
    if emulated_step_s() is not None:
        return "cuda" if deployment.device == "cuda" else "cpu"
    if cuda_available():
        return "cuda"
    if deployment.device == "auto":
        return "cpu"
    raise DeviceUnavailable(
        deployment.name,
        "device is 'cuda' but torch sees no usable CUDA GPU on this host",
    )
