"""The Ray side of the replica wrapper: create, poll, drain and stop ``VllmReplica`` actors.

Every call returns at once. Object refs are turned into futures and checked with ``done()``,
so the manager's reconcile pass never waits on a replica.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from atomr_infer.cluster import NAMESPACE
from atomr_infer.control.placement import node_hint
from atomr_infer.control.replicas import Poll
from atomr_infer.engine.cpu import cpu_reservation
from atomr_infer.errors import EngineStartFailed
from atomr_infer.log import get_logger
from atomr_infer.replica import replica_actor_class
from atomr_infer.replica_calls import ReplicaCalls, replica_failure
from atomr_infer.spec import Deployment
from atomr_infer.status import ReplicaState

log = get_logger(__name__)


def actor_name(deployment: str, replica_id: str) -> str:
    return f"atomr:{deployment}:{replica_id}"


def _poll(fut: Future[Any] | None) -> tuple[Poll, Any]:
    if fut is None or not fut.done():
        return Poll.pending(), None
    try:
        return Poll.success(), fut.result()
    except Exception as exc:  # noqa: BLE001 - any failure is the replica's
        failure = replica_failure(exc)  # replica_calls.py: the one translation
        recurring = isinstance(failure.cause, EngineStartFailed) and failure.cause.recurring
        return Poll.failed(failure.reason, recurring), None


Asked = tuple[dict[str, str] | None, int]  # a health check's LoRA adapters, and its retry count
UNPLACED_AFTER_S = 30.0  # a replica Ray has not placed this long is said to wait for resources
UNPLACED_CHECK_S = 10.0  # how often Ray is asked (one GCS read), while it waits


class RayReplicaHandle:
    def __init__(
        self, actor: Any, name: str, reaper: Reaper, pg: Any = None, adopted: bool = False, node: str | None = None,
        asks: dict[str, float] | None = None,
    ) -> None:
        self.actor_name = name
        self._asks = asks or {}  # the resources it was created with (unknown when adopted)
        self._created_at, self._checked_at, self._unplaced = time.monotonic(), 0.0, False
        self._node = node  # where it was sent, until it says where it runs
        self._actor, self._pg, self._reaper = actor, pg, reaper
        self._calls = ReplicaCalls(actor)
        self._ready: Future[Any] | None = self._calls.ready().future()
        self._health: Future[Any] | None = None
        self._drain: Future[Any] | None = None
        self._info: dict[str, Any] = {}
        self._in_flight = 0
        self._adapters: dict[str, str] = {}  # LoRA adapter -> its state, as of the last health check
        # (sent, answered): the adapters a health check asked for, with the retry count it sent
        self._asked: tuple[Asked | None, Asked | None] = (None, None)
        self.adopted = adopted

    def actor(self) -> Any:
        return self._actor

    def waiting_for(self) -> str | None:
        """Why it has not started, where Ray says: no node has had the resources it asked for
        free since it was created (Ray places it once one has; Ray Serve warns likewise)."""
        now = time.monotonic()
        if self._ready is None or self._ready.done() or now - self._created_at < UNPLACED_AFTER_S:
            return None
        if now - self._checked_at >= UNPLACED_CHECK_S:
            self._checked_at = now
            with contextlib.suppress(Exception):  # Ray's actor table (a developer API): unreadable, unsaid
                info = ray._private.state.actors(actor_id=self._actor._actor_id.hex())  # noqa: SLF001
                self._unplaced = info.get("State") in ("PENDING_CREATION", "DEPENDENCIES_UNREADY")
        if not self._unplaced:
            return None
        asks = ", ".join(f"{v:g} {k}" for k, v in self._asks.items() if v) or "its resources"
        return (f"not placed by Ray for {now - self._created_at:.0f}s: no node has {asks} free "
                "(it starts once one has: free some, or add a node)")

    def placement(self) -> dict[str, Any]:
        return {
            "actor_id": self._actor._actor_id.hex(),
            "node_id": self._info.get("node_id") or self._node,
            "gpu_ids": self._info.get("gpu_ids", []),
            "device": self._info.get("device"),
            "dtype": self._info.get("dtype"),
            "kv_cache_bytes": self._info.get("kv_cache_bytes"),
            "kv_cache_tokens": self._info.get("kv_cache_tokens"),
            "routes": tuple(self._info.get("routes") or ()),
            "kv_events": self._info.get("kv_events"),
            "model": self._info.get("model"),  # the spec's model it was started with
            "max_model_len": self._info.get("max_model_len"),
            "parses_output": bool(self._info.get("parses_output")),
        }

    def poll_ready(self) -> Poll:
        poll, info = _poll(self._ready)
        if poll.done and poll.ok:
            self._info = info or {}
        return poll

    def poll_health(self, adapters: dict[str, str] | None = None, retry: int = 0) -> Poll:
        if self._health is None:
            self._health = self._calls.health(adapters, retry).future()
            self._asked = ((adapters, retry), self._asked[1])
            return Poll.pending()
        poll, info = _poll(self._health)
        if poll.done:
            self._health = None
            if poll.ok and info is not None:  # a ReplicaHealth (replica/lifecycle.py)
                self._in_flight = info.in_flight
                self._adapters = dict(info.adapters)
                self._asked = (self._asked[0], self._asked[0])
        return poll

    def adapters(self) -> dict[str, str]:
        return self._adapters

    def adapters_asked(self, retry: int = 0) -> dict[str, str] | None:
        answered = self._asked[1]
        return answered[0] if answered is not None and answered[1] == retry else None

    def in_flight(self) -> int:
        return self._in_flight

    def answered_draining(self) -> bool:
        return self._info.get("state") in (ReplicaState.DRAINING.value, ReplicaState.STOPPED.value)

    def begin_drain(self, timeout_s: float) -> None:
        self._drain = self._calls.drain(timeout_s).future()

    def poll_drained(self) -> Poll:
        poll, _ = _poll(self._drain)
        return poll

    def stop(self) -> None:
        # Graceful first: shutdown() frees the engine's processes; the reaper kills the actor
        # once that returned, or after a grace period if it hangs.
        try:
            done: Future[Any] | None = self._calls.shutdown().future()
        except Exception:  # noqa: BLE001 - already dead is fine
            done = None
        self._reaper.schedule(self._actor, self._pg, done)


class Reaper:
    """Kills stopped replica actors (and frees their placement groups) without waiting on them."""

    GRACE_S = 30.0

    def __init__(self) -> None:
        self._pending: list[tuple[float, Any, Any, Future[Any] | None]] = []

    def schedule(self, actor: Any, pg: Any, shutdown_done: Future[Any] | None) -> None:
        self._pending.append((time.monotonic() + self.GRACE_S, actor, pg, shutdown_done))

    def reap(self) -> None:
        now = time.monotonic()
        keep = []
        for deadline, actor, pg, done in self._pending:
            if done is not None and not done.done() and now < deadline:
                keep.append((deadline, actor, pg, done))
                continue
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)
            if pg is not None:
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
        self._pending = keep

    def __len__(self) -> int:
        return len(self._pending)


class RayReplicaLauncher:
    def __init__(
        self,
        uses_gpus: Callable[[Deployment], bool],
        replica_kwargs: dict[str, Any] | None = None,
        actor_options: dict[str, Any] | None = None,
    ) -> None:
        # uses_gpus(spec): decided from the cluster (device auto + GPUs present).
        self._uses_gpus = uses_gpus
        # Extra VllmReplica arguments (backend, step_timeout_s): another engine backend plugs in here.
        self._replica_kwargs = replica_kwargs or {}
        # Extra Ray actor options of every replica (a runtime_env with the engine's environment).
        self._actor_options = actor_options or {}
        self.reaper = Reaper()

    def start(self, deployment: Deployment, replica_id: str, peer_nodes: Sequence[str] = ()) -> RayReplicaHandle:
        name = actor_name(deployment.name, replica_id)
        options: dict[str, Any] = {
            "name": name,
            "namespace": NAMESPACE,
            "lifetime": "detached",  # replicas outlive a manager restart and are re-adopted
            "max_concurrency": 10_000,
            "max_restarts": 0,  # the manager replaces failed replicas, with backoff
            **self._actor_options,
        }
        if self._uses_gpus(deployment):
            # Tensor parallel inside the one actor: Ray gives it all its GPUs on one node, and vLLM
            # runs a worker process per GPU (engine_args: the "mp" executor). No placement group:
            # in one, vLLM picks its Ray executor, which refuses a bundle of several GPUs and would
            # wait for GPUs this actor already holds (Ray Serve LLM instead gives the actor none).
            need = {"GPU": float(deployment.gpus), "CPU": 1.0}
            node = node_hint(deployment.placement, need, peer_nodes)
            if node is not None:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
            options.update(num_gpus=deployment.gpus, num_cpus=1)
        else:
            cpus = cpu_reservation(deployment)
            node = node_hint(deployment.placement, {"CPU": float(cpus)}, peer_nodes)
            if node is not None:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
            options.update(num_gpus=0, num_cpus=cpus)
        actor = replica_actor_class().options(**options).remote(
            deployment.model_dump(mode="json"), replica_id, **self._replica_kwargs
        )
        log.info("replica_actor_created", deployment=deployment.name, replica=replica_id, actor=name, node=node)
        asks = {"GPU": float(options["num_gpus"]), "CPU": float(options["num_cpus"])}
        return RayReplicaHandle(actor, name, self.reaper, node=node, asks=asks)

    def replica_ids(self, deployment: str) -> list[str]:
        prefix = actor_name(deployment, "")
        named = ray.util.list_named_actors(all_namespaces=True)
        return [a["name"][len(prefix):] for a in named if a["namespace"] == NAMESPACE and a["name"].startswith(prefix)]

    def adopt(self, deployment: str, replica_id: str) -> RayReplicaHandle | None:
        name = actor_name(deployment, replica_id)
        try:
            actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return None
        try:  # one started (tensor parallel) by an earlier atomr in a group named as it: freed with it
            pg = ray.util.get_placement_group(name)
        except ValueError:
            pg = None
        return RayReplicaHandle(actor, name, self.reaper, pg, adopted=True)
