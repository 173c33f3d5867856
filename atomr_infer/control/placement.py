"""Which node a new replica goes to: ``placement: spread`` (default) or ``pack``.

Spread puts it on the node with the fewest replicas of its deployment, so that losing a node
loses the fewest (Ray Serve's default, ``SPREAD``); pack on the node with the most that still
has room, so that whole nodes stay free for other work (Ray Serve's compact scheduling). Only
nodes with the resources free now are candidates. The choice is a soft hint to Ray (node
affinity, or a placement group's target node): if the node filled up meanwhile, Ray places the
replica elsewhere rather than leaving it pending. A replica's own GPUs are one actor's (or one
placement-group bundle's) resources, which Ray always takes from a single node.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from atomr_infer.control.budget import ClusterView, uses_gpus
from atomr_infer.log import get_logger
from atomr_infer.spec import Deployment

log = get_logger(__name__)


def pick_node(
    placement: str, free: Mapping[str, Mapping[str, float]], need: Mapping[str, float], peer_nodes: Sequence[str]
) -> str | None:
    """The node for a replica needing ``need`` resources, given each alive node's ``free``
    resources and the nodes of the deployment's other replicas; None when none has room."""
    fits = [n for n, res in free.items() if all(res.get(k, 0.0) >= v for k, v in need.items() if v > 0)]
    if not fits:
        return None
    count = collections.Counter(peer_nodes)
    main = "GPU" if need.get("GPU", 0) > 0 else "CPU"
    if placement == "pack":
        # Most peers first; then the tightest fit, so that emptier nodes stay free.
        return min(fits, key=lambda n: (-count[n], free[n].get(main, 0.0), n))
    return min(fits, key=lambda n: (count[n], -free[n].get(main, 0.0), n))


def free_resources_by_node() -> dict[str, dict[str, float]]:
    """Each alive node's free resources, from Ray (empty when it cannot say)."""
    try:
        from ray._private.state import available_resources_per_node  # as Ray Serve reads them

        return {node: dict(res) for node, res in available_resources_per_node().items()}
    except Exception as exc:  # noqa: BLE001 - no hint then: Ray places the replica itself
        log.warning("node_resources_unknown", error=repr(exc))
        return {}


class GpuChoice:
    """Whether a deployment's new replica reserves GPUs. ``device: auto`` asks for them when the
    cluster has GPUs; once its replicas ran on GPUs it keeps asking (pending until a GPU node is
    back): with the last GPU node lost for a while, a replacement became a CPU replica, which on
    a node with vLLM's CUDA build failed to start three times, and the deployment gave up."""

    def __init__(self, cluster: Callable[[], ClusterView]) -> None:
        self._cluster = cluster
        self._on_gpus: set[str] = set()

    def __call__(self, spec: Deployment) -> bool:
        if spec.device == "auto" and spec.name in self._on_gpus:
            return True
        on_gpus = uses_gpus(spec, self._cluster())
        if on_gpus:
            self._on_gpus.add(spec.name)
        return on_gpus

    def forget(self, name: str) -> None:
        """``name`` was removed: a deployment made again under it decides afresh."""
        self._on_gpus.discard(name)


def node_has_room(need: Mapping[str, float]) -> bool:
    """Whether a node has ``need`` free now; True when Ray cannot say."""
    free = free_resources_by_node()
    return not free or pick_node("spread", free, need, []) is not None


def node_hint(placement: str, need: Mapping[str, float], peer_nodes: Sequence[str]) -> str | None:
    return pick_node(placement, free_resources_by_node(), need, peer_nodes)


def head_node_id() -> str | None:
    """The head node's id (where the manager runs: the node that lives as long as the cluster)."""
    import ray

    for node in ray.nodes():
        if node.get("Alive") and HEAD_RESOURCE in node.get("Resources", {}):
            return str(node["NodeID"])
    return None


HEAD_RESOURCE = "node:__internal_head__"  # Ray gives it to the head node alone, whatever its node id


def on_head_node() -> dict[str, Any]:
    """Actor options that pin an actor to the head node: by the head's own resource, not its
    node id, so that an actor restarted after the head came back (a new node, with GCS fault
    tolerance) is placed on the new head (as Ray Train places its state actor)."""
    return {"resources": {HEAD_RESOURCE: 0.001}}
