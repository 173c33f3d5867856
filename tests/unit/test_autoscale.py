"""Autoscaling: the decision rule alone, then through the manager with its fakes (the replicas'
in-flight counts are what their health checks would say). The real flow, with a vLLM engine,
is in tests/integration/test_autoscaling.py."""

from __future__ import annotations

import pytest

from atomr_infer.cli.render import scaling_line
from atomr_infer.control.autoscale import Autoscaler
from atomr_infer.control.budget import ClusterView, scale_cap
from atomr_infer.control.replicas import Poll
from atomr_infer.errors import BudgetExceeded
from atomr_infer.spec import Autoscaling, Deployment

from .test_manager import Harness, spec

CFG = Autoscaling(min_replicas=1, max_replicas=4, target_ongoing_requests=4, upscale_delay_s=3, downscale_delay_s=10)


def unlimited(n: int) -> tuple[int, str | None]:
    return n, None


def test_scales_up_only_once_the_load_held_for_the_delay() -> None:
    a = Autoscaler(1)
    assert a.decide(CFG, in_flight=16, now=0.0, cap=unlimited) is None
    assert a.decide(CFG, in_flight=16, now=2.9, cap=unlimited) is None
    decision = a.decide(CFG, in_flight=16, now=3.0, cap=unlimited)
    assert decision is not None and (decision.from_replicas, decision.to_replicas, decision.direction) == (1, 4, "up")
    assert "load 16" in decision.reason and a.target == 4


def test_a_want_that_falls_back_restarts_the_delay() -> None:
    """Ray Serve's decision counter: a pass whose mean wants the current count starts it over."""
    cfg = CFG.model_copy(update={"look_back_period_s": 1})  # the mean is about the last look
    a = Autoscaler(1)
    a.decide(cfg, in_flight=9, now=0.0, cap=unlimited)
    a.decide(cfg, in_flight=2, now=2.0, cap=unlimited)
    a.decide(cfg, in_flight=9, now=3.0, cap=unlimited)  # the mean of the last second was 2: wants 1
    assert a.decide(cfg, in_flight=9, now=4.0, cap=unlimited) is None  # it wants 3 again: from here
    assert a.decide(cfg, in_flight=9, now=7.0, cap=unlimited).to_replicas == 3


def drive(a: Autoscaler, cfg: Autoscaling, loads: list[int]) -> list[tuple[int, int, int]]:
    """One look a second at ``loads``; the decisions as (second, from, to)."""
    moves = []
    for t, load in enumerate(loads):
        d = a.decide(cfg, in_flight=load, now=float(t), cap=unlimited)
        if d is not None:
            moves.append((t, d.from_replicas, d.to_replicas))
    return moves


def test_a_dip_does_not_restart_the_delay() -> None:
    """One look of an idle moment in a steady load (a health answer between two bursts) started
    the delay over: under a noisy load it never ran out, and the deployment never scaled up."""
    cfg = CFG.model_copy(update={"upscale_delay_s": 30})  # look_back_period_s: 30, Ray Serve's default
    loads = [16] * 40
    loads[20] = 0
    assert drive(Autoscaler(1), cfg, loads) == [(30, 1, 4)]


def test_a_noisy_load_scales_to_what_its_mean_wants() -> None:
    """Looks of 12 and 2 by turns, a mean of 7 on 1 replica at 4 each: 2 replicas after the delay.
    One look at a time wanted 3, then 1: the delay started over every second and it stayed at 1
    (and where a delay ran out, it went to whatever the last look wanted)."""
    cfg = CFG.model_copy(update={"upscale_delay_s": 10})
    a = Autoscaler(1)
    assert drive(a, cfg, [12, 2] * 30) == [(10, 1, 2)]
    assert "load 7 over 1 replica(s)" in a.last.reason and a.report(cfg, now=59.0)["load"] == 7


def test_a_burst_does_not_hold_off_a_scale_down() -> None:
    """3 replicas idle but for one busy second: they go down to 1 after the downscale delay; the
    burst's one look wanted 4 and started the delay over."""
    loads = [0] * 15
    loads[5] = 20
    assert drive(Autoscaler(3), CFG, loads) == [(10, 3, 1)]


def test_scales_down_after_the_downscale_delay_never_below_min() -> None:
    a = Autoscaler(3)
    assert a.decide(CFG, in_flight=0, now=0.0, cap=unlimited) is None
    assert a.decide(CFG, in_flight=0, now=9.0, cap=unlimited) is None
    decision = a.decide(CFG, in_flight=0, now=10.0, cap=unlimited)
    assert (decision.to_replicas, decision.direction) == (1, "down") and "no load" in decision.reason


def test_from_zero_a_waiting_request_starts_one_at_once() -> None:
    cfg = CFG.model_copy(update={"min_replicas": 0})
    a = Autoscaler(0)
    assert a.decide(cfg, in_flight=0, now=0.0, cap=unlimited) is None
    a.report_waiting("router-1", 1, now=5.0)
    decision = a.decide(cfg, in_flight=0, now=5.0, cap=unlimited)
    assert decision.to_replicas == 1 and decision.reason.startswith("cold start")
    # A report counts for DEMAND_FRESH_S only: a router that stopped waiting stops counting.
    assert a.waiting(now=6.0) == 1 and a.waiting(now=8.0) == 0


def test_a_cold_start_is_not_undone_by_the_idle_time_before_it() -> None:
    """The mean after a cold start still held the idle look-back before it: with downscale_delay_s
    under look_back_period_s, the replicas still starting for the requests waiting were scaled
    down again (0 -> 5, then 5 -> 2 at 11 s, then back to 5)."""
    cfg = CFG.model_copy(update={"min_replicas": 0, "max_replicas": 8, "target_ongoing_requests": 2,
                                 "downscale_delay_s": 10, "look_back_period_s": 30})
    a = Autoscaler(0)
    decisions = []
    for t in range(0, 60):  # ten requests wait for replicas that take a minute to start
        if t >= 20:
            a.report_waiting("router-1", 10, now=float(t))
        decisions.append(a.decide(cfg, in_flight=0, now=float(t), cap=unlimited))
    moves = [(d.from_replicas, d.to_replicas) for d in decisions if d is not None]
    assert moves == [(0, 5)] and a.target == 5


def test_the_budget_stops_scaling_short_and_says_why() -> None:
    a = Autoscaler(1)
    a.decide(CFG, in_flight=16, now=0.0, cap=lambda n: (2, "3 replicas would exceed the budget: gpus 3 of 2 GPUs"))
    decision = a.decide(CFG, in_flight=16, now=3.0, cap=lambda n: (2, "3 replicas would exceed the budget: gpus"))
    assert decision.to_replicas == 2 and "stopped short of 4" in decision.reason
    assert a.limited and "exceed the budget" in a.limited
    # At the cap: no decision, the reason stays.
    assert a.decide(CFG, in_flight=16, now=9.0, cap=lambda n: (2, "over")) is None
    assert a.decide(CFG, in_flight=16, now=12.0, cap=lambda n: (2, "over")) is None and a.limited == "over"


def test_scale_cap_counts_gpus_and_spend() -> None:
    cluster = ClusterView(total_gpus=4, accelerator_type="L4")
    dep = spec(replicas=1, autoscaling={"max_replicas": 8}, budget={"max_spend_per_hour_usd": 2.0})
    other = spec(name="other", replicas=1)
    # 4 GPUs, 1 held by another: 3 fit; at $0.80 per L4-hour, $2/hour allows 2.
    allowed, why = scale_cap(dep, [other], cluster, current=1, wanted=8)
    assert allowed == 2 and "3 replicas would exceed the budget" in why and "budget.max_spend_per_hour_usd" in why
    no_budget = dep.model_copy(update={"budget": None})
    allowed, why = scale_cap(no_budget, [other], cluster, current=1, wanted=8)
    assert allowed == 3 and "gpus 5 of 4 GPUs" in why


def autoscaled(**kw) -> Deployment:
    # A look-back of one pass: these tests are about the manager's part, the smoothing is above.
    scaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 4, "upscale_delay_s": 2,
               "downscale_delay_s": 5, "look_back_period_s": 1, **kw}
    return spec(autoscaling=scaling)


def set_load(h: Harness, load: int) -> None:
    for handle in h.launcher.started:
        handle.load = load


def test_manager_scales_up_with_load_and_back_down_draining_first() -> None:
    h = Harness()
    h.call("apply", autoscaled())
    h.converge()
    assert h.live() == ["atomr:demo:r0"]
    set_load(h, 16)
    h.converge(passes=6)
    status = h.call("status", "demo")
    assert h.live() == ["atomr:demo:r0", "atomr:demo:r1"] and status.replicas_desired == 2
    assert status.autoscaling["last_decision"]["to_replicas"] == 2 and status.state == "ready"
    shown = scaling_line(status)  # what `atomr status` prints under the table
    assert "demo: autoscaling 1-2: target 2 replica(s), load 16 (4 per replica)" in shown, shown
    assert "last: 1 → 2 at" in shown and "load 16 over 1 replica(s)" in shown, shown
    set_load(h, 0)
    h.converge(passes=3)
    assert len(h.live()) == 2  # the downscale delay has not passed
    h.converge(passes=6)
    assert h.live() == ["atomr:demo:r0"]  # the newest went, and it drained first
    assert h.launcher.started[1].draining and h.launcher.started[1].stopped
    assert h.call("status", "demo").autoscaling["last_decision"]["to_replicas"] == 1


def test_manager_stops_at_the_gpu_budget_and_says_so_in_status() -> None:
    h = Harness()
    h.call("apply", spec(name="big", replicas=3))  # 3 of the 4 GPUs
    h.call("apply", autoscaled(max_replicas=4))
    h.converge()
    set_load(h, 40)
    h.converge(passes=6)
    status = h.call("status", "demo")
    assert status.replicas_desired == 1 and len(h.live()) == 1
    assert "gpus 5 of 4 GPUs" in status.autoscaling["limited_by_budget"]


def test_manager_scales_to_zero_and_a_waiting_request_cold_starts_it() -> None:
    h = Harness()
    h.call("apply", autoscaled(min_replicas=0))
    h.converge()
    status = h.call("status", "demo")
    assert h.live() == [] and status.state == "idle"
    h.call("report_demand", "router-a", "demo", 1)
    h.manager.reconcile_once()
    status = h.call("status", "demo")
    assert status.state == "cold-start" and status.replicas_desired == 1 and len(h.live()) == 1
    h.converge(passes=2)
    assert h.call("status", "demo").state == "ready"
    h.converge(passes=8)  # no load for longer than the downscale delay
    assert h.live() == [] and h.call("status", "demo").state == "idle"


def test_the_autoscaled_count_survives_a_manager_restart() -> None:
    h = Harness()
    h.call("apply", autoscaled())
    h.converge()
    set_load(h, 16)
    h.converge(passes=6)
    restarted = Harness(store=h.store, launcher=h.launcher)
    assert restarted.call("status", "demo").replicas_desired == 2
    restarted.converge()
    assert len(restarted.launcher.started) == 2  # both re-adopted, none started


def scaled_to_4(h: Harness) -> None:
    h.call("apply", autoscaled(max_replicas=4))
    h.converge()
    set_load(h, 40)
    h.converge(passes=6)
    assert h.call("status", "demo").replicas_desired == 4


def test_apply_checks_the_budget_of_the_replicas_the_autoscaler_runs() -> None:
    """Scaled to 4 on 4 GPUs, 2 GPUs a replica needs 8: refused (the check counted the starting
    ``replicas``, 1, and the roll then stalled with no GPU to surge into); so is a spend budget
    the 4 running replicas are over. Nothing changes."""
    h = Harness()
    scaled_to_4(h)
    wider = autoscaled(max_replicas=4).model_copy(update={"gpus": 2})
    plan = h.call("plan", wider)
    assert not plan.budget_ok and "8 of 4 GPUs" in plan.budget and plan.actions == ("roll 4 replicas (gpus: 1 → 2)",)
    with pytest.raises(BudgetExceeded, match=r"gpus 2 x replicas 4 \(autoscaled\).*lower autoscaling.max_replicas"):
        h.call("apply", wider)
    capped = autoscaled(max_replicas=4).model_copy(update={"budget": {"max_spend_per_hour_usd": 1.0}})
    with pytest.raises(BudgetExceeded, match=r"3\.2 USD/hour"):
        h.call("apply", capped)
    assert h.call("status", "demo").generation == 1 and h.call("status", "demo").replicas_desired == 4
    narrower = autoscaled(max_replicas=2).model_copy(update={"gpus": 2})  # 2 x 2 GPUs fit
    assert h.call("apply", narrower).actions == ("roll 2 replicas (gpus: 1 → 2)",
                                                 "scale 4 → 2 (autoscaling.max_replicas: 4 → 2)")


def test_a_deployment_that_scales_from_zero_must_fit_one_replica() -> None:
    h = Harness()
    never_fits = autoscaled(min_replicas=0).model_copy(update={"gpus": 8})
    assert not h.call("plan", never_fits).budget_ok
    with pytest.raises(BudgetExceeded, match="8 of 4|needs 8 GPUs"):  # its first request would wait, then 503
        h.call("apply", never_fits)
    assert h.call("status", "demo") is None


def test_plan_says_what_runs_when_autoscaled() -> None:
    h = Harness()
    scaled_to_4(h)
    start_at_2 = autoscaled(max_replicas=4, min_replicas=2).model_copy(update={"replicas": 2})
    (action,) = h.call("plan", start_at_2).actions  # not "scale 1 → 2": 4 run, and keep running
    assert action.startswith("update in place") and "replicas: 1 → 2 (the starting count; the autoscaler runs 4)" in (
        action)
    assert h.call("plan", spec()).actions == ("scale 4 → 1 (autoscaling off)",)  # it said "update in place"
    h.call("apply", spec())
    h.converge()
    assert len(h.live()) == 1


def test_a_replica_that_fails_to_start_stops_scaling_up_not_down() -> None:
    """A scale-up replica failed for good: the deployment failed, and the autoscaler stopped
    altogether, so the one replica it had never scaled to zero. Now it scales down as the load
    falls, and once what failed is no longer wanted a later scale-up tries again."""
    h = Harness()
    h.call("apply", autoscaled(min_replicas=0, max_replicas=2))
    h.call("report_demand", "router-a", "demo", 1)
    h.converge(passes=2)
    set_load(h, 16)
    for _ in range(40):
        h.manager.reconcile_once()
        for handle in h.launcher.started[1:]:
            if not handle.ready.done:
                handle.ready = Poll.failed("ValueError: not enough memory", recurring=True)
        h.clock.advance(1.0)
    status = h.call("status", "demo")
    assert status.failed and status.replicas_desired == 2 and status.replicas_ready == 1
    set_load(h, 0)
    h.converge(passes=20)
    status = h.call("status", "demo")
    assert status.replicas_desired == 0 and h.live() == [] and not status.failed
    assert "not enough memory" in status.last_failure  # still said, until a replica starts


def test_new_bounds_that_move_the_target_are_a_decision_status_shows():
    h = Harness()
    scaled_to_4(h)
    h.call("apply", autoscaled(max_replicas=2))
    last = h.call("status", "demo").autoscaling["last_decision"]
    assert (last["from_replicas"], last["to_replicas"]) == (4, 2) and "bounds changed to 1-2" in last["reason"]


def test_autoscaling_turned_on_starts_at_the_specs_replicas_and_is_budgeted_there():
    """Plan and the budget counted the old count (1) while the autoscaler started at the new
    ``replicas`` (3 x 2 GPUs on 4): accepted, it ran 6 GPUs."""
    h = Harness()
    h.call("apply", spec())
    h.converge()
    on = autoscaled(max_replicas=8).model_copy(update={"replicas": 3})
    assert h.call("plan", on).actions[0] == "scale 1 → 3 (autoscaling on)"
    with pytest.raises(BudgetExceeded, match="needs 6 GPUs"):
        h.call("apply", on.model_copy(update={"gpus": 2}))
    h.call("apply", on)
    h.manager.reconcile_once()  # (idle, it scales down after downscale_delay_s)
    assert len(h.live()) == 3 and h.call("status", "demo").replicas_desired == 3
