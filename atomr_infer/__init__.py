"""atomr-infer: declarative LLM deployments on Ray.

    from atomr_infer import Deployment, load_deployments
    specs = load_deployments("deployments/smollm2.yaml")
"""

from atomr_infer.errors import (
    AtomrError,
    BudgetExceeded,
    CapacityExhausted,
    DeploymentNotFound,
    DeviceUnavailable,
    EngineError,
    InvalidRequest,
    ModelError,
    NoReadyReplica,
    ReplicaUnavailable,
    RequestError,
    SpecError,
)
from atomr_infer.spec import Budget, Deployment, Serving, VllmConfig, load_deployments, spec_hash

__version__ = "0.1.0"

__all__ = [
    "AtomrError",
    "Budget",
    "BudgetExceeded",
    "CapacityExhausted",
    "Deployment",
    "DeploymentNotFound",
    "DeviceUnavailable",
    "EngineError",
    "InvalidRequest",
    "ModelError",
    "NoReadyReplica",
    "ReplicaUnavailable",
    "RequestError",
    "Serving",
    "SpecError",
    "VllmConfig",
    "load_deployments",
    "spec_hash",
]
