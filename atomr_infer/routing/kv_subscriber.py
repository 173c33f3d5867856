"""Listen to every replica's KV-cache events and keep each deployment's ``KvIndex``.

One thread per process (``hub()``), shared by every router in it (the ingress's and a
``Client``'s alike): one ZMQ SUB socket per replica, connected to the endpoint the replica
bound on its node's address (engine/vllm/kv_events.py), and, while a replay runs, one DEALER to
its replay endpoint. The sockets come from a ZMQ context of the hub's own, whose socket limit
fits thousands of replicas (a shared context's default, 1,023, stopped at about 511); a replica
that cannot be followed (out of file descriptors) is tried again every ``FOLLOW_RETRY_S``.

vLLM numbers its batches. A follower first asks for a replay from 0 (vLLM keeps its last
``buffer_steps`` batches) while it buffers what the SUB socket brings, then applies the rest in
order. A gap (ZMQ drops when a subscriber falls behind its high-water mark) asks for a replay
from the first missing batch (a new DEALER per replay, so a late answer to an old one is never
taken for the next). A batch the replay no longer has (vLLM keeps ``buffer_steps``), or that a
replay itself dropped, is lost for good: the replica's entries are dropped and rebuilt from what
follows. So is a replay that stops without its end marker (nothing heard for
``REPLAY_IDLE_S``, twice): what it brought is only the oldest part of the buffer, whose blocks
may have been evicted by the batches it did not bring. Blocks stored before are then unknown
(routing misses them), but none that was evicted meanwhile is believed held (routing would send
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
# A replay that brings nothing for this long is asked again from where it stopped, then given up
# (an idle limit: a replay of vLLM's whole buffer may take longer than this to arrive).
REPLAY_IDLE_S = 2.0
POLL_MS = 20
READ_MAX = 256  # messages read from one socket per turn: a busy replica cannot starve the others
FOLLOW_RETRY_S = 5.0  # a replica that could not be followed (no socket) is tried again after this
# vLLM sends a whole replay at once through a ROUTER socket, which drops what passes its send
# high-water mark (1,000 messages): a replay of larger batches arrives with gaps. Each ask brings
# at least that many, so asking again from the gap gets on; bounded, so a replica that keeps
# dropping is given up (its entries rebuilt from what follows) rather than asked for good.
MAX_REPLAY_RESUMES = 50


def _zmq_context() -> Any:
    """A context of the hub's own, its socket limit raised from ZMQ's default 1,023 (and not
    shared with a library's ``Context.instance()``)."""
    import zmq

    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, context.get(zmq.SOCKET_LIMIT))
    return context


@dataclass
class _Follower:
    deployment: str
    replica: str
    endpoint: str
    replay_endpoint: str | None
    sub: Any = None
    dealer: Any = None  # one per replay, closed at its end: a late answer to an old one cannot end the next
    last: int = -1  # the sequence number of the last batch applied
    replaying_since: float | None = None  # a replay asked for and not yet ended
    replay_heard_at: float = 0.0  # when it was asked, or last brought a batch (REPLAY_IDLE_S)
    replay_from: int = 0
    retried: bool = False  # a gap (or a replay cut short) asked again once before it counts as lost
    replay_started: bool = False  # the replay asked for last has brought a batch
    resumes: int = 0  # replays asked again from a batch dropped midway, since the last one that ended
    held: list[tuple[int, bytes]] = field(default_factory=list)  # SUB batches while replaying


class KvEventsHub:
    """The process's KV-event listener: ``follow`` replicas, read ``index(deployment)``."""

    def __init__(self) -> None:
        self._indexes: dict[str, KvIndex] = {}
        self._followers: dict[str, _Follower] = {}  # replica -> its follower (touched by the thread only)
        self._wanted: dict[str, dict[str, tuple[str, str | None]]] = {}  # deployment -> replica -> endpoints
        self._owners: dict[str, dict[int, dict[str, tuple[str, str | None]]]] = {}  # deployment -> owner -> its map
        self._changes: queue.SimpleQueue[tuple[str, dict[str, tuple[str, str | None]]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._context: Any = None
        self._poller: Any = None
        self._by_socket: dict[Any, _Follower] = {}  # (the thread's own, as are the next three)
        self._replaying: dict[str, _Follower] = {}  # replica -> its follower, while a replay runs
        self._asked: dict[str, dict[str, tuple[str, str | None]]] = {}  # deployment -> the last change applied
        self._retry_at: dict[str, float] = {}  # deployment -> when to try its replicas not followed again
        self.gaps = 0  # batches found missing (each asks for a replay)
        self.partial = 0  # batches lost for good (the replica's entries rebuilt from what followed)

    def index(self, deployment: str) -> KvIndex:
        with self._lock:
            return self._indexes.setdefault(deployment, KvIndex())

    def follow(self, deployment: str, replicas: dict[str, tuple[str, str | None]], owner: object = None) -> None:
        """Listen to exactly these replicas of ``deployment`` (name -> (endpoint, replay endpoint))
        for ``owner`` (a router's picker; routers in one process share the listener): the replicas
        any owner names are followed, a replica none names is dropped from the index, and a
        deployment no owner follows is forgotten. Cheap when nothing changed."""
        with self._lock:  # (Clients route on threads of their own)
            owners = self._owners.setdefault(deployment, {})
            if replicas:
                owners[id(owner)] = dict(replicas)
            else:
                owners.pop(id(owner), None)
            wanted = {name: ends for each in owners.values() for name, ends in each.items()}
            if not owners:
                del self._owners[deployment]
            if self._wanted.get(deployment, {}) == wanted and deployment in self._wanted:
                return
            self._wanted[deployment] = wanted
            self._changes.put((deployment, dict(wanted)))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="atomr-kv-events", daemon=True)
                self._thread.start()

    def forget(self, deployment: str) -> None:
        """Stop following ``deployment`` for every owner (tests: routers they did not close)."""
        with self._lock:
            self._owners.pop(deployment, None)
        self.follow(deployment, {})

    def _run(self) -> None:
        import zmq

        if self._context is None:
            self._context, self._poller = _zmq_context(), zmq.Poller()
        while True:
            changes = [self._changes.get() for _ in range(self._changes.qsize())]
            now = time.monotonic()
            named = {deployment for deployment, _ in changes}  # a newer map replaces the one to retry
            changes += [(name, self._asked.get(name, {})) for name, at in list(self._retry_at.items())
                        if now >= at and name not in named]
            for deployment, replicas in changes:
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
                self._read(sock)
            now = time.monotonic()
            for follower in list(self._replaying.values()):  # only replays: not every follower, every turn
                if now - follower.replay_heard_at > REPLAY_IDLE_S:
                    try:
                        self._end_replay(follower, complete=False)
                    except Exception as exc:  # noqa: BLE001
                        log.warning("kv_event_failed", replica=follower.replica, error=f"{type(exc).__name__}: {exc}")

    def _read(self, sock: Any) -> None:
        """What ``sock`` has ready (up to ``READ_MAX``): a turn of the loop (a poll of every
        socket) per message would cap the whole process at a few thousand batches a second."""
        import zmq

        follower = self._by_socket.get(sock)
        for _ in range(READ_MAX):
            if follower is None or sock is not follower.sub and sock is not follower.dealer:
                return  # closed meanwhile (a replay that ended, a replica dropped)
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                if sock is follower.sub:
                    self._on_sub(follower, frames)
                else:
                    self._on_replay(follower, frames)
            except Exception as exc:  # noqa: BLE001 - one bad message must not stop the listener
                log.warning("kv_event_failed", replica=follower.replica, error=f"{type(exc).__name__}: {exc}")

    def _socket(self, kind: int, endpoint: str, follower: _Follower) -> Any:
        import zmq

        sock = self._context.socket(kind)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)  # a replica gone for good: retried every 5 s, not 0.1
            if endpoint.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            if kind == zmq.SUB:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            else:
                sock.setsockopt(zmq.RCVHWM, 0)  # a replay comes all at once: keep all of it
            sock.connect(endpoint)
        except Exception:
            sock.close(linger=0)
            raise
        self._poller.register(sock, zmq.POLLIN)
        self._by_socket[sock] = follower
        return sock

    def _close(self, sock: Any) -> None:
        if sock is not None:
            self._poller.unregister(sock)
            self._by_socket.pop(sock, None)
            sock.close(linger=0)

    def _apply_change(self, deployment: str, replicas: dict[str, tuple[str, str | None]]) -> None:
        """Follow exactly ``replicas`` of ``deployment``. A replica that cannot be followed (a bad
        endpoint, no file descriptor left) does not stop the others, and is tried again."""
        import zmq

        index = self.index(deployment)
        for name, follower in list(self._followers.items()):
            same = replicas.get(name) == (follower.endpoint, follower.replay_endpoint)
            if follower.deployment == deployment and not same:
                self._close(follower.sub)
                self._stop_replay(follower)
                del self._followers[name]
                index.drop(name)
        self._retry_at.pop(deployment, None)
        if not replicas:
            self._asked.pop(deployment, None)
            with self._lock:
                self._indexes.pop(deployment, None)
            return
        self._asked[deployment] = replicas
        failed: list[str] = []
        error = ""
        for name, (endpoint, replay) in replicas.items():
            if name in self._followers:
                continue
            follower = _Follower(deployment, name, endpoint, replay)
            try:
                follower.sub = self._socket(zmq.SUB, endpoint, follower)
            except Exception as exc:  # noqa: BLE001 - the others are followed; this one later
                failed.append(name)
                error = f"{type(exc).__name__}: {exc}"
                continue
            self._followers[name] = follower
            if replay is not None:
                self._ask_replay(follower, 0)
            log.info("kv_events_following", deployment=deployment, replica=name, endpoint=endpoint)
        if failed:
            self._retry_at[deployment] = time.monotonic() + FOLLOW_RETRY_S
            log.warning("kv_events_follow_failed", deployment=deployment, replicas=len(failed), first=failed[0],
                        error=error, retry_in_s=FOLLOW_RETRY_S)

    def _ask_replay(self, follower: _Follower, start: int) -> None:
        import zmq

        self._close(follower.dealer)
        follower.dealer = None
        follower.replaying_since = follower.replay_heard_at = time.monotonic()
        follower.replay_from, follower.replay_started = start, False
        self._replaying[follower.replica] = follower
        try:
            follower.dealer = self._socket(zmq.DEALER, follower.replay_endpoint or "", follower)
            follower.dealer.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
        except Exception as exc:  # noqa: BLE001 - no answer comes: asked again after REPLAY_IDLE_S, then given up
            log.warning("kv_events_replay_failed", replica=follower.replica, error=f"{type(exc).__name__}: {exc}")

    def _stop_replay(self, follower: _Follower) -> None:
        self._close(follower.dealer)
        follower.dealer, follower.replaying_since = None, None
        self._replaying.pop(follower.replica, None)

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
        follower.replay_heard_at = time.monotonic()
        if len(frames) < 4 or frames[2] == END_SEQ or not frames[3]:
            self._end_replay(follower, complete=True)
            return
        seq = int.from_bytes(frames[2], "big")
        started, follower.replay_started = follower.replay_started, True
        if seq <= follower.last:
            return
        if follower.last >= 0 and seq > follower.last + 1:
            if started and follower.resumes < MAX_REPLAY_RESUMES:  # dropped in transit: ask again from it
                follower.resumes += 1
                self.gaps += 1
                self._ask_replay(follower, follower.last + 1)
                return
            self._lost(follower)  # the buffer no longer reaches back
        self._apply(follower, seq, frames[3])

    def _end_replay(self, follower: _Follower, complete: bool) -> None:
        """The replay ended (``complete``: vLLM said so), or brought nothing for ``REPLAY_IDLE_S``.
        Apply what came meanwhile. A batch still missing, or a replay cut short, is asked for
        once more; then it is lost for good, and the replica's entries are rebuilt from what
        follows (never a prefix of the buffer kept as if it were all of it)."""
        self._stop_replay(follower)
        follower.resumes = 0 if complete else follower.resumes
        held = sorted(follower.held)
        missing = bool(held) and follower.last >= 0 and held[0][0] > follower.last + 1
        if (missing or not complete) and not follower.retried:
            follower.retried = True
            self._ask_replay(follower, follower.last + 1)
            return
        follower.held, follower.retried = [], False
        if not complete and follower.last >= 0:
            self._lost(follower)
            follower.last = -1  # nothing known of it now: the next batch starts afresh
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
