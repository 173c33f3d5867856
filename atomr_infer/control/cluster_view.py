"""What the budget checks know of the Ray cluster (``ClusterView``), read from Ray.

Ray reports GPUs and their accelerator type but not their memory, so the memory per GPU comes
from a table of known types; an unknown type skips the GPU-memory check (budget.py). Prices
are ``DEFAULT_GPU_PRICES_USD``, overridden by ``ATOMR_GPU_PRICES`` (a JSON object of accelerator
type → $/GPU-hour).
"""

from __future__ import annotations

import json
import os
from typing import Any

from atomr_infer.control.budget import DEFAULT_GPU_PRICES_USD, ClusterView

# Per-GPU memory by Ray accelerator type, GiB.
GPU_MEMORY_GIB = {"H200": 141, "H100": 80, "A100": 80, "L40S": 48, "A10G": 24, "L4": 24, "T4": 16}


def ray_cluster_view() -> ClusterView:
    """GPUs, their type and memory, prices, and the memory free on this (the manager's) node."""
    import psutil
    import ray

    resources = ray.cluster_resources()
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    accel = next((k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")), None)
    mem = GPU_MEMORY_GIB.get(accel or "")
    return ClusterView(
        total_gpus=float(resources.get("GPU", 0)),
        accelerator_type=accel,
        gpu_memory_bytes=mem * (1 << 30) if mem else None,
        prices_usd=prices_from_env(),
        cpu_memory_available_bytes=psutil.virtual_memory().available,
        largest_node_gpus=max((float(n.get("GPU", 0)) for n in nodes), default=None),
        largest_node_cpus=max((float(n.get("CPU", 0)) for n in nodes), default=None),
    )


def prices_from_env(environ: dict[str, str] | None = None) -> dict[str, float]:
    env = os.environ if environ is None else environ
    prices = dict(DEFAULT_GPU_PRICES_USD)
    raw = env.get("ATOMR_GPU_PRICES")
    if raw:
        try:
            parsed: Any = json.loads(raw)
            prices.update({str(k): float(v) for k, v in parsed.items()})
        except (ValueError, AttributeError, TypeError) as exc:
            raise ValueError(f"ATOMR_GPU_PRICES: not a JSON object of type → $/GPU-hour: {raw!r} ({exc})") from None
    return prices
