"""``atomr down`` stops the local head atomr started only when it is the cluster named: another
machine's address that does not answer is an error that stops nothing, and another port here
stops nothing (both stopped the local head, undrained, and said "no cluster is running")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from atomr_infer import cluster
from atomr_infer.cli import lifecycle


def test_only_this_machines_address_at_the_markers_port_is_atomrs_head(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("ATOMR_STATE_DIR", str(tmp_path))
    assert not lifecycle._atomrs_head("127.0.0.1:6379")  # no marker: atomr started nothing here
    cluster.started_marker().write_text("127.0.0.1:6379")
    assert lifecycle._atomrs_head("127.0.0.1:6379") and lifecycle._atomrs_head("localhost:6379")
    assert not lifecycle._atomrs_head("127.0.0.1:6380")
    assert not lifecycle._atomrs_head("10.255.1.2:6379")  # another machine, the same port
    assert lifecycle._on_this_machine("localhost:1") and lifecycle._on_this_machine("ray://127.0.0.1:10001")
    assert not lifecycle._on_this_machine("no-such-host.invalid:6379")


def down(tmp_path: Path, address: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ATOMR_STATE_DIR": str(tmp_path), "RAY_ADDRESS": address}
    return subprocess.run([sys.executable, "-m", "atomr_infer.cli.main", "down"], capture_output=True, text=True,
                          timeout=120, env=env)


def test_down_at_an_address_that_does_not_answer_stops_nothing_and_says_so(tmp_path: Path) -> None:
    marker = tmp_path / "ray-started-by-atomr"
    marker.write_text("127.0.0.1:6379")
    here = down(tmp_path, "127.0.0.1:1")  # this machine, nothing there
    assert here.returncode == 0 and "no cluster is running at 127.0.0.1:1; nothing to stop" in here.stdout, here
    assert marker.exists()  # the local head's marker is left: its head was not touched
    elsewhere = down(tmp_path, "192.0.2.1:6379")  # TEST-NET: no machine answers
    assert elsewhere.returncode == 1, elsewhere.stdout + elsewhere.stderr
    assert elsewhere.stderr.strip().splitlines()[-1].startswith("error: nothing was stopped: "), elsewhere.stderr
    assert "192.0.2.1:6379" in elsewhere.stderr and marker.exists()


def test_down_at_a_cluster_that_answers_but_cannot_be_joined_stops_nothing(tmp_path: Path) -> None:
    """Something listens at atomr's own head's address but the join fails (here: it listens on
    loopback only; a join timeout or a missing auth token take the same path). That is no
    "nothing to stop": it stopped the head undrained and exited 0."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        marker = tmp_path / "ray-started-by-atomr"
        marker.write_text(address)
        result = down(tmp_path, address)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: nothing was stopped: "), result.stderr
    assert address in result.stderr and "no cluster is running" not in result.stdout
    assert marker.exists()  # atomr's record of its head is kept: the head was not touched
