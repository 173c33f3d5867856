"""Listen to every replica's KV-cache events and keep each deployment's ``KvIndex``.

One thread per process (``hub()``), shared by every router in it (the ingress's and a
``Client``'s alike): one ZMQ SUB socket per replica, connected to the endpoint the replica
bound on its node's address (engine/vllm/kv_events.py), and one DEALER to its replay endpoint.

vLLM numbers its batches. A follower first asks for a replay from 0 (vLLM keeps its last
``buffer_steps`` batches) while it buffers what the SUB socket brings, then applies the rest in
order. A gap (ZMQ drops when a subscriber falls behind its high-water mark) asks for a replay
from the first missing batch (a new DEALER per replay, so a late answer to an old one is never
taken for the next). A batch the replay no longer has (vLLM keeps ``buffer_steps``), or that a
replay itself dropped, is lost for good: the replica's entries are dropped and rebuilt from what
follows. Blocks stored before are then unknown (routing misses them), but none that was evicted
meanwhile is believed held (routing would send requests to a replica that must recompute them).
"""

from __future__ import annotations

import contextlib
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
    dealer: Any = None  # a new one for each replay: a late answer to an old one cannot end the next
    last: int = -1  # the sequence number of the last batch applied
    replaying_since: float | None = None  # a replay asked for and not yet ended
    replay_from: int = 0
    retried: bool = False  # a gap after a replay asked again once before it counts as lost
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
        self._context: Any = None
        self._poller: Any = None
        self._by_socket: dict[Any, _Follower] = {}  # (the thread's own)
        self.gaps = 0  # batches found missing (each asks for a replay)
        self.partial = 0  # batches lost for good (the replica's entries rebuilt from what followed)

    def index(self, deployment: str) -> KvIndex:
        with self._lock:
            return self._indexes.setdefault(deployment, KvIndex())

    def follow(self, deployment: str, replicas: dict[str, tuple[str, str | None]]) -> None:
        """Listen to exactly these replicas of ``deployment`` (name -> (endpoint, replay endpoint));
        a replica no longer named is dropped from the index, and an empty map forgets the
        deployment. Cheap when nothing changed."""
        if self._wanted.get(deployment) == replicas:
            return
        self._wanted[deployment] = dict(replicas)
        self._changes.put((deployment, dict(replicas)))
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="atomr-kv-events", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        import zmq

        if self._context is None:
            self._context, self._poller = zmq.Context.instance(), zmq.Poller()
        while True:
            while not self._changes.empty():
                deployment, replicas = self._changes.get()
                try:
                    self._apply_change(deployment, replicas)
                except Exception as exc:  # noqa: BLE001 - a bad endpoint must not stop the listener
                    log.warning("kv_events_follow_failed", deployment=deployment, error=f"{type(exc).__name__}: {exc}")
            try:
                ready = dict(self._poller.poll(POLL_MS)) if self._by_socket else {}
            except zmq.ZMQError:
                ready = {}
            if not self._by_socket:
                time.sleep(POLL_MS / 1000)
            for sock in ready:
                follower = self._by_socket.get(sock)
                try:
                    if follower is None:
                        continue
                    if sock is follower.sub:
                        self._on_sub(follower, sock.recv_multipart(zmq.NOBLOCK))
                    elif sock is follower.dealer:
                        self._on_replay(follower, sock.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    pass
                except Exception as exc:  # noqa: BLE001 - one bad message must not stop the listener
                    log.warning("kv_event_failed", replica=follower.replica, error=f"{type(exc).__name__}: {exc}")
            now = time.monotonic()
            for follower in list(self._followers.values()):
                if follower.replaying_since is not None and now - follower.replaying_since > REPLAY_TIMEOUT_S:
                    try:
                        self._end_replay(follower)
                    except Exception as exc:  # noqa: BLE001
                        log.warning("kv_event_failed", replica=follower.replica, error=f"{type(exc).__name__}: {exc}")

    def _socket(self, kind: int, endpoint: str, follower: _Follower) -> Any:
        import zmq

        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)  # a replica gone for good: retried every 5 s, not 0.1
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        else:
            sock.setsockopt(zmq.RCVHWM, 0)  # a replay comes all at once: keep all of it
        sock.connect(endpoint)
        self._poller.register(sock, zmq.POLLIN)
        self._by_socket[sock] = follower
        return sock

    def _close(self, sock: Any) -> None:
        if sock is not None:
            self._poller.unregister(sock)
            self._by_socket.pop(sock, None)
            sock.close(linger=0)

    def _apply_change(self, deployment: str, replicas: dict[str, tuple[str, str | None]]) -> None:
        import zmq

        index = self.index(deployment)
        for name, follower in list(self._followers.items()):
            same = replicas.get(name) == (follower.endpoint, follower.replay_endpoint)
            if follower.deployment == deployment and not same:
                self._close(follower.sub)
                self._close(follower.dealer)
                del self._followers[name]
                index.drop(name)
        if not replicas:
            with self._lock:
                self._indexes.pop(deployment, None)
            return
        for name, (endpoint, replay) in replicas.items():
            if name in self._followers:
                continue
            follower = _Follower(deployment, name, endpoint, replay)
            follower.sub = self._socket(zmq.SUB, endpoint, follower)
            self._followers[name] = follower
            if replay is not None:
                self._ask_replay(follower, 0)
            log.info("kv_events_following", deployment=deployment, replica=name, endpoint=endpoint)

    def _ask_replay(self, follower: _Follower, start: int) -> None:
        import zmq

        self._close(follower.dealer)
        follower.dealer = self._socket(zmq.DEALER, follower.replay_endpoint or "", follower)
        follower.replaying_since, follower.replay_from = time.monotonic(), start
        with contextlib.suppress(zmq.Again):  # else the replay times out; the SUB socket's batches go on
            follower.dealer.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)

    def _on_sub(self, follower: _Follower, frames: list[bytes]) -> None:
        seq, payload = int.from_bytes(frames[1], "big"), frames[2]
        if follower.replaying_since is not None:
            follower.held.append((seq, payload))
            return
        if seq <= follower.last:
            return
        if follower.last >= 0 and seq > follower.last + 1:
            self.gaps += 1
            if follower.replay_endpoint is not None:
                follower.held.append((seq, payload))
                self._ask_replay(follower, follower.last + 1)
                return
            self._lost(follower)  # no replay: start afresh
        self._apply(follower, seq, payload)

    def _on_replay(self, follower: _Follower, frames: list[bytes]) -> None:
        if follower.replaying_since is None:
            return  # an answer to a replay already given up
        if len(frames) < 4 or frames[2] == END_SEQ or not frames[3]:
            self._end_replay(follower)
            return
        seq = int.from_bytes(frames[2], "big")
        if seq <= follower.last:
            return
        if follower.last >= 0 and seq > follower.last + 1:  # the buffer no longer reaches back, or a drop
            self._lost(follower)
        self._apply(follower, seq, frames[3])

    def _end_replay(self, follower: _Follower) -> None:
        """Apply what came meanwhile. A batch still missing is asked for once more; then it is
        lost for good, and the replica's entries are rebuilt from what follows it."""
        follower.replaying_since = None
        held = sorted(follower.held)
        if held and follower.last >= 0 and held[0][0] > follower.last + 1 and not follower.retried:
            follower.retried = True
            self._ask_replay(follower, follower.last + 1)
            return
        follower.held, follower.retried = [], False
        for seq, payload in held:
            if seq <= follower.last:
                continue
            if follower.last >= 0 and seq > follower.last + 1:
                self._lost(follower)
            self._apply(follower, seq, payload)

    def _lost(self, follower: _Follower) -> None:
        """Events of ``follower`` are lost for good: forget what it held (misses, never a
        block believed held that was evicted meanwhile)."""
        self.partial += 1
        self.index(follower.deployment).drop(follower.replica)

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
