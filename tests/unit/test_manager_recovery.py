"""A restarted manager whose recovery takes more than one pass: the store not readable yet, or a
deployment's replicas not looked up (a Ray error other than "no such actor"). Nothing may be
lost meanwhile: it dropped the deployment's record (its replicas ran on unmanaged, and a
re-apply collided with their names), or, with the store unread, saved an empty state over it."""

from __future__ import annotations

import pytest

from atomr_infer.control.recovery import NotRecoveredYet
from atomr_infer.control.store import MemoryStore

from .test_manager import Harness, adopting_fails_for, spec


class FailingStore(MemoryStore):
    """A store whose saves fail while ``fail`` (a GCS that does not answer)."""

    fail = False

    def save(self, records):
        if self.fail:
            raise TimeoutError("internal_kv_put: GCS did not answer")
        super().save(records)


def running(*names: str) -> Harness:
    first = Harness()
    for name in names:
        first.call("apply", spec(name=name))
    first.converge()
    return first


def test_a_deployment_whose_replicas_could_not_be_looked_up_is_kept_and_recovered_on_a_later_pass() -> None:
    first = running("good", "other")
    adopt = adopting_fails_for(first.launcher, "good")
    second = Harness(store=first.store, launcher=first.launcher)
    second.manager.reconcile_once()
    assert set(second.store.load()) == {"good", "other"}  # its record was saved away
    assert second.call("routing_table", -1) is None  # routers keep theirs (it would say "good" is gone)
    shown = second.call("status", "good")  # (it was missing from `atomr status` meanwhile)
    assert shown.state == "recovering" and "TimeoutError: GCS did not answer" in shown.last_failure
    assert [s.name for s in second.call("list")] == ["good", "other"]
    with pytest.raises(NotRecoveredYet, match="has not recovered deployment 'good' yet"):
        second.call("apply", spec(name="good"))  # a new r0 would collide with the live one
    with pytest.raises(NotRecoveredYet):
        second.call("remove", "good")
    first.launcher.adopt = adopt  # the GCS answers again
    second.converge(passes=2)
    good = second.call("status", "good")
    assert [r.actor_name for r in good.replicas] == ["atomr:good:r0"] and len(first.launcher.started) == 2
    assert first.launcher.started[0].adopted and not first.launcher.started[0].stopped  # adopted, not replaced
    assert "good" in second.call("routing_table", -1).deployments


def test_a_store_that_cannot_be_read_yet_is_not_saved_over() -> None:
    first = running("demo")
    load = first.store.load
    calls = []

    def unreadable():
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("GCS unavailable")
        return load()

    first.store.load = unreadable
    second = Harness(store=first.store, launcher=first.launcher)  # its first load fails
    second.manager.reconcile_once()  # ... its second, on this pass, reads it
    assert list(load()) == ["demo"] and second.call("status", "demo") is not None
    assert first.launcher.started[0].adopted and len(first.launcher.started) == 1


def test_while_the_store_is_unread_nothing_is_saved_applied_or_published() -> None:
    first = running("demo")
    load = first.store.load
    first.store.load = lambda: (_ for _ in ()).throw(ConnectionError("GCS unavailable"))
    second = Harness(store=first.store, launcher=first.launcher)
    second.converge(passes=3)
    assert list(load()) == ["demo"]  # it was saved as [] on the first pass
    assert second.call("routing_table", -1) is None  # (an empty table: routers would answer 404 for all)
    with pytest.raises(NotRecoveredYet, match="cannot read its stored state yet .*GCS unavailable"):
        second.call("apply", spec(name="new"))
    first.store.load = load
    second.converge(passes=2)
    assert "demo" in second.call("routing_table", -1).deployments


def test_a_replica_draining_when_the_manager_died_is_drained_and_stopped_by_the_next() -> None:
    """Only live replicas were stored: one draining (a scale-down, a roll) was never stopped,
    refusing requests and holding its GPU for good."""
    first = running()
    first.call("apply", spec(replicas=2))
    first.converge()
    first.call("apply", spec(replicas=1))
    first.manager.reconcile_once()
    leaving = [h for h in first.launcher.started if h.draining]
    assert len(leaving) == 1 and not leaving[0].stopped
    second = Harness(store=first.store, launcher=first.launcher)
    second.converge()
    (staying,) = [h for h in first.launcher.started if h is not leaving[0]]
    assert leaving[0].stopped and not staying.stopped
    assert [r.actor_name for r in second.call("status", "demo").replicas] == [staying.actor_name]
    assert sorted(second.store.load()["demo"].replicas) == [staying.actor_name.rpartition(":")[2]]


def test_a_removal_under_way_when_the_manager_died_is_finished_by_the_next() -> None:
    """The record went at once, the replicas were draining: the next manager knew nothing of
    them (they ran on, and a re-apply collided with their names)."""
    first = running("demo")
    first.call("remove", "demo")
    first.manager.reconcile_once()
    (r0,) = first.launcher.started
    assert r0.draining and not r0.stopped
    second = Harness(store=first.store, launcher=first.launcher)
    assert second.call("status", "demo").replicas_desired == 0  # listed as going, until it is gone
    second.converge()
    assert r0.stopped and second.call("status", "demo") is None and not second.store.load()
    second.call("apply", spec())  # its name is free again: the old r0 is gone
    second.converge()
    assert [r.state for r in second.call("status", "demo").replicas] == ["ready"]


def test_a_replica_started_after_the_last_save_is_stopped_not_orphaned() -> None:
    """A pass saves the next replica index at its end: a manager that died in between (or whose
    save failed) left a replica no record names. The next one tried its name, failed ("already
    taken"), went on to the next, and the first ran on, unmanaged, for good."""
    store = FailingStore()
    first = Harness(store=store)
    first.call("apply", spec())
    first.converge()
    first.call("apply", spec(replicas=2))
    store.fail = True
    first.manager.reconcile_once()  # r1 started; the save after it failed
    stray = first.launcher.started[1]
    assert stray.actor_name == "atomr:demo:r1" and store.load()["demo"].next_index == 1
    store.fail = False
    second = Harness(store=store, launcher=first.launcher)
    second.converge()
    assert stray.stopped
    assert [r.actor_name for r in second.call("status", "demo").replicas] == ["atomr:demo:r0", "atomr:demo:r2"]


def test_strays_past_a_gap_in_their_names_are_stopped_too() -> None:
    """Saves failing, r1 started, failed and was replaced by r2 (its name kept free): a restarted
    manager that looked from the saved next index up to the first missing name left r2 running."""
    store = MemoryStore()
    first = Harness(store=store)
    first.call("apply", spec())
    first.converge()
    first.launcher.start(spec(), "r2")  # as a replica started after the last save, past a gone r1
    stray = first.launcher.started[-1]
    second = Harness(store=store, launcher=first.launcher)
    second.converge()
    assert stray.stopped
    assert [r.actor_name for r in second.call("status", "demo").replicas] == ["atomr:demo:r0"]
    second.call("apply", spec(replicas=2))
    second.converge()
    assert [r.actor_name for r in second.call("status", "demo").replicas] == ["atomr:demo:r0", "atomr:demo:r3"]


def test_a_replica_being_stopped_when_the_manager_went_is_stopped_by_the_next() -> None:
    """Stopping asks a replica to shut down; its kill is the manager's to do after. A manager gone
    in between left one that no record names (it was dropped as stopped) and nothing killed."""
    first = Harness()
    first.call("apply", spec(replicas=2))
    first.converge()
    first.call("apply", spec(replicas=1))
    first.converge()
    gone = next(h for h in first.launcher.started if h.stopped)
    gone.stopped = False  # its shutdown never finished, and no kill came: still alive, still named
    assert gone.actor_name not in {r.actor_name for r in first.call("status", "demo").replicas}
    second = Harness(store=first.store, launcher=first.launcher)
    second.converge()
    assert gone.stopped
    assert len(second.call("status", "demo").replicas) == 1


def test_a_replica_told_to_drain_before_the_save_drains_on_after_adoption() -> None:
    """Told to drain by a manager that died before saving so: adopted, it answered ready() and
    was counted ready for good while routers, told by it that it drains, left it alone."""
    first = running("demo")
    (r0,) = first.launcher.started
    r0.ready_draining = True
    second = Harness(store=first.store, launcher=first.launcher)
    second.converge()
    assert r0.draining and r0.stopped
    status = second.call("status", "demo")
    assert [(r.actor_name, r.state) for r in status.replicas if r.state == "ready"] == [("atomr:demo:r1", "ready")]


def test_a_store_read_late_still_waits_for_its_adopted_replicas() -> None:
    """The wait for adopted replicas ran from the manager's start: a store read after it had
    passed published a table without them at once (routers dropped every route)."""
    from .fakes import Poll

    first = running("demo")
    first.launcher.started[0].ready = Poll.pending()  # not heard ready yet by the next manager
    load = first.store.load
    first.store.load = lambda: (_ for _ in ()).throw(ConnectionError("GCS unavailable"))
    second = Harness(store=first.store, launcher=first.launcher)
    second.clock.advance(60.0)  # past the 30 s wait
    second.manager.reconcile_once()
    first.store.load = load
    second.manager.reconcile_once()
    assert second.call("routing_table", -1) is None  # still waiting for r0 to answer
    first.launcher.make_ready()
    second.manager.reconcile_once()
    assert [r.actor_name for r in second.call("routing_table", -1).deployments["demo"].replicas] == ["atomr:demo:r0"]


def test_records_read_across_versions() -> None:
    """A field this version does not know made every load fail (the manager refused every apply
    for good); and ``removing: false`` in every record made an older atomr's load fail (it then
    saved an empty state over them)."""
    import json

    from atomr_infer.control.store import DeploymentRecord, decoded, encoded

    first = running("demo")
    stored = json.loads(first.store._blob["demo"])
    assert "removing" not in stored  # as an older atomr's records are
    first.store._blob["demo"] = json.dumps({**stored, "a_newer_field": 1})
    second = Harness(store=first.store, launcher=first.launcher)
    second.converge()
    assert second.call("status", "demo").replicas_ready == 1 and first.launcher.started[0].adopted
    removing = DeploymentRecord({}, 3, "", removing=True)
    assert encoded(removing)["removing"] is True and decoded(encoded(removing)) == removing


def test_an_apply_or_remove_whose_save_failed_is_done_and_saved_by_the_next_pass() -> None:
    """The save after an apply or a remove failed (a GCS blip): the caller got the raw error, as
    if nothing were done, while the deployment was created (or removed) in memory and saved later;
    a failed remove did not even stop routing to it at once."""
    store = FailingStore()
    h = Harness(store=store)
    store.fail = True
    assert h.call("apply", spec()).changed
    store.fail = False
    h.converge()
    assert list(store.load()) == ["demo"] and h.call("status", "demo").replicas_ready == 1
    table = h.call("routing_table", -1)
    store.fail = True
    h.call("remove", "demo")
    assert "demo" not in h.call("routing_table", table.version).deployments  # routed to no more
    store.fail = False
    h.converge()
    assert list(store.load()) == [] and all(x.stopped for x in h.launcher.started)


def test_while_the_store_is_unread_listing_is_refused_as_retryable_not_answered_empty() -> None:
    """list() and status() said nothing was deployed: `atomr status demo` answered "no deployment
    named demo", and `atomr down` removed nothing, stopped the manager and left the replicas running."""
    first = running("demo")
    load = first.store.load
    first.store.load = lambda: (_ for _ in ()).throw(ConnectionError("GCS unavailable"))
    second = Harness(store=first.store, launcher=first.launcher)
    second.manager.reconcile_once()
    for method, *args in (("list",), ("status", "demo"), ("status", "other"), ("wait_ready", "demo", 0.05)):
        with pytest.raises(NotRecoveredYet, match="cannot read its stored state yet .*GCS unavailable") as refused:
            second.call(method, *args)
        assert refused.value.retryable
    first.store.load = load
    second.manager.reconcile_once()
    assert [s.name for s in second.call("list")] == ["demo"] and second.call("status", "other") is None
def test_a_deployment_not_recovered_within_the_wait_stays_routed_as_routers_had_it() -> None:
    """Its replicas could not be looked up for 30 s: the table then left it out, and every router
    answered 404 "no such model" while its replicas, untouched, could still serve. It is now
    listed as recovering, and routers keep their last route of it (a router that never had one
    makes requests wait for a replica, as for one scaled to zero)."""
    import asyncio

    from atomr_infer.routing.router import Router

    first = running("good", "other")
    before = first.call("routing_table", -1)
    adopting_fails_for(first.launcher, "good")
    second = Harness(store=first.store, launcher=first.launcher)
    second.manager.reconcile_once()
    assert second.call("routing_table", -1) is None  # withheld: routers keep theirs
    second.clock.advance(31.0)
    second.manager.reconcile_once()
    table = second.call("routing_table", -1)
    assert table.deployments["good"].recovering and table.deployments["good"].replicas == ()
    assert not table.deployments["other"].recovering and table.deployments["other"].replicas

    tables = [before, table]

    async def source(version):
        return tables.pop(0) if tables else None

    async def main():
        router = Router(source, refresh_s=0.0)
        await router.refresh(force=True)
        await router.refresh(force=True)
        return router.table

    routed = asyncio.run(main())
    assert routed.version == table.version
    assert routed.find("good").replicas == before.deployments["good"].replicas  # still routed there
    assert routed.find("other") == table.deployments["other"]
