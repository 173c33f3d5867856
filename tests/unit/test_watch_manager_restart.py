"""``atomr deploy`` (which waits) while Ray restarts the manager: the rollout goes on, and so does
the wait. It gave up on the first Ray error ("lost track of the rollout: <Ray's text>", exit 1),
took a deployment the restarted manager had not recovered yet for a failed one, and a call that
met the restart said "the atomr manager died ... `atomr up` restarts it"."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError, RayTaskError

from atomr_infer.cli import common, deploy, watch
from atomr_infer.control import client
from atomr_infer.control.recovery import NotRecoveredYet
from atomr_infer.status import DeploymentStatus

STARTING = DeploymentStatus("demo", "m", 1, 0, 1, 0)
NOT_RECOVERED = DeploymentStatus("demo", "m", 1, 1, 1, 0, recovering=True, last_failure=(
    "not recovered yet after a manager restart: its replicas could not be looked up (GetTimeoutError: …)"))
READY = DeploymentStatus("demo", "m", 1, 1, 1, 1)
RESTARTING = ActorUnavailableError("The actor is temporarily unavailable: the actor is restarting.", None)
UNREAD = RayTaskError("status", "Traceback (most recent call last):\n  File manager.py", NotRecoveredYet(
    "the atomr manager restarted and cannot read its stored state yet (ConnectionError: GCS unavailable); it "
    "tries again every second: try again shortly")).as_instanceof_cause()


@pytest.fixture
def manager(monkeypatch):
    """A manager handle whose status calls answer (or raise) what ``answers(...)`` lists, in turn."""
    polls: list[object] = []

    def answers(*results: object) -> SimpleNamespace:
        def get(refs, timeout=None):
            result = results[min(len(polls), len(results) - 1)]
            polls.append(result)
            if isinstance(result, BaseException):
                raise result
            return [result]

        monkeypatch.setattr(ray, "get", get)
        return SimpleNamespace(status=SimpleNamespace(remote=lambda name: name), polls=polls)

    monkeypatch.setattr(watch, "POLL_S", 0.0)
    monkeypatch.setattr(common, "replica_stats", lambda replicas, timeout_s=1.0: {})
    monkeypatch.setattr(common, "waiting_reasons", lambda replicas, stats: {})
    return answers


def test_the_wait_follows_the_rollout_through_a_manager_restart(manager, capsys) -> None:
    handle = manager(STARTING, RESTARTING, RayActorError(), GetTimeoutError(), UNREAD, NOT_RECOVERED, READY)
    outcome = watch.wait_for(handle, ["demo"], timeout_s=600)
    assert (outcome.ready, outcome.failed, outcome.pending) == (["demo"], {}, [])
    said = capsys.readouterr().out
    assert "waiting: the atomr manager is restarting\n" in said
    assert "waiting: the atomr manager died; waiting for Ray to restart it" in said
    assert "waiting: the atomr manager did not answer within 30s" in said
    assert "waiting: the atomr manager restarted and cannot read its stored state yet" in said
    assert "not recovered yet" not in said and len(handle.polls) == 7


def test_a_manager_still_restarting_when_the_time_runs_out_is_a_timeout_that_says_so(manager, capsys) -> None:
    handle = manager(STARTING, RESTARTING)
    code = deploy._wait(SimpleNamespace(handle=handle), ["demo"], timeout=0.001)
    assert code == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: deployment 'demo' not ready after 0.001s (the atomr manager is restarting) "), line
    assert "lost track" not in line and "keeps starting in the background" in line


def test_a_call_that_meets_the_restart_is_retryable_and_says_the_manager_is_restarting(monkeypatch) -> None:
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: (_ for _ in ()).throw(RESTARTING))
    with pytest.raises(client.ManagerRestarting) as raised:
        client.call("a ref")
    assert raised.value.retryable and "atomr up" not in str(raised.value)
    assert str(raised.value) == "the atomr manager is restarting; try again shortly"
