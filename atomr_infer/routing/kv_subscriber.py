"""Listen to every replica's KV-cache events and keep each deployment's ``KvIndex``.

One thread per process (``hub()``), shared by every router in it (the ingress's and a
``Client``'s alike): one ZMQ SUB socket per replica, connected to the endpoint the replica
bound on its node's address (engine/vllm/kv_events.py), and one DEALER to its replay endpoint.

vLLM numbers its batches. A follower first asks for a replay from 0 (vLLM keeps its last
``buffer_steps`` batches) while it buffers what the SUB socket brings, then applies the rest in
order. A gap (ZMQ drops when a subscriber falls behind its high-water mark) asks for a replay
from the first missing batch. If the replay no longer reaches back that far the replica's
entries are dropped and rebuilt from what the replay has: blocks stored before it are unknown
(routing misses them) but none that was evicted meanwhile is believed held (routing would send
requests to a replica that must recompute them).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from atomr_infer.log import get_logger
from atomr_infer.routing.kv_index import KvIndex, decode_batch

log = get_logger(__name__)
END_SEQ = b"\xff" * 8  # vLLM's end-of-replay marker
REPLAY_TIMEOUT_S = 2.0  # a replay that does not end by then is given up (what came is kept)
POLL_MS = 20


@dataclass
class _Follower:
    deployment: str
    replica: str
    endpoint: str
    replay_endpoint: str | None
    sub: Any = None
    dealer: Any = None
    last: int = -1  # the sequence number of the last batch applied
    replaying_since: float | None = None  # a replay asked for and not yet ended
    replay_from: int = 0
    replay_first: int | None = None
    held: list[tuple[int, bytes]] = field(default_factory=list)  # SUB batches while replaying


class KvEventsHub:
    """The process's KV-event listener: ``follow`` replicas, read ``index(deployment)``."""

    def __init__(self) -> None:
        self._indexes: dict[str, KvIndex] = {}
        self._followers: dict[str, _Follower] = {}  # replica -> its follower (touched by the thread only)
        self._wanted: dict[str, dict[str, tuple[str, str | None]]] = {}  # deployment -> replica -> endpoints
        self._changes: queue.SimpleQueue[tuple[str, dict[str, tuple[str, str | None]]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.gaps = 0  # batches found missing (each asks for a replay)
        self.partial = 0  # replays that did not reach back far enough (entries rebuilt)

    def index(self, deployment: str) -> KvIndex:
        with self._lock:
            return self._indexes.setdefault(deployment, KvIndex())

    def follow(self, deployment: str, replicas: dict[str, tuple[str, str | None]]) -> None:
        """Listen to exactly these replicas of ``deployment`` (name -> (endpoint, replay endpoint));
        a replica no longer named is dropped from the index. Cheap when nothing changed."""
        if self._wanted.get(deployment) == replicas:
            return
        self._wanted[deployment] = dict(replicas)
        self._changes.put((deployment, dict(replicas)))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="atomr-kv-events", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        import zmq

        context = zmq.Context.instance()
        poller = zmq.Poller()
        by_socket: dict[Any, _Follower] = {}
        while True:
            while not self._changes.empty():
                self._apply_change(*self._changes.get(), context, poller, by_socket)
            try:
                ready = dict(poller.poll(POLL_MS)) if by_socket else {}
            except zmq.ZMQError:
                ready = {}
            if not by_socket:
                time.sleep(POLL_MS / 1000)
            for sock in ready:
                follower = by_socket.get(sock)
                if follower is None:
                    continue
                try:
                    if sock is follower.sub:
                        self._on_sub(follower, sock.recv_multipart(zmq.NOBLOCK))
                    else:
                        self._on_replay(follower, sock.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    pass
                except Exception as exc:  # noqa: BLE001 - one bad message must not stop the listener
                    log.warning("kv_event_failed", replica=follower.replica, error=f"{type(exc).__name__}: {exc}")
            now = time.monotonic()
            for follower in self._followers.values():
                if follower.replaying_since is not None and now - follower.replaying_since > REPLAY_TIMEOUT_S:
                    self._end_replay(follower)

    def _apply_change(self, deployment: str, replicas: dict[str, tuple[str, str | None]], context: Any,
                      poller: Any, by_socket: dict[Any, _Follower]) -> None:
        import zmq

        index = self.index(deployment)
        for name, follower in list(self._followers.items()):
            same = replicas.get(name) == (follower.endpoint, follower.replay_endpoint)
            if follower.deployment == deployment and not same:
                for sock in (follower.sub, follower.dealer):
                    if sock is not None:
                        poller.unregister(sock)
                        by_socket.pop(sock, None)
                        sock.close(linger=0)
                del self._followers[name]
                index.drop(name)
        for name, (endpoint, replay) in replicas.items():
            if name in self._followers:
                continue
            follower = self._followers[name] = _Follower(deployment, name, endpoint, replay)
            follower.sub = context.socket(zmq.SUB)
            follower.sub.setsockopt(zmq.SUBSCRIBE, b"")
            follower.sub.connect(endpoint)
            poller.register(follower.sub, zmq.POLLIN)
            by_socket[follower.sub] = follower
            if replay is not None:
                follower.dealer = context.socket(zmq.DEALER)
                follower.dealer.connect(replay)
                poller.register(follower.dealer, zmq.POLLIN)
                by_socket[follower.dealer] = follower
                self._ask_replay(follower, 0)
            log.info("kv_events_following", deployment=deployment, replica=name, endpoint=endpoint)

    def _ask_replay(self, follower: _Follower, start: int) -> None:
        follower.replaying_since, follower.replay_from, follower.replay_first = time.monotonic(), start, None
        follower.dealer.send_multipart([b"", start.to_bytes(8, "big")])

    def _on_sub(self, follower: _Follower, frames: list[bytes]) -> None:
        seq, payload = int.from_bytes(frames[1], "big"), frames[2]
        if follower.replaying_since is not None:
            follower.held.append((seq, payload))
            return
        if seq <= follower.last:
            return
        if follower.last >= 0 and seq > follower.last + 1:
            self.gaps += 1
            if follower.dealer is not None:
                follower.held.append((seq, payload))
                self._ask_replay(follower, follower.last + 1)
                return
            self.index(follower.deployment).drop(follower.replica)  # no replay: start afresh
        self._apply(follower, seq, payload)

    def _on_replay(self, follower: _Follower, frames: list[bytes]) -> None:
        if len(frames) < 4 or frames[2] == END_SEQ or not frames[3]:
            self._end_replay(follower)
            return
        seq = int.from_bytes(frames[2], "big")
        if follower.replay_first is None:
            follower.replay_first = seq
            if seq > follower.replay_from and follower.last >= 0:  # the buffer no longer reaches back
                self.partial += 1
                self.index(follower.deployment).drop(follower.replica)
        if seq > follower.last:
            self._apply(follower, seq, frames[3])

    def _end_replay(self, follower: _Follower) -> None:
        """Apply what came meanwhile; a batch still missing is lost for good (the replay just
        tried for it): rebuild from here, as after a partial replay."""
        follower.replaying_since = None
        held, follower.held = sorted(follower.held), []
        for seq, payload in held:
            if seq <= follower.last:
                continue
            if follower.last >= 0 and seq > follower.last + 1:
                self.partial += 1
                self.index(follower.deployment).drop(follower.replica)
            self._apply(follower, seq, payload)

    def _apply(self, follower: _Follower, seq: int, payload: bytes) -> None:
        self.index(follower.deployment).apply(follower.replica, decode_batch(payload))
        follower.last = seq


_HUB: KvEventsHub | None = None
_HUB_LOCK = threading.Lock()


def hub() -> KvEventsHub:
    """This process's listener (started on first use)."""
    global _HUB
    with _HUB_LOCK:
        if _HUB is None:
            _HUB = KvEventsHub()
        return _HUB
