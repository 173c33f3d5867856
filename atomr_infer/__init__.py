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
    NoCluster,
    NoReadyReplica,
    ReplicaUnavailable,
    RequestError,
    ResponseNotFound,
    RouterClosed,
    RoutingError,
    SpecError,
)
from atomr_infer.spec import Budget, Deployment, Serving, VllmConfig, load_deployments, spec_hash
from atomr_infer.status import DeploymentState, DeploymentStatus, ReplicaState, ReplicaStatus


def control_plane(address: str | None = None, start: bool = True):  # noqa: ANN201 - lazy: no Ray at import
    """The manager's typed client, ``ControlPlane`` (connecting to / starting Ray and the manager
    as needed): ``apply``, ``plan``, ``remove``, ``status``, ``list``, ``wait_ready``, each raising
    atomr's own errors."""
    from atomr_infer.control.client import ControlPlane

    return ControlPlane.connect(address, start)


def manager(address: str | None = None, start: bool = True):  # noqa: ANN201 - a Ray actor handle
    """The ``DeploymentManager`` actor handle (connecting to / starting Ray as needed), for
    Ray object refs; ``control_plane()`` is the same manager with plain calls and typed errors."""
    from atomr_infer.control.client import manager_handle

    return manager_handle(address, start)


def __getattr__(name: str):  # noqa: ANN202 - lazy: importing atomr_infer must not import Ray
    if name == "Client":
        from atomr_infer.client import Client

        return Client
    if name == "ControlPlane":
        from atomr_infer.control.client import ControlPlane

        return ControlPlane
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
    "ControlPlane",
    "Deployment",
    "DeploymentManager",
    "DeploymentNotFound",
    "DeploymentState",
    "DeploymentStatus",
    "DeviceUnavailable",
    "EngineError",
    "InvalidRequest",
    "ModelError",
    "NoCluster",
    "NoReadyReplica",
    "PlanResult",
    "ReplicaState",
    "ReplicaStatus",
    "ReplicaUnavailable",
    "RequestError",
    "ResponseNotFound",
    "RouterClosed",
    "RoutingError",
    "Serving",
    "SpecError",
    "VllmConfig",
    "control_plane",
    "load_deployments",
    "manager",
    "spec_hash",
]
