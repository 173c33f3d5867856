"""Desired state kept outside the manager actor, in Ray's GCS key-value store.

A restarted manager reads it back and re-adopts the replicas it names instead of starting
new ones. The GCS lives as long as the Ray cluster, which is exactly as long as the
replicas it describes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

KEY = b"atomr/desired-state/v1"
KV_NAMESPACE = "atomr"


@dataclass
class DeploymentRecord:
    spec: dict[str, Any]  # normalized spec
    generation: int
    runtime_key: str
    nonce: int = 0  # bumped by forced restarts (restart_on_apply: true)
    next_index: int = 0
    replicas: dict[str, dict[str, Any]] = field(default_factory=dict)  # id → {runtime_key, generation, started_at}
    autoscaled_replicas: int | None = None  # the autoscaler's target, kept across a manager restart
    removing: bool = False  # removed, its replicas still draining: a restarted manager drains and stops them


class StateStore:
    def load(self) -> dict[str, DeploymentRecord]:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(KEY, namespace=KV_NAMESPACE)
        if not raw:
            return {}
        data = json.loads(raw)
        return {name: DeploymentRecord(**rec) for name, rec in data.items()}

    def save(self, records: dict[str, DeploymentRecord]) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        blob = json.dumps({name: asdict(rec) for name, rec in records.items()}, sort_keys=True)
        _internal_kv_put(KEY, blob.encode(), overwrite=True, namespace=KV_NAMESPACE)


class MemoryStore(StateStore):
    """For unit tests and for managers that should forget on restart."""

    def __init__(self) -> None:
        self._blob: dict[str, Any] = {}

    def load(self) -> dict[str, DeploymentRecord]:
        return {name: DeploymentRecord(**json.loads(rec)) for name, rec in self._blob.items()}

    def save(self, records: dict[str, DeploymentRecord]) -> None:
        self._blob = {name: json.dumps(asdict(rec)) for name, rec in records.items()}
