"""Fakes for the replica wrapper and the clock (reconcile logic runs without Ray), and for a
replica actor's channel methods over the real ``ChannelHub`` (routing runs without Ray)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ray.exceptions import RayTaskError

from atomr_infer.control.replicas import Poll
from atomr_infer.errors import ReplicaBusy
from atomr_infer.replica.channel import ChannelHub
from atomr_infer.routing.table import ReplicaRoute
from atomr_infer.wire import HttpHead, HttpRequest, RoutingFacts

JSON = (("content-type", "application/json"),)


def request(deployment: str = "d", prompt: str = "hi") -> tuple[RoutingFacts, HttpRequest]:
    """A completions request for ``deployment``: its routing facts and the request itself."""
    import json

    data = {"model": deployment, "prompt": prompt}
    body = json.dumps(data).encode()
    return RoutingFacts.of("/v1/completions", data), HttpRequest("POST", "/v1/completions", JSON, body)


async def text_of(router, deployment: str = "d") -> str:
    """The body a router streamed for a request to ``deployment``, as text."""
    return (await answer(router.stream(*request(deployment))))[1].decode()


async def answer(items) -> tuple[HttpHead, bytes]:
    """The head and the whole body of what a router streamed."""
    head, body = None, b""
    async for item in items:
        if isinstance(item, HttpHead):
            head = item
        else:
            body += item
    return head, body


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class FakeHandle:
    actor_name: str
    spec_model: str
    ready: Poll = field(default_factory=Poll.pending)
    health: Poll = field(default_factory=Poll.success)
    drained: Poll = field(default_factory=Poll.pending)
    stopped: bool = False
    draining: bool = False
    adopted: bool = False
    load: int = 0  # what its health checks say is in flight
    asked: dict | None = None  # the adapters its last health check asked for (each loaded, unless states says)
    retry: int = 0  # the retry count its last health check sent
    states: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)  # more of what its ready() reported (engine facts)
    ready_draining: bool = False
    unplaced: str | None = None  # what waiting_for() says while it starts

    def waiting_for(self):
        return self.unplaced

    def placement(self):
        return {"actor_id": f"id-{self.actor_name}", "node_id": "n0", "gpu_ids": [], "model": self.spec_model,
                **self.facts}

    def poll_ready(self):
        return self.ready

    def poll_health(self, adapters=None, retry=0):
        if self.health.done and self.health.ok:
            self.asked, self.retry = adapters, retry
        return self.health

    def adapters(self):
        return {**dict.fromkeys(self.asked or {}, "loaded"), **self.states}

    def adapters_asked(self, retry=0):
        return self.asked if retry == self.retry else None

    def in_flight(self):
        return self.load

    def begin_drain(self, timeout_s):
        self.draining = True

    def poll_drained(self):
        return self.drained

    def stop(self):
        self.stopped = True

    def answered_draining(self):  # it answered ready() draining (a manager told it, then died)
        return self.ready_draining

    def actor(self):
        return self.actor_name


class FakeLauncher:
    def __init__(self) -> None:
        self.started: list[FakeHandle] = []
        self.fail_next = 0
        self.alive: dict[str, FakeHandle] = {}

    def start(self, deployment, replica_id, peer_nodes=()):
        self.peer_nodes = list(peer_nodes)
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("no resources")
        h = FakeHandle(f"atomr:{deployment.name}:{replica_id}", deployment.model)
        self.started.append(h)
        self.alive[h.actor_name] = h
        return h

    def replica_ids(self, deployment):
        prefix = f"atomr:{deployment}:"
        return [name[len(prefix):] for name, h in self.alive.items() if name.startswith(prefix) and not h.stopped]

    def adopt(self, deployment, replica_id):
        h = self.alive.get(f"atomr:{deployment}:{replica_id}")
        if h is None or h.stopped:  # as Ray's get_actor: a stopped actor's name is free
            return None
        h.adopted = True
        return h

    def make_ready(self) -> None:
        for h in self.started:
            if not h.ready.done:
                h.ready = Poll.success()


class _Remote:
    """A Ray actor method's ``.remote``: an awaitable result (an ``ObjectRef``)."""

    def __init__(self, fn) -> None:
        self._fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self._fn(*args))


class _Refs:
    """A Ray streaming call's ``ObjectRefGenerator``: an async iterator of awaitables."""

    def __init__(self, agen) -> None:
        self._agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self._agen.__anext__()
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(item)
        return fut


class _RemoteStream(_Remote):
    def remote(self, *args):
        return _Refs(self._fn(*args))


class FakeManager:
    """The one fake of the ``DeploymentManager``, for every tier that has no Ray: its messages
    as a Ray handle exposes them (``routing_table.remote``, ``report_demand.remote``), over a
    table ``source`` (``source(since_version)``), and ``apply`` as ``ControlPlane`` calls it
    (records each spec; the generation rises when its hash changes). ``lag_long_polls``: a long
    poll (``timeout_s > 0``) never answers, while a direct ask does at once."""

    def __init__(self, source=None, lag_long_polls: bool = False) -> None:
        self._source, self._lag = source, lag_long_polls
        self.asked = 0  # routing-table asks answered
        self.applied: list = []
        self.hashes: dict[str, str] = {}
        self.generation = 0
        self.routing_table = _Remote(self._routing_table)
        self.report_demand = _Remote(self._report_demand)

    async def _routing_table(self, since_version, timeout_s: float = 0.0):
        if timeout_s > 0 and self._lag:
            await asyncio.Event().wait()
        self.asked += 1
        return await self._source(since_version)

    async def _report_demand(self, *report):
        return None

    def apply(self, spec):
        from types import SimpleNamespace

        from atomr_infer.spec import spec_hash

        self.applied.append(spec)
        changed = self.hashes.get(spec.name) != spec_hash(spec)
        if changed:
            self.hashes[spec.name] = spec_hash(spec)
            self.generation += 1
        return SimpleNamespace(name=spec.name, changed=changed, generation=self.generation, actions=[])


class FakeReplica:
    """A replica's channel methods (open_many, channel, cancel) over the real ``ChannelHub``; each
    request answers a head and one body piece naming the replica, or every call fails with
    ``error``, as Ray raises it for a dead,
    unreachable or (a task error) draining replica."""

    def __init__(self, name: str, error: BaseException | None = None) -> None:
        self.name, self.error, self.calls = name, error, 0
        self.hub = ChannelHub()
        self.channel, self.cancel = _RemoteStream(self._channel), _Remote(self._cancel)
        self.keepalive, self.open_many = _Remote(self._keepalive), _Remote(self._open_many)

    async def _open_many(self, channel_id, requests):
        """As the replica's: a dead or unreachable replica fails the call; one that refuses a
        request (draining: a task error) answers that request with its own error."""
        if self.error is not None and not isinstance(self.error, RayTaskError):
            self.calls += 1
            raise self.error
        results = []
        for opening in requests:
            try:
                results.append(await self._open(channel_id, opening))
            except RayTaskError as exc:
                results.append(exc.cause)
            except ReplicaBusy as exc:  # as the replica's: at its limit
                results.append(exc)
        return results

    async def _open(self, channel_id, opening):
        self.calls += 1
        if self.error is not None:
            raise self.error
        return self.hub.open(self.hub.get(channel_id), opening, self._serve, opening.limit or 1 << 30, self.name)

    async def _serve(self, request, put, tokens, resume=None, prefilled=None):
        await self._answer(put)

    async def _answer(self, put):
        put(HttpHead(200, JSON))
        put(f"from {self.name}".encode())

    async def _channel(self, channel_id):
        if self.error is not None and not isinstance(self.error, RayTaskError):
            raise self.error  # a dead actor fails every call; a draining one streams
        async for batch in self.hub.stream(channel_id):
            yield batch

    async def _cancel(self, channel_id, request_ids):
        self.hub.cancel(channel_id, request_ids)

    async def _keepalive(self, channel_id):
        self.hub.get(channel_id)


def route(replica: FakeReplica) -> ReplicaRoute:
    return ReplicaRoute(replica.name, f"atomr:d:{replica.name}", replica)


class GatedReplica(FakeReplica):
    """Answers once ``gate`` is set: a request in flight while the table changes."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.gate = asyncio.Event()

    async def _answer(self, put):
        await self.gate.wait()
        await super()._answer(put)
