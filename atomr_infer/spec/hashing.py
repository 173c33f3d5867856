"""Canonical hash and field-level diff of normalized specs.

"Normalized" means every default filled in, so ``replicas: 1`` written out and ``replicas``
left unset hash the same; keys are sorted, so YAML key order never matters.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from atomr_infer.spec.deployment import Deployment


def normalized(spec: Deployment) -> dict[str, Any]:
    return spec.model_dump(mode="json")


# What a running replica does not depend on: changed in place, or by starting/stopping
# replicas. Everything else restarts it (rolling): the model, the engine config, and vLLM's
# OpenAI server options under serving.openai, which the replica's server is built with.
_NOT_RESTARTING = (
    "serving", "budget", "restart_on_apply", "replicas", "autoscaling", "placement", "routing", "lora.adapters",
)
_RESTARTING_ANYWAY = ("serving.openai",)


def restarts_replicas(path: str) -> bool:
    """Whether a change of the field at dotted ``path`` needs the replicas replaced."""
    if any(path == p or path.startswith(p + ".") for p in _RESTARTING_ANYWAY):
        return True
    return not any(path == p or path.startswith(p + ".") for p in _NOT_RESTARTING)


def runtime_fields(spec: Deployment) -> dict[str, Any]:
    """The part of the normalized spec a running replica depends on (``restarts_replicas``)."""
    data = normalized(spec)
    kept = {k: v for k, v in data.items() if k not in _NOT_RESTARTING}
    kept["serving.openai"] = data["serving"]["openai"]
    if kept.get("lora") is not None:  # LoRA on and vLLM's limits restart; the adapters do not
        kept["lora"] = {k: v for k, v in kept["lora"].items() if k != "adapters"}
    return kept


def spec_hash(spec: Deployment) -> str:
    """SHA-256 of the normalized spec as canonical JSON (sorted keys, no whitespace)."""
    blob = json.dumps(normalized(spec), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class FieldChange:
    path: str  # dotted, e.g. "runtime_config.max_model_len"
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.path}: {_fmt(self.old)} → {_fmt(self.new)}"


def spec_changes(old: Deployment, new: Deployment) -> list[FieldChange]:
    """Every leaf field that differs between two specs, in a stable order."""
    out: list[FieldChange] = []
    _diff(normalized(old), normalized(new), "", out)
    return out


# Free-form mappings are compared whole: their keys are not spec fields.
_OPAQUE = ("extra_engine_args", "limit_mm_per_prompt", "override_generation_config", "hf_overrides", "adapters",
           "server_args")


def _diff(a: Any, b: Any, prefix: str, out: list[FieldChange]) -> None:
    if isinstance(a, dict) and isinstance(b, dict) and not prefix.endswith(_OPAQUE):
        for key in sorted(set(a) | set(b)):
            _diff(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key, out)
    elif a != b or _fmt(a) != _fmt(b):  # as the hash tells them apart: 1 and 1.0, True and 1
        out.append(FieldChange(prefix, a, b))


def _fmt(value: Any) -> str:
    return "unset" if value is None else json.dumps(value, sort_keys=True)
