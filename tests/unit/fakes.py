"""Fakes for the replica wrapper and the clock: reconcile logic runs without Ray."""

from __future__ import annotations

from dataclasses import dataclass, field

from atomr_infer.control.replicas import Poll


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

    def placement(self):
        return {"actor_id": f"id-{self.actor_name}", "node_id": "n0", "gpu_ids": []}

    def poll_ready(self):
        return self.ready

    def poll_health(self):
        return self.health

    def in_flight(self):
        return 0

    def begin_drain(self, timeout_s):
        self.draining = True

    def poll_drained(self):
        return self.drained

    def stop(self):
        self.stopped = True

    def actor(self):
        return self.actor_name


class FakeLauncher:
    def __init__(self) -> None:
        self.started: list[FakeHandle] = []
        self.fail_next = 0
        self.alive: dict[str, FakeHandle] = {}

    def start(self, deployment, replica_id):
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("no resources")
        h = FakeHandle(f"atomr:{deployment.name}:{replica_id}", deployment.model)
        self.started.append(h)
        self.alive[h.actor_name] = h
        return h

    def adopt(self, deployment, replica_id):
        h = self.alive.get(f"atomr:{deployment.name}:{replica_id}")
        if h is not None:
            h.adopted = True
        return h

    def make_ready(self) -> None:
        for h in self.started:
            if not h.ready.done:
                h.ready = Poll.success()
