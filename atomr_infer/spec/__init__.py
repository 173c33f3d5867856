"""Deployment specs: the models, loading from YAML/dicts, and the canonical hash."""

from atomr_infer.spec.deployment import Autoscaling, Budget, Deployment, Routing, VllmConfig
from atomr_infer.spec.hashing import (
    FieldChange,
    normalized,
    restarts_replicas,
    runtime_fields,
    spec_changes,
    spec_hash,
)
from atomr_infer.spec.loading import load_deployments, parse_deployment
from atomr_infer.spec.serving import OpenAIServing, Serving

__all__ = [
    "Autoscaling",
    "Routing",
    "OpenAIServing",
    "restarts_replicas",
    "runtime_fields",
    "Budget",
    "Deployment",
    "FieldChange",
    "Serving",
    "VllmConfig",
    "load_deployments",
    "normalized",
    "parse_deployment",
    "spec_changes",
    "spec_hash",
]
