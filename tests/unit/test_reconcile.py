"""Reconcile logic for every change class, with a fake launcher and a fake clock (no Ray)."""

from __future__ import annotations

from atomr_infer.control.managed import runtime_key
from atomr_infer.control.reconcile import DeploymentReconciler, ReconcileConfig
from atomr_infer.control.replicas import Poll
from atomr_infer.spec import Deployment

from .fakes import FakeClock, FakeLauncher


def spec(**kw) -> Deployment:
    base = {"name": "demo", "model": "org/model", "device": "cpu"}
    return Deployment.model_validate({**base, **kw})


def setup(replicas=1, **kw):
    clock, launcher = FakeClock(), FakeLauncher()
    rec = DeploymentReconciler("demo", launcher, clock, ReconcileConfig(health_period_s=1.0, linger_s=5.0))
    s = spec(replicas=replicas, **kw)
    rec.set_desired(s, 1, runtime_key(s, 0))
    return clock, launcher, rec


def converge(clock, launcher, rec, passes=10):
    for _ in range(passes):
        rec.update()
        launcher.make_ready()
        for h in launcher.started:
            if h.draining:
                h.drained = Poll.success()
        clock.advance(1.0)
    rec.update()


def ids(rec, state="ready"):
    return sorted(r.replica_id for r in rec.replicas if r.state == state)


def test_create_starts_all_replicas_and_observes_generation():
    clock, launcher, rec = setup(replicas=3)
    rec.update()
    assert len(launcher.started) == 3
    assert rec.observed_generation == 0  # not ready yet
    converge(clock, launcher, rec)
    assert ids(rec) == ["r0", "r1", "r2"]
    assert rec.observed_generation == 1


def test_update_is_idempotent_once_converged():
    clock, launcher, rec = setup(replicas=2)
    converge(clock, launcher, rec)
    for _ in range(5):
        rec.update()
    assert len(launcher.started) == 2


def test_scale_up_and_down_keeps_the_original_replica():
    clock, launcher, rec = setup(replicas=1)
    converge(clock, launcher, rec)
    s3 = spec(replicas=3)
    rec.set_desired(s3, 2, runtime_key(s3, 0))
    converge(clock, launcher, rec)
    assert ids(rec) == ["r0", "r1", "r2"]
    s1 = spec(replicas=1)
    rec.set_desired(s1, 3, runtime_key(s1, 0))
    converge(clock, launcher, rec)
    assert ids(rec) == ["r0"]
    assert not launcher.started[0].stopped
    assert launcher.started[1].stopped and launcher.started[2].stopped
    assert rec.observed_generation == 3


def test_in_place_change_restarts_nothing():
    clock, launcher, rec = setup(replicas=2)
    converge(clock, launcher, rec)
    s = spec(replicas=2, serving={"max_concurrent": 64})
    rec.set_desired(s, 2, runtime_key(s, 0))  # same runtime key: serving is not a restart field
    converge(clock, launcher, rec)
    assert len(launcher.started) == 2 and not any(h.stopped for h in launcher.started)
    assert rec.observed_generation == 2


def test_rolling_replacement_keeps_serving():
    clock, launcher, rec = setup(replicas=2)
    converge(clock, launcher, rec)
    s = spec(replicas=2, runtime_config={"max_model_len": 4096})
    rec.set_desired(s, 2, runtime_key(s, 0))
    ready_counts = []
    for _ in range(12):
        rec.update()
        ready_counts.append(len(rec.ready_replicas()))
        live = [r for r in rec.replicas if r.live]
        assert len(live) <= 3  # never more than replicas + max_surge
        launcher.make_ready()
        for h in launcher.started:
            if h.draining:
                h.drained = Poll.success()
        clock.advance(1.0)
    assert min(ready_counts) >= 2  # an old replica leaves only after a new one is ready
    assert ids(rec) == ["r2", "r3"]
    assert rec.observed_generation == 2


def test_roll_without_surge_replaces_one_at_a_time():
    clock, launcher = FakeClock(), FakeLauncher()
    rec = DeploymentReconciler("demo", launcher, clock, ReconcileConfig(max_surge=0))
    s = spec(replicas=2)
    rec.set_desired(s, 1, runtime_key(s, 0))
    converge(clock, launcher, rec)
    s2 = spec(replicas=2, model="org/other")
    rec.set_desired(s2, 2, runtime_key(s2, 0))
    for _ in range(15):
        rec.update()
        assert len([r for r in rec.replicas if r.live]) <= 2
        launcher.make_ready()
        for h in launcher.started:
            if h.draining:
                h.drained = Poll.success()
        clock.advance(1.0)
    assert ids(rec) == ["r2", "r3"]


def test_dead_replica_is_replaced_with_backoff():
    clock, launcher, rec = setup(replicas=1)
    converge(clock, launcher, rec)
    launcher.started[0].health = Poll.failed("ActorDiedError: the actor died")
    clock.advance(1.0)  # the next health check is due
    rec.update()
    assert rec.replicas[0].state == "unhealthy"
    assert "died" in rec.replicas[0].reason and launcher.started[0].stopped
    rec.update()  # inside the backoff window: nothing new yet
    assert len(launcher.started) == 1
    clock.advance(1.1)
    rec.update()
    assert len(launcher.started) == 2
    # The new one fails to start too: the backoff doubles.
    launcher.started[1].ready = Poll.failed("engine failed to start")
    rec.update()
    assert rec.failures == 2
    clock.advance(1.5)
    rec.update()
    assert len(launcher.started) == 2  # 2 s backoff not over
    clock.advance(1.0)
    rec.update()
    assert len(launcher.started) == 3
    launcher.make_ready()
    rec.update()
    assert rec.failures == 0 and ids(rec) == ["r2"]
    assert "engine failed to start" in rec.last_failure


def test_create_failure_counts_as_failure():
    clock, launcher, rec = setup(replicas=1)
    launcher.fail_next = 1
    rec.update()
    assert rec.failures == 1 and "no resources" in rec.last_failure
    clock.advance(1.0)
    rec.update()
    assert len(launcher.started) == 1


def test_remove_drains_then_finishes():
    clock, launcher, rec = setup(replicas=2)
    converge(clock, launcher, rec)
    rec.set_desired(None, 2, "")
    rec.update()
    assert all(h.draining for h in launcher.started)
    assert not rec.finished_removing
    for h in launcher.started:
        h.drained = Poll.success()
    rec.update()
    assert rec.finished_removing and all(h.stopped for h in launcher.started)


def test_drain_timeout_stops_anyway():
    clock, launcher, rec = setup(replicas=1)
    converge(clock, launcher, rec)
    rec.set_desired(None, 2, "")
    rec.update()
    clock.advance(60)
    rec.update()
    assert launcher.started[0].stopped
    assert rec.replicas[0].reason == "drain timed out"


def test_adopted_replicas_are_not_restarted():
    clock, launcher, rec = setup(replicas=2)
    converge(clock, launcher, rec)
    # A new reconciler (manager restart) adopts the same handles.
    rec2 = DeploymentReconciler("demo", launcher, clock)
    rec2.set_desired(rec.spec, rec.generation, rec.runtime_key)
    for r in rec.replicas:
        r.state = "starting"
        rec2.adopt(r)
    converge(clock, launcher, rec2)
    assert len(launcher.started) == 2
    assert ids(rec2) == ["r0", "r1"]


def fail_start(clock, launcher, rec, recurring: bool) -> None:
    """Let the next replica start, then fail its start; wait out the backoff."""
    clock.advance(120.0)
    rec.update()
    launcher.started[-1].ready = Poll.failed("ValueError: not enough memory", recurring=recurring)
    rec.update()


def test_a_recurring_start_failure_gives_up_after_bounded_tries():
    clock, launcher, rec = setup(replicas=1)
    rec.update()
    launcher.started[0].ready = Poll.failed("ValueError: max_model_len too large", recurring=True)
    rec.update()
    for _ in range(2):
        fail_start(clock, launcher, rec, recurring=True)
    assert len(launcher.started) == 3 and rec.gave_up
    status = rec.status()
    assert status.failed and status.failure_kind == "recurring" and status.start_failures == 3
    assert status.next_start_in_s == 0.0 and "max_model_len" not in status.last_failure  # the last one
    for _ in range(5):  # no more tries, however long we wait
        clock.advance(120.0)
        rec.update()
    assert len(launcher.started) == 3
    # Applying again (same spec) retries; a changed spec does too.
    rec.retry()
    rec.update()
    assert len(launcher.started) == 4 and not rec.gave_up
    for _ in range(3):
        fail_start(clock, launcher, rec, recurring=True)
    assert rec.gave_up
    s = spec(replicas=1, runtime_config={"max_model_len": 1024})
    rec.set_desired(s, 2, runtime_key(s, 0))
    converge(clock, launcher, rec)
    assert not rec.gave_up and ids(rec) and rec.observed_generation == 2


def test_transient_failures_keep_backing_off_without_giving_up():
    clock, launcher, rec = setup(replicas=1)
    rec.update()
    for _ in range(8):
        fail_start(clock, launcher, rec, recurring=False)
    assert not rec.gave_up and rec.status().failure_kind == "transient"
    assert rec.status().next_start_in_s > 0
    clock.advance(120.0)
    converge(clock, launcher, rec)
    assert ids(rec) and rec.failures == 0


def test_a_failure_since_mended_is_history_not_failing():
    """A replica that died and was replaced left its failure for good: an hour later a scale-up
    said "failing", in red, with "the manager keeps retrying"."""
    from atomr_infer.control.managed import runtime_key
    from atomr_infer.status import DeploymentState

    clock, launcher, rec = setup(replicas=1)
    converge(clock, launcher, rec)
    launcher.started[0].health = Poll.failed("ActorDiedError: the actor died")
    clock.advance(1.0)
    rec.update()
    assert rec.status().failing and rec.status().state is DeploymentState.FAILING  # replacing it
    converge(clock, launcher, rec)
    clock.advance(3600)
    bigger = spec(replicas=2)
    rec.set_desired(bigger, 2, runtime_key(bigger, 0))
    rec.update()
    status = rec.status()
    assert status.last_failure == "r0 ActorDiedError: the actor died"  # kept, as history
    assert not status.failing and status.state is DeploymentState.ROLLING


def test_a_rolls_new_replicas_spread_among_themselves_not_beside_the_old_ones():
    """The old replicas, about to go, were counted as peers: a roll put every new replica on the
    node with the most free GPUs, beside them, and left the other node empty."""
    from atomr_infer.control.managed import runtime_key

    clock, launcher, rec = setup(replicas=1)
    converge(clock, launcher, rec)
    launcher.started[0].facts = {"node_id": "A"}
    other = spec(replicas=1, model="org/other")
    rec.set_desired(other, 2, runtime_key(other, 0))
    rec.update()
    assert len(launcher.started) == 2 and launcher.peer_nodes == []


def test_replicas_lost_together_are_one_backoff_step():
    """A node with 8 replicas lost: each failure doubled the backoff, and the first replacement
    started 60 s later (2^7 s, capped)."""
    clock, launcher, rec = setup(replicas=8)
    converge(clock, launcher, rec)
    for handle in launcher.started:
        handle.health = Poll.failed("ActorDiedError: the actor died (its node was lost)")
    clock.advance(1.0)
    rec.update()
    assert rec.failures == 1 and rec.next_start_at - clock() == 1.0
    clock.advance(1.0)
    rec.update()
    assert len(launcher.started) == 9  # probing again after one base backoff


def test_a_starting_replica_says_what_it_waits_for_where_its_handle_knows():
    clock, launcher, rec = setup(replicas=1)
    rec.update()
    (replica,) = rec.status().replicas
    assert replica.state == "starting" and replica.reason is None
    launcher.started[0].unplaced = "not placed by Ray for 31s: no node has 2 GPU free"
    assert rec.status().replicas[0].reason == "not placed by Ray for 31s: no node has 2 GPU free"
    converge(clock, launcher, rec)
    assert rec.status().replicas[0].reason is None  # ready: no longer said


def test_a_rolls_new_replica_ray_cannot_place_has_one_old_replica_stopped_for_it():
    """The surge replica waited for a GPU the old replicas held (the spare one gone since the roll
    began): it waited for good. One old replica now stops for it, and one only (Ray's answer may
    say "not placed" a while after the GPU freed), and the roll goes on stop-first: no other new
    replica starts, and the last old one serves, until it is ready."""
    clock, launcher, rec = setup(replicas=2)
    converge(clock, launcher, rec)
    s = spec(replicas=2, model="org/other")
    rec.set_desired(s, 2, runtime_key(s, 0))
    rec.update()
    surge = launcher.started[-1]
    assert [h.actor_name for h in launcher.started if not h.draining] == [
        "atomr:demo:r0", "atomr:demo:r1", "atomr:demo:r2"]
    surge.unplaced = "not placed by Ray for 31s: no node has 1 GPU free"
    for _ in range(3):
        clock.advance(1.0)
        rec.update()
        for h in launcher.started:
            h.drained = Poll.success() if h.draining else h.drained
    assert [h.actor_name for h in launcher.started if h.stopped] == ["atomr:demo:r0"]  # r1 serves on
    assert len(launcher.started) == 3  # r2 has r0's GPU; nothing else starts meanwhile
    surge.ready, surge.unplaced = Poll.success(), None
    converge(clock, launcher, rec)
    assert ids(rec) == ["r2", "r3"] and rec.observed_generation == 2


def test_a_stop_first_replacement_is_not_taken_for_unplaced_once_its_gpu_frees():
    """Stop-first (no spare GPU): the replacement waits for the GPU the old replica draining holds,
    and Ray's "not placed" (read every 10 s) still said so just after the drain ended: a second old
    replica was stopped for it, and none served until the replacement was ready."""
    clock, launcher, rec = setup(replicas=2)
    converge(clock, launcher, rec)
    s = spec(replicas=2, model="org/other")
    rec.set_desired(s, 2, runtime_key(s, 0))
    rec.surge_allowed = False
    for _ in range(40):  # r0 drains 40 s of long answers; its replacement waits for its GPU
        rec.update()
        for h in launcher.started[2:]:
            h.unplaced = "not placed by Ray for 31s: no node has 1 GPU free"
        clock.advance(1.0)
    assert [h.actor_name for h in launcher.started if h.draining] == ["atomr:demo:r0"]
    launcher.started[0].drained = Poll.success()
    for _ in range(10):  # the GPU is free; Ray's answer is up to 10 s old
        rec.update()
        clock.advance(1.0)
    assert [h.actor_name for h in launcher.started if h.draining or h.stopped] == ["atomr:demo:r0"]  # r1 serves
