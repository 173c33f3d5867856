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


def manager(address: str | None = None, start: bool = True):  # noqa: ANN201 - a Ray actor handle
    """The ``DeploymentManager`` actor handle (connecting to / starting Ray as needed)."""
    from atomr_infer.cluster import manager as _manager

    return _manager(address, start)


def __getattr__(name: str):  # noqa: ANN202 - lazy: importing atomr_infer must not import Ray
    if name == "Client":
        from atomr_infer.client import Client

        return Client
    if name in ("ApplyResult", "PlanResult", "DeploymentManager"):
        from atomr_infer.control import manager as _m

        return getattr(_m, name)
    raise AttributeError(name)

__version__ = "0.1.0"

__all__ = [
    "ApplyResult",
    "AtomrError",
    "Budget",
    "BudgetExceeded",
    "CapacityExhausted",
    "Client",
    "Deployment",
    "DeploymentManager",
    "DeploymentNotFound",
    "DeviceUnavailable",
    "EngineError",
    "InvalidRequest",
    "ModelError",
    "NoReadyReplica",
    "PlanResult",
    "ReplicaUnavailable",
    "RequestError",
    "Serving",
    "SpecError",
    "VllmConfig",
    "load_deployments",
    "manager",
    "spec_hash",
]
