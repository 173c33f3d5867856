"""``DeploymentManager`` without Ray: the fake launcher, an in-memory store, a fixed cluster
view and a fake clock it takes for that. The same flows run for real in
tests/integration/test_manager.py."""

from __future__ import annotations

import asyncio

import pytest

from atomr_infer.control.budget import ClusterView
from atomr_infer.control.manager import DeploymentManager
from atomr_infer.control.reconcile import ReconcileConfig
from atomr_infer.control.replicas import Poll
from atomr_infer.control.store import MemoryStore
from atomr_infer.errors import BudgetExceeded, SpecError
from atomr_infer.spec import Deployment

from .fakes import FakeClock, FakeLauncher

CLUSTER = ClusterView(total_gpus=4, accelerator_type="L4", gpu_memory_bytes=24 << 30)


def spec(**kw) -> Deployment:
    return Deployment.model_validate({"name": "demo", "model": "org/model", "device": "cuda", **kw})


def adopting_fails_for(launcher: FakeLauncher, name: str):
    """Make adopting ``name``'s replicas raise as Ray's GCS may (a new head not answering yet);
    returns the launcher's own ``adopt``, to put back."""
    adopt = launcher.adopt

    def flaky(deployment, replica_id):
        if deployment == name:
            raise TimeoutError("GCS did not answer")
        return adopt(deployment, replica_id)

    launcher.adopt = flaky
    return adopt


class Harness:
    """A manager and its fakes; ``converge`` plays the replicas' side of the reconcile passes."""

    def __init__(self, store: MemoryStore | None = None, launcher: FakeLauncher | None = None) -> None:
        self.clock, self.launcher, self.store = FakeClock(), launcher or FakeLauncher(), store or MemoryStore()
        self.manager = DeploymentManager(
            self.launcher, self.store, CLUSTER, ReconcileConfig(health_period_s=1.0, linger_s=0.0), self.clock
        )

    def converge(self, passes: int = 8) -> None:
        for _ in range(passes):
            self.manager.reconcile_once()
            self.launcher.make_ready()
            for h in self.launcher.started:
                if h.draining:
                    h.drained = Poll.success()
            self.clock.advance(1.0)
        self.manager.reconcile_once()

    def call(self, method: str, *args):
        """One message, as the actor gets it: on an event loop (the loop task is cancelled after)."""

        async def once():
            result = await getattr(self.manager, method)(*args)
            if self.manager._loop_task is not None:
                self.manager._loop_task.cancel()
            return result

        return asyncio.run(once())

    def live(self, name: str = "demo") -> list[str]:
        status = self.call("status", name)
        return [r.actor_name for r in status.replicas if r.state in ("starting", "ready")]


def test_apply_records_generation_1_and_the_loop_starts_the_replicas() -> None:
    h = Harness()
    result = h.call("apply", spec(replicas=2))
    assert (result.changed, result.generation, result.actions) == (True, 1, ("create 2 replicas",))
    h.converge()
    status = h.call("status", "demo")
    assert (status.generation, status.observed_generation, status.replicas_ready) == (1, 1, 2)
    assert h.live() == ["atomr:demo:r0", "atomr:demo:r1"]


def test_an_unchanged_apply_starts_nothing_and_keeps_the_generation() -> None:
    h = Harness()
    h.call("apply", spec())
    h.converge()
    again = h.call("apply", spec().model_dump())  # a dict of the same spec: the same hash
    assert (again.changed, again.generation, again.actions) == (False, 1, ("unchanged",))
    h.converge()
    assert len(h.launcher.started) == 1


def test_restart_on_apply_rolls_the_replicas_on_every_apply() -> None:
    h = Harness()
    h.call("apply", spec(restart_on_apply=True))
    h.converge()
    result = h.call("apply", spec(restart_on_apply=True))
    assert result.changed and result.generation == 2 and result.actions[0].startswith("roll 1 replica")
    h.converge()
    assert h.live() == ["atomr:demo:r1"]  # a new replica replaced r0


def test_a_rejected_apply_leaves_nothing_behind() -> None:
    h = Harness()
    with pytest.raises(BudgetExceeded) as info:
        h.call("apply", spec(gpus=4, replicas=2))
    assert info.value.check == "gpus"
    with pytest.raises(SpecError):
        h.call("apply", {"name": "demo", "model": "org/model", "replicas": -1})
    h.converge()
    assert h.call("status", "demo") is None and h.call("list") == [] and h.launcher.started == []
    assert h.store.load() == {}


def test_plan_changes_nothing_and_says_what_apply_would_do() -> None:
    h = Harness()
    h.call("apply", spec())
    h.converge()
    plan = h.call("plan", spec(replicas=3))
    assert plan.changed and plan.actions == ("scale 1 → 3",) and plan.budget_ok
    over = h.call("plan", spec(replicas=5))
    assert not over.budget_ok and "gpus" in over.error
    h.converge()
    assert h.call("status", "demo").generation == 1 and len(h.launcher.started) == 1


def test_remove_drains_then_forgets_the_deployment() -> None:
    h = Harness()
    h.call("apply", spec())
    h.converge()
    result = h.call("remove", "demo")
    assert result.changed and result.actions == ("drain and remove 1 replica",)
    assert h.call("status", "demo").removing is True
    h.converge()
    assert h.call("status", "demo") is None and all(x.stopped for x in h.launcher.started)
    assert h.call("remove", "demo").actions == ("no deployment named 'demo'; nothing to remove",)


def test_a_restarted_manager_adopts_the_live_replicas_from_the_store() -> None:
    first = Harness()
    first.call("apply", spec(replicas=2))
    first.converge()
    # A new manager over the same store and cluster: the actor restarted, the replicas did not.
    second = Harness(store=first.store, launcher=first.launcher)
    second.converge()
    assert len(first.launcher.started) == 2 and all(x.adopted for x in first.launcher.started)
    status = second.call("status", "demo")
    assert (status.generation, status.replicas_ready) == (1, 2)
    # The next new replica does not reuse a recorded name.
    second.call("apply", spec(replicas=3))
    second.converge()
    assert second.live() == ["atomr:demo:r0", "atomr:demo:r1", "atomr:demo:r2"]


def test_a_manager_restarted_mid_roll_keeps_the_old_replicas_serving_until_new_ones_are_ready() -> None:
    """An adopted replica is 'starting' until it answers its new manager, and the first pass came
    first: mid-roll the old replicas, serving, were stopped at once as old replicas not serving
    yet, and nothing served until the new ones had loaded their model (minutes on a GPU)."""
    first = Harness()
    first.call("apply", spec(replicas=2))
    first.converge()
    first.call("apply", spec(replicas=2, model="org/other"))  # a roll: r2 starts beside r0 and r1
    first.manager.reconcile_once()
    adopt = first.launcher.adopt

    def adopted_unheard(deployment, replica_id):
        h = adopt(deployment, replica_id)
        if h is not None:
            h.ready = Poll.pending()  # a new handle's ready() has not answered yet
        return h

    first.launcher.adopt = adopted_unheard
    second = Harness(store=first.store, launcher=first.launcher)
    second.manager.reconcile_once()
    second.manager.reconcile_once()
    old = first.launcher.started[:2]
    assert not any(h.stopped or h.draining for h in old)  # serving on
    second.converge()  # they answer; r2 and r3 load: then the old ones drain, as in any roll
    assert all(h.draining and h.stopped for h in old) and second.live() == ["atomr:demo:r2", "atomr:demo:r3"]


def test_the_routing_table_lists_ready_replicas_and_takes_serving_limits_in_place() -> None:
    h = Harness()
    h.call("apply", spec(replicas=2))
    h.converge()
    table = h.call("routing_table", -1)
    assert [r.actor_name for r in table.deployments["demo"].replicas] == ["atomr:demo:r0", "atomr:demo:r1"]
    h.call("apply", spec(replicas=2, serving={"max_concurrent": 4}))
    newer = h.call("routing_table", table.version)
    assert newer.version > table.version and newer.deployments["demo"].max_concurrent == 4
    h.converge()
    assert len(h.launcher.started) == 2  # in place: nothing restarted


def test_mid_roll_the_routing_table_says_which_model_each_replica_serves_and_which_the_roll_goes_to() -> None:
    # kv_events routers tokenize with the model a roll goes to and match only its replicas.
    h = Harness()  # GPUs to spare: a new replica starts, then an old one drains, one at a time
    h.call("apply", spec(replicas=2))
    h.converge()
    h.call("apply", spec(replicas=2, model="org/other"))
    h.manager.reconcile_once()
    h.launcher.make_ready()
    h.manager.reconcile_once()
    dep = h.call("routing_table", -1).deployments["demo"]
    assert dep.model == "org/other"
    served = {r.actor_name: r.model for r in dep.replicas}
    assert sorted(served.values()) == ["org/model", "org/other"], served  # one of each, mid-roll
    assert served["atomr:demo:r2"] == "org/other"


def test_a_replica_started_before_replicas_reported_their_model_serves_the_spec_it_runs() -> None:
    h = Harness()
    h.call("apply", spec())
    h.converge()
    h.launcher.started[0].spec_model = ""  # adopted from older atomr: its ready facts name no model
    h.call("apply", spec(serving={"max_concurrent": 4}))  # a new table, the same replica
    assert [r.model for r in h.call("routing_table", -1).deployments["demo"].replicas] == ["org/model"]


def test_a_restarted_manager_never_reuses_the_name_of_a_stopped_replica() -> None:
    first = Harness()
    first.call("apply", spec(replicas=2))
    first.converge()
    first.call("apply", spec(replicas=0))  # r0 and r1 drain and stop: nothing left to adopt
    first.converge()
    second = Harness(store=first.store, launcher=first.launcher)
    second.call("apply", spec(replicas=1))
    second.converge()
    assert second.live() == ["atomr:demo:r2"]  # from the store: r0, r1 may still be stopping


def test_a_roll_on_a_cluster_with_no_gpu_to_spare_stops_the_old_replica_first() -> None:
    # One GPU, held by the running replica: a surge replica could never be placed (it waited
    # for a GPU forever on a one-GPU host), so the roll replaces the old replica stop-first.
    h = Harness()
    h.manager._cluster_override = ClusterView(total_gpus=1, accelerator_type="L4", gpu_memory_bytes=24 << 30)
    h.call("apply", spec())
    h.converge()
    assert h.live() == ["atomr:demo:r0"]
    h.call("apply", spec(model="org/other"))
    for _ in range(10):
        h.manager.reconcile_once()
        assert len(h.live()) <= 1  # never two at once: there is one GPU
        h.launcher.make_ready()
        for handle in h.launcher.started:
            if handle.draining:
                handle.drained = Poll.success()
        h.clock.advance(1.0)
    assert h.live() == ["atomr:demo:r1"]


def test_a_roll_to_fewer_gpus_on_a_full_cluster_goes_stop_first(monkeypatch) -> None:
    """2 replicas x 2 GPUs on 4, then gpus: 1. The budget counted the old replicas at 1 GPU each
    and let a third start, which no node could take: the old replicas waited for it for good."""
    from atomr_infer.control import placement

    h = Harness()  # four GPUs
    h.call("apply", spec(gpus=2, replicas=2))
    h.converge()
    free = {"n0": {"GPU": 0.0, "CPU": 4.0}, "n1": {"GPU": 0.0, "CPU": 4.0}}  # as Ray says: every GPU held
    monkeypatch.setattr(placement, "free_resources_by_node", lambda: free)
    h.call("apply", spec(gpus=1, replicas=2))
    for _ in range(12):
        h.manager.reconcile_once()
        assert len(h.live()) <= 2  # no replica beyond the two the GPUs hold
        h.launcher.make_ready()
        for handle in h.launcher.started:
            if handle.draining:
                handle.drained = Poll.success()
        h.clock.advance(1.0)
    assert h.call("status", "demo").converged and len(h.live()) == 2
    assert h.live() == ["atomr:demo:r2", "atomr:demo:r3"]


def test_a_roll_with_a_gpu_to_spare_starts_the_new_replica_first() -> None:
    h = Harness()  # four GPUs
    h.call("apply", spec())
    h.converge()
    h.call("apply", spec(model="org/other"))
    h.manager.reconcile_once()
    assert h.live() == ["atomr:demo:r0", "atomr:demo:r1"]  # r0 serves while r1 starts


def test_plan_counts_the_specs_deployed_alongside_and_refuses_what_apply_would() -> None:
    """``atomr deploy a.yaml b.yaml`` asks for each spec's plan with those before it counted as
    applied, so that a refusal of one stops the deploy before any is applied."""
    h = Harness()
    first, big = spec(name="first", gpus=2), spec(name="big", gpus=4)
    assert h.call("plan", big).budget_ok  # alone, the 4 GPUs are free
    together = h.call("plan", big, (first,))
    assert not together.budget_ok and "needs 6 GPUs" in together.error, together
    # a spec deployed with it under its own name replaces the recorded one, not adds to it
    h.call("apply", first)
    assert not h.call("plan", big).budget_ok
    assert h.call("plan", big, (spec(name="first", gpus=2, replicas=0),)).budget_ok
    alias = spec(name="other", serving={"openai": {"served_model_name": ["first"]}})
    with pytest.raises(SpecError, match="'first' already names deployment 'first'"):
        h.call("plan", alias)
    with pytest.raises(SpecError, match="'other' already names deployment 'x'"):
        h.call("plan", spec(name="other"), (spec(name="x", serving={"openai": {"served_model_name": ["other"]}}),))
    with pytest.raises(SpecError, match="max_num_batched_token"):  # vLLM's EngineArgs has no such field
        h.call("plan", spec(name="typo", runtime_config={"extra_engine_args": {"max_num_batched_token": 100}}))
    assert h.launcher.started == [] and [s.name for s in h.call("list")] == ["first"]


def test_a_restarted_manager_keeps_its_table_back_until_its_adopted_replicas_answer() -> None:
    """Its first table would list none of them (they are "starting" until their ready() answers):
    a router that took it would answer 404 for a deployment whose replicas serve on."""
    first = Harness()
    first.call("apply", spec(replicas=2))
    first.converge()
    routers_table = first.call("routing_table", -1)
    for handle in first.launcher.started:  # the new manager has not heard them answer yet
        handle.ready = Poll.pending()
    second = Harness(store=first.store, launcher=first.launcher)
    second.manager.reconcile_once()
    assert second.call("routing_table", routers_table.version) is None  # routers keep the one they have
    assert second.call("routing_table", -1) is None
    first.launcher.make_ready()
    second.manager.reconcile_once()
    table = second.call("routing_table", routers_table.version)
    assert [r.actor_name for r in table.deployments["demo"].replicas] == ["atomr:demo:r0", "atomr:demo:r1"]


def test_a_restarted_manager_whose_adopted_replica_never_answers_publishes_after_a_while() -> None:
    first = Harness()
    first.call("apply", spec())
    first.converge()
    first.launcher.started[0].ready = Poll.pending()
    second = Harness(store=first.store, launcher=first.launcher)
    second.manager.reconcile_once()
    assert second.call("routing_table", -1) is None
    second.clock.advance(31.0)  # RECOVERY_WAIT_S
    second.manager.reconcile_once()
    table = second.call("routing_table", -1)
    assert table is not None and table.deployments["demo"].replicas == ()  # said as it is: none ready


def test_deployed_alongside_an_autoscaled_deployment_counts_at_its_current_target_and_warn_is_no_refusal() -> None:
    h = Harness()
    scaling = {"min_replicas": 1, "max_replicas": 4}
    h.call("apply", spec(name="a", replicas=3, autoscaling=scaling))  # running at 3 of the 4 GPUs
    # Applied again with new bounds and no replicas (its min, 1), it keeps its target of 3:
    again = spec(name="a", autoscaling={**scaling, "target_ongoing_requests": 4})
    assert again.replicas == 1
    refused = h.call("plan", spec(name="b", gpus=2), (again,))
    assert not refused.budget_ok and "needs 5 GPUs" in refused.error, refused
    # A spend limit that only warns: over it, yet apply would go ahead, so no error to refuse on.
    warn = spec(name="w", budget={"max_spend_per_hour_usd": 0.01, "on_exceeded": "warn"})
    plan = h.call("plan", warn, (again,))
    assert not plan.budget_ok and plan.error is None, plan
    assert h.call("apply", warn).warnings


def test_a_restarted_manager_lists_a_deployment_scaled_to_zero_and_stops_one_it_refuses() -> None:
    import json

    first = Harness()
    first.call("apply", spec(name="idle", replicas=0))
    first.call("apply", spec(name="old"))
    first.converge()
    record = json.loads(first.store._blob["old"])  # a spec an older version accepted, this one refuses
    record["spec"]["runtime_config"]["extra_engine_args"] = {"enable_lora": True}
    first.store._blob["old"] = json.dumps(record)
    second = Harness(store=first.store, launcher=first.launcher)  # starts: the bad record does not stop it
    second.manager.reconcile_once()
    table = second.call("routing_table", -1)
    assert table is not None and "idle" in table.deployments  # routers find it, and start it on demand
    assert "old" not in table.deployments
    # Its replica, which nothing routes to or manages, is stopped as a removal's (it ran on
    # unmanaged, holding its GPU and its name, until `atomr down`), and status says why.
    refused = second.call("status", "old")
    assert refused.removing and "refuses its stored spec" in refused.last_failure, refused
    assert "enable_lora" in refused.last_failure
    from atomr_infer.cli.render import failure_line

    assert failure_line(refused).endswith("being stopped; `atomr deploy` a corrected spec to deploy it again")
    (old_replica,) = [h for h in first.launcher.started if h.actor_name == "atomr:old:r0"]
    second.converge()
    assert old_replica.stopped and second.call("status", "old") is None
    assert "old" not in second.store.load()
    second.call("apply", spec(name="old"))  # a corrected spec: applied and started as any other
    second.converge()
    assert second.call("status", "old").replicas_ready == 1


def test_a_refused_specs_adopted_replicas_are_drained_not_killed_and_a_ray_error_stops_nothing() -> None:
    import json

    from .fakes import Poll

    first = Harness()
    first.call("apply", spec(name="old"))
    first.call("apply", spec(name="good"))
    first.converge()
    record = json.loads(first.store._blob["old"])
    record["spec"]["runtime_config"]["extra_engine_args"] = {"enable_lora": True}
    first.store._blob["old"] = json.dumps(record)
    for handle in first.launcher.started:  # a restarted manager has not heard them answer ready() yet
        handle.ready = Poll.pending()
    adopting_fails_for(first.launcher, "good")
    second = Harness(store=first.store, launcher=first.launcher)
    second.manager.reconcile_once()
    old, good = ([h for h in first.launcher.started if h.actor_name == f"atomr:{n}:r0"][0] for n in ("old", "good"))
    assert old.draining and not old.stopped  # it may serve a router's cached table: what it runs ends
    assert not (good.draining or good.stopped)  # nothing against its spec: not stopped


def test_wait_ready_returns_once_a_deployment_has_failed() -> None:
    """It waited out its whole timeout (600 s by default) on a deployment that gave up."""
    h = Harness()
    h.call("apply", spec())
    for _ in range(3):  # a start failure that recurs: the manager gives up after 3
        h.manager.reconcile_once()
        h.launcher.started[-1].ready = Poll.failed("ValueError: max_model_len too large", recurring=True)
        h.manager.reconcile_once()
        h.clock.advance(120.0)


    async def wait():  # well before its own timeout (600 s): it waited all of it
        try:
            return await asyncio.wait_for(h.manager.wait_ready("demo", 600.0), 10.0)
        finally:
            h.manager._loop_task.cancel()

    status = asyncio.run(wait())
    assert status.failed and not status.converged and "max_model_len" in status.last_failure


def test_status_says_when_every_replica_has_the_specs_adapters_loaded_or_failed() -> None:
    """``atomr deploy --wait`` and ``wait_ready`` said ready while an adapter was still loading,
    at once after an in-place change (before any replica heard of it), and with one failed."""
    h = Harness()
    h.call("apply", spec(replicas=2, lora={"adapters": {"pirate": "/srv/pirate-v1"}}))
    h.converge()
    status = h.call("status", "demo")
    assert status.converged and status.adapters_settled and status.failed_adapters == {}
    h.call("apply", spec(replicas=2, lora={"adapters": {"pirate": "/srv/pirate-v2"}}))  # in place
    h.manager.reconcile_once()  # converged: an in-place change starts no replica
    status = h.call("status", "demo")
    assert status.converged and not status.adapters_settled  # no replica asked for the new source yet
    first = h.launcher.started[0]
    first.states = {"pirate": "reloading"}
    h.converge()
    assert not h.call("status", "demo").adapters_settled
    first.states = {"pirate": "failed: OSError: no such file"}
    status = h.call("status", "demo")
    assert status.adapters_settled and status.failed_adapters == {"pirate": "OSError: no such file"}


def test_an_unchanged_apply_has_the_replicas_retry_the_adapters_they_failed_at_once() -> None:
    """`atomr deploy` says "fix lora.adapters and deploy again"; the apply of the same spec was
    "unchanged" and the replicas retried only after their backoff (up to 5 min)."""
    adapters = {"pirate": "/srv/pirate", "robot": "/srv/robot"}
    h = Harness()
    h.call("apply", spec(replicas=2, lora={"adapters": adapters}))
    h.converge()
    first, second = h.launcher.started
    first.states = {"robot": "failed: OSError: no such file"}
    again = h.call("apply", spec(replicas=2, lora={"adapters": adapters}))
    assert (again.changed, again.generation, again.actions) == (False, 1, ("retry the adapters that failed to load "
                                                                            "(robot)",))
    status = h.call("status", "demo")
    assert not status.adapters_settled  # `deploy --wait` waits for the retry's answer, not the failure before it
    route = next(r for r in h.manager._table.find("demo").replicas if r.actor_name == first.actor_name)
    assert "robot" in route.adapters_loading and route.adapters_failed == ()  # routers wait for it, not fail
    first.states = {"robot": "loading"}  # the replica heard the retry: its backoff cleared
    h.converge()
    assert first.retry == second.retry == 1 and not h.call("status", "demo").adapters_settled
    first.states = {}  # loaded
    assert h.call("status", "demo").adapters_settled
    assert h.call("apply", spec(replicas=2, lora={"adapters": adapters})).actions == ("unchanged",)


def test_a_roll_with_one_gpu_to_spare_keeps_surging_while_the_old_replicas_drain(monkeypatch) -> None:
    """The room for a surge was read again every pass: once the first new replica took the spare
    GPU (and the old one it replaced still held its own, draining), the roll turned stop-first and
    stopped the last old replica at once: one replica served until the next one started."""
    from atomr_infer.control import placement

    h = Harness()
    h.call("apply", spec(replicas=2))
    h.converge()
    free = {"n0": {"GPU": 1.0, "CPU": 4.0}}  # one GPU to spare
    monkeypatch.setattr(placement, "free_resources_by_node", lambda: free)
    h.call("apply", spec(replicas=2, model="org/other"))
    h.manager.reconcile_once()
    assert h.live() == ["atomr:demo:r0", "atomr:demo:r1", "atomr:demo:r2"]  # the surge replica
    free["n0"]["GPU"] = 0.0  # it took the spare GPU
    h.launcher.make_ready()
    h.manager.reconcile_once()  # r2 ready: r0 drains, still holding its GPU
    h.manager.reconcile_once()
    old = {handle.actor_name: handle for handle in h.launcher.started}
    assert old["atomr:demo:r0"].draining and not old["atomr:demo:r1"].draining  # r1 serves on
    assert "atomr:demo:r3" in old  # the next new replica waits for r0's GPU instead


def test_every_apply_is_counted_the_retry_of_a_failed_one_too() -> None:
    """``atomr_manager_applies_total``: applying a failed deployment again (the way to retry it)
    changed it but was not counted, nor was an apply refused while the manager recovers."""
    from atomr_infer.control.recovery import NotRecoveredYet

    h = Harness()
    counted: list[tuple[str, str]] = []
    h.manager._metrics.applied = lambda name, result: counted.append((name, result))
    failed(h)
    retried = h.call("apply", spec())
    assert retried.changed and retried.actions[0].startswith("retry after failure")

    def not_recovered(name: str) -> None:
        raise NotRecoveredYet(name)

    h.manager._recovery.check = not_recovered
    with pytest.raises(NotRecoveredYet):
        h.call("apply", spec())
    assert counted == [("demo", "changed"), ("demo", "changed"), ("demo", "rejected")]


def test_while_a_node_is_down_an_apply_that_asks_no_more_gpus_goes_ahead_and_plan_says_so() -> None:
    """4 replicas on 4 GPUs, then a 2-GPU node is lost: applying only serving.max_concurrent was
    refused (needs 4 GPUs, 2 available), and so was any other deployment's apply, exactly when an
    operator wants to change rate limits. An apply that asks for more GPUs is still refused."""
    h = Harness()
    h.call("apply", spec(replicas=4))
    h.call("apply", spec(name="cpu", device="cpu"))
    h.converge()
    h.manager._cluster_override = ClusterView(total_gpus=2, accelerator_type="L4", gpu_memory_bytes=24 << 30)
    in_place = spec(replicas=4, serving={"max_concurrent": 8})
    plan = h.call("plan", in_place)
    assert plan.error is None and "the cluster has 2 GPUs, fewer than the 4" in plan.budget, plan  # warn, not refuse
    applied = h.call("apply", in_place)
    assert applied.changed and applied.actions == ("update in place (serving.max_concurrent: 32 → 8)",)
    assert "asks for no more than it held (4)" in applied.warnings[0], applied
    other = h.call("apply", spec(name="cpu", device="cpu", serving={"max_concurrent": 8}))
    assert other.changed and "the cluster has 2 GPUs" in other.warnings[0]
    assert h.call("apply", spec(replicas=3, serving={"max_concurrent": 8})).actions == ("scale 4 → 3",)
    more = spec(replicas=4, serving={"max_concurrent": 8})
    assert "needs 4 GPUs, 2 GPUs available" in h.call("plan", more).error
    with pytest.raises(BudgetExceeded, match="needs 4 GPUs, 2 GPUs available"):
        h.call("apply", more)
    with pytest.raises(BudgetExceeded, match="needs 4 GPUs"):  # a new GPU deployment asks for more
        h.call("apply", spec(name="new"))
    assert h.call("status", "demo").generation == 3  # the refused ones changed nothing


def test_a_cpu_deployment_that_a_gpu_node_joining_would_move_onto_gpus_is_refused_as_before() -> None:
    """device: auto on 4 CPU replicas, then a one-GPU node joins: a model change asks for 4 GPUs it
    never held; it went ahead as if a node had been lost (3 replicas waiting for GPUs for good)."""
    h = Harness()
    h.manager._cluster_override = ClusterView(total_gpus=0)
    h.call("apply", spec(replicas=4, device="auto"))
    h.converge()
    h.manager._cluster_override = ClusterView(total_gpus=1, accelerator_type="L4", gpu_memory_bytes=24 << 30)
    with pytest.raises(BudgetExceeded, match="needs 4 GPUs, 1 GPUs available"):
        h.call("apply", spec(replicas=4, device="auto", model="org/other"))


def failed(h: Harness) -> None:
    """``demo`` applied, then failed for good: recurring start failures, three in a row."""
    h.call("apply", spec())
    for _ in range(3):
        h.manager.reconcile_once()
        h.launcher.started[-1].ready = Poll.failed("ValueError: max_model_len too large", recurring=True)
        h.manager.reconcile_once()
        h.clock.advance(120.0)
    assert h.call("status", "demo").state == "failed"


def test_plan_of_a_failed_deployment_applied_again_says_it_retries_as_apply_does() -> None:
    """``atomr deploy --dry-run`` said 'unchanged' for the same spec of a failed deployment, while
    the deploy itself retries it."""
    h = Harness()
    failed(h)
    plan = h.call("plan", spec())
    assert plan.changed and plan.actions == ("retry after failure (r2 failed to start: ValueError: max_model_len too "
                                             "large)",), plan
    assert h.call("status", "demo").state == "failed"  # the plan changed nothing
    applied = h.call("apply", spec())
    assert (applied.changed, applied.actions) == (plan.changed, plan.actions)
    assert h.call("plan", spec()).actions == ("unchanged",)  # retrying now: nothing more to do


def placed_on(h: Harness, gpus: int) -> None:
    """Ray's side of a pass on a cluster of ``gpus`` one-GPU slots: a starting replica is placed
    (and is ready) while a GPU is free, else it says it is not placed (``waiting_for``, as the Ray
    handle says it); a draining replica holds its GPU until it is stopped."""
    used = sum(1 for x in h.launcher.started if not x.stopped and x.ready.done and x.ready.ok)
    for x in h.launcher.started:
        if x.stopped or x.ready.done:
            continue
        if used < gpus:
            x.ready, x.unplaced, used = Poll.success(), None, used + 1
        else:
            x.unplaced = "not placed by Ray for 31s: no node has 1 GPU free"
    for x in h.launcher.started:
        if x.draining:
            x.drained = Poll.success()


def test_a_scale_up_mid_roll_that_takes_the_spare_gpu_turns_the_roll_stop_first() -> None:
    """4 GPUs, 3 replicas rolling with a surge replica; the autoscaler went to 4 (4 <= 4 GPUs, its
    cap was right), and the roll still wanted its surge on top: a 5th replica waited for a GPU for
    good, the old replicas held theirs, and the roll never finished (observed_generation stayed 1)."""
    h = Harness()  # four GPUs
    scaling = {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 4, "upscale_delay_s": 2,
               "downscale_delay_s": 600}
    h.call("apply", spec(replicas=3, autoscaling=scaling))
    h.converge()
    h.call("apply", spec(replicas=3, autoscaling=scaling, model="org/other"))
    h.manager.reconcile_once()
    assert h.live() == ["atomr:demo:r0", "atomr:demo:r1", "atomr:demo:r2", "atomr:demo:r3"]  # the surge replica
    for _ in range(30):
        placed_on(h, 4)
        for x in h.launcher.started:
            x.load = 5  # 15 and more in flight over 3 replicas: the autoscaler wants 4
        h.clock.advance(1.0)
        h.manager.reconcile_once()
        assert sum(1 for x in h.launcher.started if not x.stopped) <= 4  # no replica started without a GPU
    status = h.call("status", "demo")
    assert status.replicas_desired == 4 and status.observed_generation == status.generation == 2
    assert [r.generation for r in status.replicas if r.state == "ready"] == [2, 2, 2, 2]


def test_a_roll_that_loses_a_node_finishes_stop_first_on_the_gpus_left() -> None:
    """2 nodes x 2 GPUs, 3 replicas rolling with a surge replica; the node holding an old replica
    and the surge replica was lost. The roll kept surging (decided once, on 4 GPUs), its new
    replicas waited for GPUs the old ones held, and it stayed stuck while the node was gone."""
    h = Harness()  # four GPUs
    h.call("apply", spec(replicas=3))
    h.converge()
    h.call("apply", spec(replicas=3, model="org/other"))
    h.manager.reconcile_once()
    by_name = {x.actor_name: x for x in h.launcher.started}
    assert list(by_name) == ["atomr:demo:r0", "atomr:demo:r1", "atomr:demo:r2", "atomr:demo:r3"]
    h.manager._cluster_override = ClusterView(total_gpus=2, accelerator_type="L4", gpu_memory_bytes=24 << 30)
    by_name["atomr:demo:r1"].health = Poll.failed("actor died: node lost")
    by_name["atomr:demo:r3"].ready = Poll.failed("actor died: node lost")
    for _ in range(60):
        h.clock.advance(1.0)
        h.manager.reconcile_once()
        placed_on(h, 2)
        assert sum(1 for x in h.launcher.started if x.draining and not x.stopped) <= 1  # one old replica at a time
        assert h.call("status", "demo").replicas_ready >= 1  # it serves throughout
    status = h.call("status", "demo")
    live = [r for r in status.replicas if r.state in ("starting", "ready")]
    assert all(r.generation == 2 for r in live)  # the roll finished: no old replica is left
    assert [r.state for r in live] == ["ready", "ready", "starting"]  # the third waits for the node
    assert live[2].reason.startswith("not placed by Ray")
