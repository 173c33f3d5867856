"""The control plane from outside the manager: get (or create) the manager actor, and call it
with atomr's own errors rather than Ray's wrappers.

    import atomr_infer
    cp = atomr_infer.control_plane()   # joins the local head (or RAY_ADDRESS); starts one if none runs
    cp.apply(spec)                     # ApplyResult; SpecError, BudgetExceeded... raised as themselves

Used by the CLI, ``atomr serve``, the ``Client`` and the tests; ``atomr_infer.manager()`` still
returns the raw actor handle for code that wants Ray's object refs.
"""

from __future__ import annotations

from typing import Any

from atomr_infer.cluster import MANAGER_NAME, NAMESPACE, connect
from atomr_infer.control.manager import DeploymentManager
from atomr_infer.control.placement import on_head_node
from atomr_infer.control.plan import ApplyResult, PlanResult
from atomr_infer.errors import AtomrError, DeploymentNotFound, NoReadyReplica, one_line, unwrap
from atomr_infer.routing.table import RoutingTable
from atomr_infer.spec import Deployment
from atomr_infer.status import DeploymentStatus, ReplicaState

CALL_TIMEOUT_S = 60.0


class ManagerRestarting(AtomrError):
    """Ray is restarting the manager (``max_restarts=-1``): the same call may succeed shortly."""

    retryable = True


def manager_handle(address: str | None = None, start: bool = True) -> Any:
    """The ``DeploymentManager`` actor handle, created (detached, restartable) if absent."""
    import ray

    connect(address, start=start)
    try:
        return ray.get_actor(MANAGER_NAME, namespace=NAMESPACE)
    except ValueError:
        if not start:
            raise AtomrError("the atomr manager is not running (hint: `atomr up` or `atomr deploy FILE`)") from None
    handle = ray.remote(DeploymentManager).options(**manager_options()).remote()
    ray.get(handle.ping.remote())
    return handle


def manager_options(name: str = MANAGER_NAME) -> dict[str, Any]:
    """How the manager actor runs (tests create private managers with the same options)."""
    return {
        "name": name,
        "namespace": NAMESPACE,
        "lifetime": "detached",
        "get_if_exists": True,  # two CLIs racing to create it get the same actor
        "max_restarts": -1,  # a crashed manager comes back and re-adopts replicas
        "max_task_retries": 0,
        "num_cpus": 0,
        "max_concurrency": 1000,
        # On the head: it lives as long as the cluster (a worker node may go away with the manager).
        **on_head_node(),
    }


def call(ref: Any, timeout_s: float | None = CALL_TIMEOUT_S) -> Any:
    """``ray.get`` of a manager call that raises the atomr error the manager raised."""
    import ray
    from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

    try:
        return ray.get(ref, timeout=timeout_s)
    except RayTaskError as exc:
        cause = unwrap(exc)
        if isinstance(cause, AtomrError):
            raise cause from None
        raise AtomrError(one_line(cause)) from None
    except ActorUnavailableError:  # a RayActorError too: first (Ray's text: `--debug`)
        raise ManagerRestarting("the atomr manager is restarting; try again shortly") from None
    except RayActorError as exc:
        raise AtomrError(f"the atomr manager died: {one_line(exc)} (hint: `atomr up` restarts it)") from None
    except GetTimeoutError:
        raise AtomrError(f"the atomr manager did not answer within {timeout_s:g}s") from None


class ControlPlane:
    """The manager's messages as blocking calls; each raises atomr's own errors."""

    def __init__(self, handle: Any, timeout_s: float | None = CALL_TIMEOUT_S) -> None:
        self.handle = handle  # the actor handle, for Ray object refs (``handle.apply.remote``)
        self._timeout_s = timeout_s

    @classmethod
    def connect(cls, address: str | None = None, start: bool = True) -> ControlPlane:
        return cls(manager_handle(address, start))

    def apply(self, spec: Deployment | dict[str, Any]) -> ApplyResult:
        """Record ``spec`` as desired; idempotent. Returns at once: ``wait_ready`` waits.

        Checked before anything runs, by the manager: the spec's fields, names, budgets, and
        its vLLM settings (``extra_engine_args`` keys, parser names) against the vLLM installed
        on the manager's node, read from vLLM's source without importing it
        (engine/vllm/spec_check.py). Where that node has no vLLM, each replica checks them with
        vLLM before its engine starts, and the deployment's status names the field."""
        return call(self.handle.apply.remote(spec), self._timeout_s)

    def plan(self, spec: Deployment | dict[str, Any], alongside: tuple[Any, ...] = ()) -> PlanResult:
        """What ``apply`` would do and the budget verdict, with the specs of ``alongside`` counted
        as applied first; changes nothing."""
        return call(self.handle.plan.remote(spec, alongside), self._timeout_s)

    def remove(self, name: str) -> ApplyResult:
        return call(self.handle.remove.remote(name), self._timeout_s)

    def status(self, name: str) -> DeploymentStatus | None:
        return call(self.handle.status.remote(name), self._timeout_s)

    def list(self) -> list[DeploymentStatus]:
        return call(self.handle.list.remote(), self._timeout_s)

    def routing_table(self) -> RoutingTable | None:
        """The table routers route by (None while a restarted manager recovers)."""
        return call(self.handle.routing_table.remote(), self._timeout_s)

    def reset_prefix_cache(self, name: str, reset_running_requests: bool = False) -> dict[str, str]:
        """Reset the prefix (KV) cache of every ready replica of ``name``, as vLLM's operator
        route ``/reset_prefix_cache`` does on one server (atomr's API does not serve it): replica
        id -> ``reset``, ``busy`` (running requests held cached blocks; ``reset_running_requests``
        preempts them and resets anyway) or ``failed: <why>``."""
        import ray

        status = self.status(name)
        if status is None:
            raise DeploymentNotFound(name, [s.name for s in self.list()])
        ready = [r for r in status.replicas if r.state == ReplicaState.READY]
        if not ready:
            raise NoReadyReplica(name)
        calls: dict[str, Any] = {}
        outcome = {}
        for r in ready:  # a replica gone since the status (its name no longer found) is its line too
            try:
                actor = ray.get_actor(r.actor_name, namespace=NAMESPACE)
                calls[r.replica_id] = actor.reset_prefix_cache.remote(reset_running_requests)
            except Exception as exc:  # noqa: BLE001
                outcome[r.replica_id] = f"failed: {one_line(unwrap(exc))}"
        for replica_id, ref in calls.items():
            try:
                outcome[replica_id] = "reset" if ray.get(ref, timeout=self._timeout_s) else "busy"
            except Exception as exc:  # noqa: BLE001 - one replica's failure is its line, not the call's
                outcome[replica_id] = f"failed: {one_line(unwrap(exc))}"
        return {r.replica_id: outcome[r.replica_id] for r in ready}

    def wait_ready(self, name: str, timeout_s: float = 600.0) -> DeploymentStatus | None:
        """The status once ``name`` has converged or failed (``status.failed``: nothing more
        starts until an apply; ``last_failure`` says why), or after ``timeout_s`` (None: no such
        deployment)."""
        return call(self.handle.wait_ready.remote(name, timeout_s), timeout_s + (self._timeout_s or 0))
