"""CLI errors are one line, printed as given, whatever the command let through."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from atomr_infer.cli import app as app_module
from atomr_infer.errors import AtomrError


def test_an_error_line_prints_brackets_backslashes_and_colons_as_given(capsys) -> None:
    """``127.0.0.1:abc`` printed an emoji for ``:abc:``; ``x\\[/b].yaml`` a rich MarkupError traceback."""
    message = r"could not join the Ray cluster at 127.0.0.1:abc: Unable to parse (x\[/b].yaml [bold])"
    with pytest.raises(typer.Exit) as done:
        app_module.fail(AtomrError(message))
    assert done.value.exit_code == 1
    assert capsys.readouterr().err.strip() == f"error: {message}"


SMOLLM2 = str(Path(__file__).resolve().parents[2] / "deployments" / "smollm2.yaml")


@pytest.mark.parametrize("args", [["deploy", "--dry-run", SMOLLM2], ["up", "--no-gemma"], ["status"], ["down"]])
def test_a_bad_ray_port_setting_is_one_line_naming_it(args, tmp_path) -> None:
    """A traceback (``int('abc')``) from deploy and up; a line that did not name the variable; and
    ``down`` took it for "no cluster answers" and stopped the head atomr started, undrained."""
    (tmp_path / "ray-started-by-atomr").write_text("127.0.0.1:6379")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"ATOMR_RAY_PORT": "abc",
                                                                          "ATOMR_STATE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "atomr_infer.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr  # invalid input (docs/cli.md)
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: ATOMR_RAY_PORT is 'abc': set it to a port number (1-65535), or unset it for 6379")
    assert (tmp_path / "ray-started-by-atomr").exists()  # nothing was stopped


@pytest.mark.parametrize("args", [["serve"], ["up", "--no-gemma", "--serve"]])
def test_a_host_that_does_not_resolve_is_refused_before_ray_starts(args, tmp_path) -> None:
    """It was found only when the API bound, once Ray had started (a head left running)."""
    # (a cluster address where nothing listens: were the host not checked first, nothing would start either)
    env = os.environ | {"ATOMR_STATE_DIR": str(tmp_path), "RAY_ADDRESS": "127.0.0.1:1"}
    proc = subprocess.run([sys.executable, "-m", "atomr_infer.cli.main", *args, "--host", "no-such-host.invalid"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --host 'no-such-host.invalid': not an address")
    assert "no Ray cluster answers" not in proc.stderr  # refused before any cluster was asked for


BAD_ENGINE_SETTINGS = """name: t1
model: bundled:smollm2-135m-instruct
device: cpu
serving: {openai: {reasoning_parser: deepseek-r1}}
runtime_config: {extra_engine_args: {max_num_batched_tokenz: 10}}
"""


@pytest.mark.parametrize("args", [["validate"], ["deploy", "--dry-run"]])
def test_validate_and_an_offline_dry_run_refuse_what_apply_would(args, tmp_path) -> None:
    """They said ``valid`` (and ``create 1 replica``) for vLLM settings the manager refuses at apply."""
    spec = tmp_path / "t1.yaml"
    spec.write_text(BAD_ENGINE_SETTINGS)
    env = os.environ | {"ATOMR_STATE_DIR": str(tmp_path), "RAY_ADDRESS": "127.0.0.1:1"}  # no cluster answers
    proc = subprocess.run([sys.executable, "-m", "atomr_infer.cli.main", *args, str(spec)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "max_num_batched_tokenz: not a vLLM EngineArgs field (did you mean 'max_num_batched_tokens'?)" in proc.stderr
    assert "'deepseek-r1' is not a vLLM reasoning_parser (did you mean 'deepseek_r1'?)" in proc.stderr


def test_reset_cache_reports_a_replica_gone_since_the_status_on_its_line(monkeypatch) -> None:
    """Its actor looked up outside the per-replica handling: a traceback, and no line for the others."""
    from types import SimpleNamespace

    import ray

    from atomr_infer.control.client import ControlPlane
    from atomr_infer.status import DeploymentStatus, ReplicaState, ReplicaStatus

    replicas = tuple(ReplicaStatus(f"r{i}", f"atomr:d:r{i}", ReplicaState.READY, 1) for i in range(2))
    plane = ControlPlane(handle=None)
    monkeypatch.setattr(plane, "status", lambda name: DeploymentStatus("d", "m", 1, 1, 2, 2, replicas))

    def get_actor(name, namespace=None):
        if name == "atomr:d:r0":
            raise ValueError(f"Failed to look up actor with name '{name}'.")
        return SimpleNamespace(reset_prefix_cache=SimpleNamespace(remote=lambda running: "ref"))

    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: True)
    assert plane.reset_prefix_cache("d") == {"r0": "failed: Failed to look up actor with name 'atomr:d:r0'.",
                                             "r1": "reset"}


@pytest.mark.parametrize("args", [["serve"], ["up", "--no-gemma", "--serve"]])
def test_an_infinite_body_limit_is_refused_before_anything_starts(args) -> None:
    """``inf`` passed the option's minimum, then failed converting to bytes after Ray had started."""
    from typer.testing import CliRunner

    from atomr_infer.cli.main import app

    result = CliRunner().invoke(app, [*args, "--max-body-mb", "inf"])
    assert result.exit_code == 2 and "--max-body-mb" in result.output, result.output


def test_an_address_other_than_the_cluster_this_process_is_in_is_refused(monkeypatch) -> None:
    """It was ignored: a notebook that had run ray.init() made its deployments in that cluster."""
    import socket
    from types import SimpleNamespace

    import ray

    from atomr_infer.cluster import connect
    from atomr_infer.errors import AtomrError

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="10.0.0.5:6379"))
    with pytest.raises(AtomrError, match="already connected to Ray at 10.0.0.5:6379, not 10.9.9.9:6379"):
        connect("10.9.9.9:6379")
    connect(None)
    connect("auto")
    connect("10.0.0.5:6379")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="127.0.0.1:6379"))
    for same in ("127.0.0.1:6379", "localhost:6379", f"{socket.gethostname()}:6379"):  # this machine, its head
        connect(same)
    with pytest.raises(AtomrError, match="not 127.0.0.1:6380"):
        connect("127.0.0.1:6380")


@pytest.mark.parametrize("args", [["serve"], ["up", "--no-gemma", "--serve"]])
@pytest.mark.parametrize("cluster_runs", [False, True])
def test_a_port_in_use_is_refused_before_a_local_head_starts(args, cluster_runs, monkeypatch) -> None:
    """With no cluster running, the port was checked once a local head and the manager had
    started, and both stayed. With one, the check is run_server's: the API running there may
    hold the port (to be updated in place)."""
    import socket

    from typer.testing import CliRunner

    from atomr_infer import cluster
    from atomr_infer.cli import common
    from atomr_infer.cli.main import app

    joined: list[str | None] = []

    def join(address, *args, **kwargs):
        joined.append(address)
        raise AtomrError("joined the cluster")

    monkeypatch.setattr(cluster, "target_address", lambda address=None: "127.0.0.1:6379" if cluster_runs else None)
    monkeypatch.setattr(common, "connect", join)
    monkeypatch.setattr(common, "control_plane", join)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, [*args, "--port", str(port)])
    assert result.exit_code == 1, result.output
    if cluster_runs:
        assert joined and "error: joined the cluster" in result.output
    else:
        assert not joined, "it connected (a local head would have started) before checking the port"
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use (hint: pick another --port)" in result.output


def test_run_server_creates_no_manager_for_an_api_that_cannot_listen(monkeypatch) -> None:
    """On a running cluster, the detached manager was created before the port was checked, and stayed."""
    import socket

    from atomr_infer import cluster
    from atomr_infer.control import client
    from atomr_infer.serve import server

    created: list[str | None] = []
    monkeypatch.setattr(cluster, "connect", lambda address=None, start=True: None)
    monkeypatch.setattr(server, "running_server", lambda: None)  # no API runs there
    monkeypatch.setattr(client, "manager_handle", lambda address=None, start=True: created.append(address))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(AtomrError, match=f"cannot listen on 127.0.0.1:{port}"):
            server.run_server("127.0.0.1", port)
    assert created == []


@pytest.mark.parametrize("args", [["serve"], ["up", "--no-gemma", "--serve"]])
def test_a_bad_keep_alive_setting_is_refused_before_anything_starts(args, monkeypatch) -> None:
    from typer.testing import CliRunner

    from atomr_infer import cluster
    from atomr_infer.cli import common
    from atomr_infer.cli.main import app

    joined: list[str | None] = []

    def join(address, *args, **kwargs):
        joined.append(address)
        raise AtomrError("joined the cluster")

    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "5s")
    monkeypatch.setattr(cluster, "target_address", lambda address=None: None)
    monkeypatch.setattr(common, "connect", join)
    monkeypatch.setattr(common, "control_plane", join)
    result = CliRunner().invoke(app, args)
    assert (result.exit_code, joined) == (2, []), result.output
    assert "error: VLLM_HTTP_TIMEOUT_KEEP_ALIVE is '5s': set it to whole seconds (0 or more), or unset it for 5" in (
        result.output)


@pytest.mark.parametrize("flags", [[], ["--dry-run"]])
@pytest.mark.parametrize("folder", ["missing", "no-config"])
def test_a_local_model_missing_here_is_refused_before_a_local_head_starts(flags, folder, tmp_path, monkeypatch) -> None:
    """A typo in a local path started a local head and recorded the deployment; its replica then
    failed 3 times ("local model directory … does not exist") and the deployment was marked failed."""
    from typer.testing import CliRunner

    from atomr_infer import cluster
    from atomr_infer.cli import common
    from atomr_infer.cli.main import app

    started: list[bool] = []  # each call's start=

    def join(address, start, **kwargs):
        started.append(start)
        raise AtomrError("joined the cluster")

    (tmp_path / "no-config").mkdir()  # a directory, but no HF model's: no config.json
    spec = tmp_path / "t1.yaml"
    spec.write_text(f"name: t1\nmodel: {tmp_path / folder}\ndevice: cpu\n")
    monkeypatch.setattr(cluster, "target_address", lambda address=None: None)  # no cluster runs
    monkeypatch.setattr(common, "control_plane", join)
    result = CliRunner().invoke(app, ["deploy", *flags, str(spec)])
    assert result.exit_code == 2, result.output
    assert f"error: t1: model: '{tmp_path / folder}': " in result.output
    assert started == ([] if not flags else [False])  # (a dry run asks for a running manager, starting nothing)


def test_validate_warns_of_a_local_model_missing_here(tmp_path) -> None:
    """It may be on the cluster's nodes, where the replicas load it: a warning, not a refusal."""
    from typer.testing import CliRunner

    from atomr_infer.cli.main import app

    spec = tmp_path / "t1.yaml"
    spec.write_text(f"name: t1\nmodel: {tmp_path / 'modles'}\ndevice: cpu\n")
    result = CliRunner().invoke(app, ["validate", str(spec)])
    assert result.exit_code == 0, result.output
    assert f"warning: t1: model: local model directory {tmp_path / 'modles'} does not exist on this machine" in (
        result.output)


@pytest.mark.parametrize(("args", "env_address", "named"), [
    (["status", "--address", "foo"], None, "--address is 'foo'"),
    (["status"], "localhost:abc", "RAY_ADDRESS is 'localhost:abc'"),
    (["down", "--address", ":6379"], None, "--address is ':6379'"),
])
def test_a_malformed_cluster_address_is_invalid_input_naming_where_it_came_from(args, env_address, named,
                                                                                tmp_path) -> None:
    """It was exit 1 with Ray's "Invalid address format: foo", as if no cluster answered there."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"ATOMR_STATE_DIR": str(tmp_path)}
    if env_address is not None:
        env["RAY_ADDRESS"] = env_address
    proc = subprocess.run([sys.executable, "-m", "atomr_infer.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {named}: expected host:port"), proc.stderr
