"""The KV-event listener's replays and sockets (routing/kv_subscriber.py), against a replica's two
endpoints as vLLM 0.32 binds them (a PUB; a ROUTER answering replay requests with
``(topic, seq, payload)`` frames and an end marker: ``vllm/distributed/kv_events.py``) played
by a thread on loopback, so that a replay can be slow, or stop halfway."""

from __future__ import annotations

import errno
import resource
import threading
import time

import msgspec
import pytest
import zmq

from atomr_infer.routing import kv_subscriber
from atomr_infer.routing.kv_index import BlockStored, KVEventBatch, chain
from atomr_infer.routing.kv_subscriber import KvEventsHub
from tests.waiting import wait_until

BLOCK = 4
DOC = list(range(100, 164))  # 16 blocks of 4 tokens
END = (-1).to_bytes(8, "big", signed=True)


def payload(block: int) -> bytes:
    """One engine step storing block ``block`` of DOC (vLLM's hashes: 1000 + i)."""
    event = BlockStored([1000 + block], None if block == 0 else 999 + block,
                        DOC[block * BLOCK:(block + 1) * BLOCK], BLOCK)
    return msgspec.msgpack.encode(KVEventBatch(0.0, [event]))


class Replica:
    """A replica's publisher: ``answers[i]`` is how it answers the i-th replay request: the
    batches ``(seq, payload)`` it sends, ``gap_s`` apart, and whether it ends with vLLM's end
    marker (a replay that stops halfway does not). Requests past the last get no answer."""

    def __init__(self, answers: list[tuple[list[tuple[int, bytes]], float, bool]]) -> None:
        self._context = zmq.Context()
        self.pub = self._context.socket(zmq.PUB)
        self.endpoint = f"tcp://127.0.0.1:{self.pub.bind_to_random_port('tcp://127.0.0.1')}"
        self._router = self._context.socket(zmq.ROUTER)
        self.replay_endpoint = f"tcp://127.0.0.1:{self._router.bind_to_random_port('tcp://127.0.0.1')}"
        self._answers, self.asked = list(answers), []  # asked: the start of each replay requested
        self._running = True
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while self._running:
            if not self._router.poll(20):
                continue
            client, _, start = self._router.recv_multipart()
            self.asked.append(int.from_bytes(start, "big"))
            if not self._answers:
                continue
            batches, gap_s, end = self._answers.pop(0)
            for seq, data in batches:
                time.sleep(gap_s)
                self._router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), data))
            if end:
                self._router.send_multipart((client, b"", b"", END, b""))

    def close(self) -> None:
        self._running = False
        self._thread.join()
        self._context.destroy(linger=0)


@pytest.fixture
def replica():
    made: list[Replica] = []

    def start(*answers):
        made.append(Replica(list(answers)))
        return made[-1]

    yield start
    for one in made:
        one.close()


def test_a_replay_slower_than_the_idle_limit_in_all_is_applied_whole_and_its_socket_closed(replica, monkeypatch):
    """The limit counts from the last batch a replay brought, not from when it was asked: a
    replay of vLLM's whole buffer may take longer than that to arrive (cutting it kept only
    the oldest part of the buffer)."""
    monkeypatch.setattr(kv_subscriber, "REPLAY_IDLE_S", 0.5)
    pub = replica(([(i, payload(i)) for i in range(16)], 0.08, True))  # 1.3 s in all
    hub = KvEventsHub()
    hub.follow("d", {"r0": (pub.endpoint, pub.replay_endpoint)})
    follower = wait_until(lambda: hub._followers.get("r0"), 10)
    wait_until(lambda: follower.replaying_since is None, 10, what="the replay's end")
    assert follower.last == 15 and hub.partial == 0 and pub.asked == [0]
    assert hub.index("d").depths(chain(DOC, BLOCK)) == {"r0": 16}
    # The replay's DEALER is closed at its end: one socket per replica followed.
    assert follower.dealer is None
    wait_until(lambda: len(hub._by_socket) == 1, 5, what="the replay socket closed")
    hub.follow("d", {})


def test_a_replay_that_stops_halfway_keeps_no_part_of_the_buffer(replica, monkeypatch):
    """It brings batches 0-4 of a buffer that goes on (batches that may evict those blocks), then
    nothing: asked again from 5, which brings nothing either: the replica's entries are dropped
    (blocks it evicted are never believed held), and what it publishes next is applied afresh."""
    monkeypatch.setattr(kv_subscriber, "REPLAY_IDLE_S", 0.3)
    pub = replica(([(i, payload(i)) for i in range(5)], 0.0, False))
    hub = KvEventsHub()
    hub.follow("d", {"r0": (pub.endpoint, pub.replay_endpoint)})
    index = hub.index("d")
    follower = wait_until(lambda: hub._followers.get("r0"), 10)
    wait_until(lambda: pub.asked == [0, 5], 10, what="the replay asked again from where it stopped")
    wait_until(lambda: follower.replaying_since is None, 10, what="the replay given up")
    assert index.blocks_of("r0") == 0 and index.depths(chain(DOC, BLOCK)) == {} and hub.partial == 1
    assert follower.dealer is None and len(hub._by_socket) == 1

    def published():
        pub.pub.send_multipart((b"", (40).to_bytes(8, "big"), payload(0)))
        return index.depths(chain(DOC, BLOCK)) == {"r0": 1}

    wait_until(published, 10, 0.1, what="a new batch applied")  # (a SUB misses what comes before it joins)
    assert hub.gaps == 0 and pub.asked == [0, 5]  # a fresh start, not a gap
    hub.follow("d", {})


def test_thousands_of_sockets_are_not_refused_at_zmqs_default_limit(monkeypatch):
    """ZMQ's shared context allows 1,023 sockets: past about 511 replicas (a SUB and a replay
    DEALER each) following stopped. A replay nobody answers is given up and its socket closed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 8192:  # each socket holds a descriptor or two
        if hard != resource.RLIM_INFINITY and hard < 8192:
            pytest.skip(f"RLIMIT_NOFILE {soft}/{hard}: too few descriptors for 1,200 sockets")
        resource.setrlimit(resource.RLIMIT_NOFILE, (8192, hard))
    monkeypatch.setattr(kv_subscriber, "REPLAY_IDLE_S", 0.3)
    hub = KvEventsHub()
    replicas = {f"r{i}": ("tcp://127.0.0.1:9", "tcp://127.0.0.1:9") for i in range(600)}  # nothing listens
    try:
        hub.follow("d", replicas)
        wait_until(lambda: len(hub._followers) == 600, 20, what="600 replicas followed")
        wait_until(lambda: len(hub._by_socket) == 600, 20, what="the replays' sockets closed")
    finally:
        hub.follow("d", {})
        wait_until(lambda: not hub._by_socket, 20, what="every socket closed")


def test_a_replica_that_cannot_be_followed_does_not_stop_the_others_and_is_tried_again(monkeypatch):
    monkeypatch.setattr(kv_subscriber, "FOLLOW_RETRY_S", 0.1)
    hub = KvEventsHub()
    made, refused = hub._socket, []

    def socket(kind, endpoint, follower):
        if follower.replica == "r1" and not refused:
            refused.append(endpoint)
            raise zmq.ZMQError(errno.EMFILE)  # as ZMQ says "Too many open files"
        return made(kind, endpoint, follower)

    monkeypatch.setattr(hub, "_socket", socket)
    hub.follow("d", {f"r{i}": ("tcp://127.0.0.1:9", None) for i in range(3)})
    wait_until(lambda: refused and {"r0", "r2"} <= set(hub._followers), 10, what="the others followed")
    wait_until(lambda: set(hub._followers) == {"r0", "r1", "r2"}, 10, what="r1 followed on a retry")
    hub.follow("d", {})
    wait_until(lambda: not hub._followers, 10)


def test_a_batch_dropped_midway_through_a_replay_is_asked_again_not_taken_as_lost(replica, monkeypatch):
    """vLLM sends a replay at once through a ROUTER socket, which drops what passes its send
    high-water mark: replays of larger batches arrive with gaps (seen at 5 KB a batch over
    loopback). Found by a review: each gap wiped the replica's entries, so the start-up replay
    kept only its tail. Now the replay is asked again from the missing batch."""
    monkeypatch.setattr(kv_subscriber, "REPLAY_IDLE_S", 0.5)
    dropped = [(i, payload(i)) for i in range(16) if i != 5]
    pub = replica((dropped, 0.0, True), ([(i, payload(i)) for i in range(5, 16)], 0.0, True))
    hub = KvEventsHub()
    hub.follow("d", {"r0": (pub.endpoint, pub.replay_endpoint)})
    follower = wait_until(lambda: hub._followers.get("r0"), 10)
    wait_until(lambda: pub.asked == [0, 5] and follower.replaying_since is None, 10, what="the replay resumed")
    assert follower.last == 15 and hub.partial == 0
    assert hub.index("d").depths(chain(DOC, BLOCK)) == {"r0": 16}
    hub.follow("d", {})


def test_routers_in_one_process_follow_a_deployment_until_the_last_one_lets_go(replica):
    """Found by a review: the process's listener kept one map per deployment, the last one given,
    so a router whose table dropped the deployment (or a Client closed) stopped it for every
    other router of the process. Each router (owner) now has its own, and a closed router's
    picker lets go of what it followed."""
    from atomr_infer.routing.picker import ReplicaPicker

    pub = replica()
    hub = KvEventsHub()
    first, second = object(), object()
    hub.follow("d", {"r0": (pub.endpoint, None)}, first)
    hub.follow("d", {"r0": (pub.endpoint, None)}, second)
    hub.follow("d", {}, first)  # the first router's table dropped it

    def published():
        pub.pub.send_multipart((b"", (1).to_bytes(8, "big"), payload(0)))
        return hub.index("d").depths(chain(DOC, BLOCK)) == {"r0": 1}

    wait_until(published, 10, 0.1, what="the second router's replica still followed")
    hub.follow("d", {}, second)
    wait_until(lambda: "r0" not in hub._followers, 10, what="let go once no router follows it")

    import atomr_infer.routing.picker as picker_module

    picker, calls = ReplicaPicker(), []
    picker._followed = {"d": object()}
    real = picker_module.kv_hub
    picker_module.kv_hub = lambda: type("Hub", (), {"follow": lambda _s, *a: calls.append(a)})()
    try:
        picker.close()
    finally:
        picker_module.kv_hub = real
    assert calls == [("d", {}, picker)] and picker._followed == {}
