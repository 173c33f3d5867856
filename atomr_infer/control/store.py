"""Desired state kept outside the manager actor, in Ray's GCS key-value store.

A restarted manager reads it back and re-adopts the replicas it names instead of starting
new ones. The GCS lives as long as the Ray cluster, which is exactly as long as the
replicas it describes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
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


def decoded(data: dict[str, Any]) -> DeploymentRecord:
    """A stored record, less fields this version does not know (a newer atomr's: the record
    still recovers, and a newer manager later finds them again where this one kept them)."""
    known = {f.name for f in fields(DeploymentRecord)}
    return DeploymentRecord(**{k: v for k, v in data.items() if k in known})


def encoded(record: DeploymentRecord) -> dict[str, Any]:
    """A record to store; ``removing`` only where set, so that an atomr older than it reads the
    records of deployments that are not being removed."""
    data = asdict(record)
    if not data["removing"]:
        del data["removing"]
    return data


class StateStore:
    def load(self) -> dict[str, DeploymentRecord]:
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(KEY, namespace=KV_NAMESPACE)
        if not raw:
            return {}
        data = json.loads(raw)
        return {name: decoded(rec) for name, rec in data.items()}

    def save(self, records: dict[str, DeploymentRecord]) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        blob = json.dumps({name: encoded(rec) for name, rec in records.items()}, sort_keys=True)
        _internal_kv_put(KEY, blob.encode(), overwrite=True, namespace=KV_NAMESPACE)


class MemoryStore(StateStore):
    """For unit tests and for managers that should forget on restart."""

    def __init__(self) -> None:
        self._blob: dict[str, Any] = {}

    def load(self) -> dict[str, DeploymentRecord]:
        return {name: decoded(json.loads(rec)) for name, rec in self._blob.items()}

    def save(self, records: dict[str, DeploymentRecord]) -> None:
        self._blob = {name: json.dumps(encoded(rec)) for name, rec in records.items()}
