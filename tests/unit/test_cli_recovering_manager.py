"""The CLI against a manager that restarted and cannot list its deployments yet (its stored state
unread: a head whose GCS has just come back). ``atomr down`` listed none, removed nothing, killed
the manager, said all was stopped, and left the replicas running on their GPUs; now it waits for
the manager to list them, and stops nothing (the API neither) if it cannot."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from atomr_infer.cli import common, lifecycle
from atomr_infer.cli.main import app
from atomr_infer.control import client
from atomr_infer.control.plan import ApplyResult
from atomr_infer.control.recovery import NotRecoveredYet
from atomr_infer.status import DeploymentStatus, ReplicaState, ReplicaStatus

REPLICA = ReplicaStatus("r0", "atomr:demo:r0", ReplicaState.READY, 1)


class RecoveringManager:
    """Refuses to list (``NotRecoveredYet``) ``unread`` times, then lists ``demo`` until it is removed."""

    def __init__(self, unread: int) -> None:
        self.unread, self.removed, self.handle = unread, [], "the manager's handle"

    def list(self) -> list[DeploymentStatus]:
        if self.unread:
            self.unread -= 1
            raise NotRecoveredYet("the atomr manager restarted and cannot read its stored state yet (ConnectionError: "
                                  "GCS unavailable); it tries again every second: try again shortly")
        return [] if self.removed else [DeploymentStatus("demo", "m", 1, 1, 1, 1, (REPLICA,))]

    def status(self, name: str) -> DeploymentStatus | None:
        return next((s for s in self.list() if s.name == name), None)

    def remove(self, name: str) -> ApplyResult:
        self.removed.append(name)
        return ApplyResult(name, True, 2, ("drain and stop 1 replica",))


@pytest.fixture
def cluster(monkeypatch):
    """A cluster atomr did not start, its manager a ``RecoveringManager``; what was stopped, recorded."""
    import ray

    stopped: list[str] = []
    monkeypatch.setattr(lifecycle, "RETRY_S", 0.01, raising=False)
    monkeypatch.setattr(common, "connect", lambda *args, **kwargs: None)
    monkeypatch.setattr(lifecycle, "_stop_api", lambda: stopped.append("api"))
    monkeypatch.setattr(lifecycle, "_atomrs_head", lambda address: False)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="10.0.0.9:6379"))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: (_ for _ in ()).throw(ValueError(name)))
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: stopped.append(actor))

    def with_manager(manager: RecoveringManager) -> list[str]:
        monkeypatch.setattr(client.ControlPlane, "connect", classmethod(lambda cls, *args, **kwargs: manager))
        return stopped

    return with_manager


def test_down_waits_for_a_recovering_manager_to_list_its_deployments_and_removes_them(cluster) -> None:
    manager = RecoveringManager(unread=3)
    stopped = cluster(manager)
    result = CliRunner().invoke(app, ["down", "--address", "10.0.0.9:6379"])
    assert result.exit_code == 0, result.output
    assert manager.removed == ["demo"] and stopped == ["api", "the manager's handle"]
    assert "manager    not ready: the atomr manager restarted and cannot read its stored state yet" in result.output
    assert "demo       drain and stop 1 replica" in result.output and "replicas   stopped (1)" in result.output


def test_down_stops_nothing_while_the_manager_cannot_list_its_deployments(cluster) -> None:
    manager = RecoveringManager(unread=10**9)
    stopped = cluster(manager)
    result = CliRunner().invoke(app, ["down", "--address", "10.0.0.9:6379", "--timeout", "1"])
    assert result.exit_code == 1, result.output
    assert stopped == [] and manager.removed == []  # the API, the replicas and the manager all left as they run
    assert result.output.strip().splitlines()[-1] == (
        "error: nothing was stopped, as the manager cannot list its deployments yet: the atomr manager restarted "
        "and cannot read its stored state yet (ConnectionError: GCS unavailable); it tries again every second: try "
        "again shortly")


def test_status_says_the_manager_is_recovering_not_that_nothing_is_deployed(cluster) -> None:
    cluster(RecoveringManager(unread=10**9))
    result = CliRunner().invoke(app, ["status", "demo", "--address", "10.0.0.9:6379"])
    assert result.exit_code == 1 and "no deployment named" not in result.output, result.output
    assert result.output.strip().splitlines()[-1].startswith(
        "error: the atomr manager restarted and cannot read its stored state yet (ConnectionError: GCS unavailable)")


def test_remove_waits_on_through_a_manager_restart(cluster) -> None:
    """A status call refused while the manager recovered ended `atomr remove`'s wait with a traceback."""

    class RestartsAfterTheRemove(RecoveringManager):
        def remove(self, name: str) -> ApplyResult:
            self.unread = 2
            return super().remove(name)

    manager = RestartsAfterTheRemove(unread=0)
    cluster(manager)
    result = CliRunner().invoke(app, ["remove", "demo", "--address", "10.0.0.9:6379"])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines() == ["demo: drain and stop 1 replica", "demo: removed"]


def test_up_goes_on_while_a_restarted_manager_recovers_its_deployments(cluster, monkeypatch) -> None:
    """`atomr up --serve` while the GCS came back: it failed ("cannot read its stored state yet"),
    and the API it is there to bring back was not started."""
    from atomr_infer import cluster as ray_cluster

    cluster(RecoveringManager(unread=10**9))
    monkeypatch.setattr(lifecycle, "UP_LIST_WAIT_S", 0.05)
    monkeypatch.setattr(ray_cluster, "use_local_auth_token", lambda: None)
    monkeypatch.setattr(ray_cluster, "target_address", lambda address: address)
    monkeypatch.setattr(common, "dashboard_url", lambda: None)
    monkeypatch.setattr(common, "control_plane", lambda *args, **kwargs: client.ControlPlane.connect())
    result = CliRunner().invoke(app, ["up", "--address", "10.0.0.9:6379"])
    assert result.exit_code == 0, result.output
    assert "atomr-manager running, recovering its deployments (the atomr manager restarted" in result.output
    assert "gemma      skipped: the manager is recovering its deployments" in result.output
