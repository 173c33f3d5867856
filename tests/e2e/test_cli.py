"""The ``atomr`` CLI driven as a user drives it: subprocesses, their output and exit codes.

The module starts its own Ray head with ``atomr up`` — on a free port, with a private state
directory and Ray temp directory, so it never meets the in-process Ray of the integration
fixtures, another test session, or the user's own Ray — and stops it with ``atomr down`` at
the end. Every later command joins it through ``RAY_ADDRESS``. The head advertises 2 logical
GPUs (``ATOMR_RAY_NUM_GPUS``) for the budget test; the deployment runs on the CPU. One engine
(``deployments/smollm2.yaml``) serves the whole module.

The tests run in file order: the last ones remove the deployment and stop the cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import psutil
import pytest

from atomr_infer.local_ray import free_port, gcs_server, head_processes, port_open, stop_head
from tests.atomr_serve import READY_LINE, AtomrServe

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
ATOMR = Path(sys.executable).parent / "atomr"
SMOLLM2 = ROOT / "deployments" / "smollm2.yaml"
ENGINE_START_S = 900  # seconds; ~30 s on an idle 2-core machine, minutes when it is busy
QUESTION = "What is the capital of France?"


@dataclass
class Cli:
    env: dict[str, str]
    port: int
    workdir: Path
    up: subprocess.CompletedProcess[str]
    api_url: str | None = None  # set by the `atomr up --serve` test; `atomr down` must stop it

    def run(self, *args: str | Path, timeout: float = 180, env: dict[str, str] | None = None):
        proc = subprocess.run(
            [str(ATOMR), *map(str, args)],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env=env or self.env,
            stdin=subprocess.DEVNULL,
        )
        for stream in (proc.stdout, proc.stderr):
            assert "Traceback" not in stream, stream
        return proc

    def status(self, name: str | None = None) -> dict | list:
        proc = self.run("status", *([name] if name else []), "--json")
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)


def _base_env(workdir: Path, port: int) -> dict[str, str]:
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "ATOMR_RAY_"))}
    env = {k: v for k, v in inherited.items() if k not in ("FORCE_COLOR", "CLICOLOR_FORCE")}
    env.update(
        ATOMR_RAY_PORT=str(port),
        ATOMR_STATE_DIR=str(workdir / "state"),
        ATOMR_RAY_TEMP_DIR=str(workdir / "ray"),
        ATOMR_INFER_GEMMA_AUTO="skip-quietly",
        ATOMR_RAY_NUM_GPUS="2",
        NO_COLOR="1",
        TERM="dumb",
        COLUMNS="200",
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture(scope="module")
def cli() -> Iterator[Cli]:
    if not ATOMR.exists():
        pytest.fail(f"atomr console script not found at {ATOMR}: install the package into this environment")
    # Short: Ray puts unix sockets under its temp dir, and their paths must stay < 108 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="atomr-e2e-", dir="/tmp"))
    port = free_port()
    env = _base_env(workdir, port)  # no RAY_ADDRESS: `atomr up` must start the head itself
    up = subprocess.run([str(ATOMR), "up"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    if up.returncode != 0:  # keep Ray's logs to look at
        stop_head(port)
        pytest.fail(f"atomr up failed (exit {up.returncode}); Ray's logs are in {workdir}/ray\n{up.stdout}{up.stderr}")
    try:
        yield Cli({**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}, port, workdir, up)
    finally:
        if head_processes(port):  # a test failed before `atomr down` ran: clean up anyway
            subprocess.run([str(ATOMR), "down"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
            stop_head(port)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def smollm2(cli: Cli) -> subprocess.CompletedProcess[str]:
    """``atomr deploy deployments/smollm2.yaml`` (waits until ready); its result."""
    proc = cli.run("deploy", SMOLLM2, "--timeout", str(ENGINE_START_S), timeout=ENGINE_START_S + 60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_up_starts_a_local_head_with_a_dashboard(cli):
    out = cli.up.stdout
    assert f"started a local head at 127.0.0.1:{cli.port}" in out
    assert "atomr-manager running, 0 deployments" in out
    dashboard = next(line for line in out.splitlines() if line.startswith("dashboard"))
    assert "http://127.0.0.1:" in dashboard
    assert "gemma" not in out  # ATOMR_INFER_GEMMA_AUTO=skip-quietly: not a word
    again = cli.run("up")  # joins what is running
    assert again.returncode == 0 and "joined the cluster" in again.stdout


def test_probe_finds_the_running_head_without_ray_address(cli):
    env = {k: v for k, v in cli.env.items() if k != "RAY_ADDRESS"}  # found as `atomr` would join it
    proc = cli.run("probe", "--json", env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    ray_info = json.loads(proc.stdout)["ray"]
    assert ray_info["state"] == "reachable", ray_info  # token auth: the probe's client sends the token
    assert ray_info["address"] == f"127.0.0.1:{cli.port}"
    assert (ray_info["nodes"], ray_info["gpus"]) == (1, 2.0)


def test_invalid_file_exits_2_and_names_each_problem(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: Bad_Name\nmodel: bundled:smollm2-135m-instruct\nreplicas: -1\nfoo: 1\n")
    proc = cli.run("deploy", bad)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 3, proc.stderr
    assert any("name:" in e for e in errors) and any("replicas:" in e for e in errors)
    assert any("unknown key 'foo'" in e for e in errors)
    assert proc.stdout == ""


def test_deploy_waits_until_ready(smollm2):
    assert "smollm2: create 1 replica (generation 1)" in smollm2.stdout
    assert "smollm2/r0  starting" in smollm2.stdout  # progress, one line per change
    assert "ready: smollm2" in smollm2.stdout


def test_nothing_but_the_replica_loads_torch_or_vllm_and_no_worker_idles(cli, smollm2):
    """Issue 31: on a GPU node the manager had torch and vLLM mapped (0.73 GiB) and 12 idle
    Ray workers waited (0.51 GiB). The manager reports its own imports (heavy_imports.py)."""
    code = (
        "import json, ray; from atomr_infer.control.client import manager_handle; "
        "print(json.dumps(ray.get(manager_handle(start=False).process_report.remote())))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=cli.env)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["heavy_imports"] == {}, report
    titles = []
    for proc in head_processes(cli.port):
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile
            titles.append(" ".join(proc.cmdline()[:1]))
    assert any(t.startswith("ray::VllmReplica") for t in titles), titles
    assert not [t for t in titles if t.startswith("ray::IDLE")], titles


def test_status_shows_the_deployment_ready(cli, smollm2):
    proc = cli.run("status")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["NAME", "MODEL", "GENERATION", "READY", "STATUS"]
    assert lines[1].split() == ["smollm2", "bundled:smollm2-135m-instruct", "1/1", "1/1", "ready"]
    header = next(line for line in lines if line.startswith("REPLICA"))
    assert header.split()[:3] == ["REPLICA", "STATE", "NODE"]
    row = next(line for line in lines if line.startswith("smollm2/r0"))
    assert row.split()[1:2] == ["ready"]
    # The device with the dtype the replica chose, and its KV cache (smollm2.yaml sets 1 GiB).
    assert " cpu/bfloat16 " in row or " cpu/float32 " in row, row
    assert " 1.00 GiB, " in row and "k tokens" in row, row
    assert any(line.startswith("dashboard: http://127.0.0.1:") for line in lines)

    status = cli.status("smollm2")
    assert status["status"] == "ready" and status["replicas_ready"] == 1
    [replica] = status["replicas"]
    assert replica["state"] == "ready" and replica["device"] == "cpu" and replica["in_flight"] == 0
    assert replica["model"] == "bundled:smollm2-135m-instruct"  # the model it serves (a roll may mix two)
    assert replica["dashboard_url"].endswith(f"/#/actors/{replica['actor_id']}")


def test_reset_cache_resets_every_replica_and_names_a_missing_deployment(cli, smollm2):
    proc = cli.run("reset-cache", "smollm2")
    assert proc.returncode == 0 and proc.stdout.splitlines() == ["smollm2/r0: reset"], (proc.stdout, proc.stderr)
    missing = cli.run("reset-cache", "nope")
    assert missing.returncode == 1 and "nope" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1


def test_chat_answers_paris(cli, smollm2):
    proc = cli.run("chat", "smollm2", QUESTION, "--max-tokens", "32")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "Task was destroyed" not in proc.stderr  # its channels to the replica were closed on the way out


def test_deploy_again_prints_unchanged_at_once(cli, smollm2):
    started = time.monotonic()
    proc = cli.run("deploy", SMOLLM2)
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["smollm2: unchanged"]
    assert took < 20, f"took {took:.1f}s"  # the CLI's start and one call; no waiting


def test_dry_run_of_a_changed_file_shows_the_plan_and_changes_nothing(cli, smollm2, tmp_path):
    before = cli.status("smollm2")
    changed = tmp_path / "smollm2.yaml"
    changed.write_text(
        SMOLLM2.read_text().replace("max_model_len: 2048", "max_model_len: 1024").replace(
            "max_concurrent: 64", "max_concurrent: 32"
        )
    )
    proc = cli.run("deploy", "--dry-run", changed)
    assert proc.returncode == 0, proc.stderr
    assert (
        "smollm2: roll 1 replica (runtime_config.max_model_len: 2048 → 1024); "
        "update in place (serving.max_concurrent: 64 → 32)"
    ) in proc.stdout
    assert "budget: gpus: ok" in proc.stdout
    assert "nothing was changed" in proc.stdout
    after = cli.status("smollm2")
    assert after["generation"] == before["generation"] == 1
    assert after["spec_hash"] == before["spec_hash"]
    assert [r["actor_id"] for r in after["replicas"]] == [r["actor_id"] for r in before["replicas"]]


def test_dry_run_shows_the_autoscaling_bounds_and_the_worst_case_cost(cli, smollm2, tmp_path):
    elastic = tmp_path / "elastic.yaml"
    elastic.write_text(
        "name: elastic\nmodel: bundled:smollm2-135m-instruct\ndevice: auto\n"
        "autoscaling: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 8}\n"
    )
    proc = cli.run("deploy", "--dry-run", elastic)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    scaling = next(line for line in proc.stdout.splitlines() if "scaling:" in line)
    # The test cluster has 2 logical GPUs of no known type (the default price, $2/GPU-hour).
    assert "autoscaling 1-4 replicas, target 8 ongoing requests each" in scaling, scaling
    assert "worst case 4 x 1 GPU x $2.00/GPU-hour (default price) = $8.00/hour" in scaling, scaling
    assert "the budget stops it at 2: 3 replicas would exceed the budget: gpus 3 of 2 GPUs" in scaling, scaling
    assert [d["name"] for d in cli.status()] == ["smollm2"]


def test_over_budget_exits_3_and_creates_nothing(cli, smollm2, tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("name: big\nmodel: bundled:smollm2-135m-instruct\ndevice: auto\ngpus: 4\n")
    proc = cli.run("deploy", big)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: deployment 'big' over its gpus budget: needs 4 GPUs, 2 GPUs available"), line
    assert [d["name"] for d in cli.status()] == ["smollm2"]


def test_several_files_are_checked_together_and_a_refusal_applies_none(cli, smollm2, tmp_path):
    """Each file alone fits; together they need 3 of the 2 GPUs: the first is not applied either.
    Nor is it when the second names a vLLM setting that does not exist."""
    one = tmp_path / "one.yaml"
    one.write_text("name: one\nmodel: bundled:smollm2-135m-instruct\ndevice: auto\ngpus: 1\n")
    two = tmp_path / "two.yaml"
    two.write_text("name: two\nmodel: bundled:smollm2-135m-instruct\ndevice: auto\ngpus: 2\n")
    proc = cli.run("deploy", one, two)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    refused, said = proc.stderr.splitlines()
    assert refused.startswith("error: deployment 'two' over its gpus budget: needs 3 GPUs, 2 GPUs available (hint: "
                              "this deployment needs 2 (gpus 2 x replicas 1), others hold 1;"), refused
    assert said == "nothing was applied", proc.stderr
    typo = tmp_path / "typo.yaml"
    typo.write_text(
        "name: typo\nmodel: bundled:smollm2-135m-instruct\n"
        "runtime_config: {extra_engine_args: {max_num_batched_token: 100}}\n"
    )
    proc = cli.run("deploy", one, typo)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "runtime_config.extra_engine_args.max_num_batched_token" in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == "nothing was applied", proc.stderr
    proc = cli.run("deploy", "--dry-run", one, typo)  # the dry run says the same, and exits 2 too
    assert proc.returncode == 2 and "max_num_batched_token" in proc.stderr, proc.stdout + proc.stderr
    assert [d["name"] for d in cli.status()] == ["smollm2"]


def test_gemma_on_a_host_without_gpu_fails_before_starting_anything(tmp_path):
    from atomr_infer.provision import probe

    if probe.probe(sections=("gpu",)).local_gpus:
        pytest.skip("this host has a GPU")
    port = free_port()
    env = {**_base_env(tmp_path, port), "ATOMR_RAY_NUM_GPUS": ""}
    proc = subprocess.run(
        [str(ATOMR), "deploy", ROOT / "deployments" / "gemma.yaml"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "error: deployment 'gemma' cannot run here: device is 'cuda'" in proc.stderr
    assert "deployments/smollm2.yaml" in proc.stderr
    assert not port_open("127.0.0.1", port) and not head_processes(port)  # no Ray was started


def test_ctrl_c_during_chat_aborts_the_request_in_the_engine(cli, smollm2):
    before = cli.status("smollm2")["replicas"][0]
    args = ["chat", "smollm2", "Tell me a very long story about a dragon.", "--max-tokens", "1800", "--ignore-eos"]
    proc = subprocess.Popen(
        [str(ATOMR), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli.env, cwd=ROOT
    )
    received: list[str] = []

    def read() -> None:
        while char := proc.stdout.read(1):
            received.append(char)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 120
    while len("".join(received)) < 40:  # it is streaming
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline, "no output from atomr chat"
        time.sleep(0.1)
    # Interrupt at once: asking `atomr status` first costs a CLI start, long enough on a fast CPU
    # for the whole answer to finish. The abort count below shows it was still in the engine.
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130
    assert "interrupted" in proc.stderr.read()

    deadline = time.monotonic() + 15
    while True:
        replica = cli.status("smollm2")["replicas"][0]
        if replica["in_flight"] == 0 and replica["engine_unfinished"] == 0:
            break
        assert time.monotonic() < deadline, replica
        time.sleep(0.5)
    assert replica["requests_aborted"] == before["requests_aborted"] + 1
    assert len("".join(received).split()) < 1500  # stopped long before max_tokens


def test_up_with_serve_starts_the_openai_api_on_the_cluster(cli, smollm2):
    # The ingress replicas listen themselves: a port another program holds is refused in one
    # line before anything starts.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]
        refused = cli.run("up", "--serve", "--port", str(held))
    assert refused.returncode == 1, refused.stdout + refused.stderr
    error = f"error: cannot listen on 127.0.0.1:{held}: Address already in use (hint: pick another --port)"
    assert error in refused.stderr.splitlines(), refused.stderr
    port = free_port()
    proc = cli.run("up", "--serve", "--port", str(port), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    base_url = f"http://127.0.0.1:{port}/v1"
    assert f"api        {base_url} (OpenAI-compatible, model = deployment name" in proc.stdout
    cli.api_url = base_url
    # `up` has returned: the API runs on the cluster, not in the CLI process.
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=32, temperature=0
    )
    assert "Paris" in reply.choices[0].message.content
    again = cli.run("up", "--serve", "--port", str(port))
    assert again.returncode == 0 and f"api        {base_url} (OpenAI-compatible, already running)" in again.stdout
    elsewhere = cli.run("up", "--serve", "--port", str(free_port()))
    assert elsewhere.returncode == 1
    assert f"already runs on this cluster at 127.0.0.1:{port}" in elsewhere.stderr and "--port" in elsewhere.stderr


def test_logs_show_the_replica_log(cli, smollm2):
    proc = cli.run("logs", "smollm2", "--lines", "200")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("==> smollm2/r0 (ready, atomr:smollm2:r0) <==")
    assert "replica_ready" in proc.stdout
    missing = cli.run("logs", "smollm2", "--replica", "r9")
    assert missing.returncode == 1 and "has no replica 'r9'" in missing.stderr


def test_remove_then_status_shows_nothing(cli, smollm2):
    proc = cli.run("remove", "smollm2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["smollm2: drain and remove 1 replica", "smollm2: removed"]
    status = cli.run("status")
    assert status.returncode == 0 and status.stdout.startswith("No deployments.")
    assert cli.status() == []
    again = cli.run("remove", "smollm2")
    assert again.returncode == 1 and "no deployment named 'smollm2'" in again.stderr


def test_down_stops_the_head_it_started_and_leaves_no_ray_process(cli):
    pids = [p.pid for p in head_processes(cli.port)]
    assert pids, "the head is not running"
    # An `atomr serve` in another terminal, on the API `up --serve` started (or a new one).
    api_port = int(cli.api_url.rsplit(":", 1)[1].split("/")[0]) if cli.api_url else free_port()
    cli.api_url = f"http://127.0.0.1:{api_port}/v1"
    serving = AtomrServe(["--port", str(api_port)], cli.env, cwd=ROOT)
    try:
        proc = cli.run("down", timeout=300)
        assert proc.returncode == 0, proc.stderr
        # The foreground server sees the stop, says so in one line and exits 0 before the head goes.
        assert serving.exit_code(timeout=30) == 0, serving.lines
    finally:
        serving.kill()
    assert serving.lines[-1] == f"stopped: the API at http://127.0.0.1:{api_port} was stopped from another " \
        "process (`atomr down`)", serving.lines
    assert f"stopped the local head at 127.0.0.1:{cli.port}" in proc.stdout
    assert proc.stdout.startswith(f"api        stopped ({cli.api_url})"), proc.stdout  # the API goes first
    assert not port_open("127.0.0.1", api_port)
    left = [p for p in map(_alive, pids) if p is not None]
    assert not left, [(p.pid, p.name()) for p in left]
    assert not head_processes(cli.port)
    assert not port_open("127.0.0.1", cli.port)
    assert not (cli.workdir / "state" / "ray-started-by-atomr").exists()
    again = cli.run("down")
    assert again.returncode == 0 and "nothing to stop" in again.stdout


def _alive(pid: int) -> psutil.Process | None:
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc
    except psutil.NoSuchProcess:
        return None


def test_serve_stops_cleanly_on_ctrl_c_and_in_one_line_when_its_cluster_dies():
    """On a head of its own (no Serve running): Ctrl-C stops Serve too and says so, and nothing
    else (Ray printed a "graceful_shutdown failed … will be retried" warning here). Then a head
    that fails (its GCS killed) ends a foreground `atomr serve`: one error line, exit 1, within
    seconds (it waited, serving nothing, until killed; then Ray's shutdown hung)."""
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="atomr-e2e-", dir="/tmp"))
    env = _base_env(workdir, port)
    head: list[psutil.Process] = []
    try:
        up = subprocess.run([str(ATOMR), "up"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        assert up.returncode == 0, up.stdout + up.stderr
        api_port = free_port()
        serving = AtomrServe(["--port", str(api_port)], {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}, cwd=ROOT)
        assert serving.interrupt() == 0, serving.lines
        after = serving.lines[serving.lines.index(READY_LINE) + 1:]
        assert after == ["stopping…", f"stopped the API at http://127.0.0.1:{api_port}"], serving.lines
        serving = AtomrServe(["--port", str(free_port())], {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}, cwd=ROOT)
        try:
            head = head_processes(port)  # found through the GCS: taken before it goes
            gcs = gcs_server(port)
            assert gcs is not None, head
            gcs.kill()
            assert serving.exit_code(timeout=30) == 1, serving.lines
        finally:
            serving.kill()
        last = serving.lines[-1]
        assert last.startswith("error: the Ray cluster at ") and last.endswith(
            f":{port} is gone, and the API with it"), serving.lines
    finally:
        stop_head(port)
        for proc in head:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def test_up_on_a_port_another_process_holds_fails_at_once_saying_so(tmp_path):
    """The local port of an outgoing connection, which a connect check does not see, made the
    GCS fail after 40 s, twice, in a line that named no cause."""
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as out:
        held = out.getsockname()[1]
        env = _base_env(tmp_path, held)
        try:
            proc = subprocess.run([str(ATOMR), "up"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
        finally:
            stop_head(held)  # what a `ray start` that ran (this test failing) left
    assert proc.returncode == 1, proc.stdout + proc.stderr
    error = f"error: cannot start a local Ray head on 127.0.0.1:{held}: Address already in use " \
        "(hint: set ATOMR_RAY_PORT to a free port)"
    assert proc.stderr.splitlines() == [error], proc.stderr
    assert not (tmp_path / "ray").exists()  # `ray start` never ran


# -- a cluster that cannot be joined ---------------------------------------------------------


@contextlib.contextmanager
def silent_listener(host: str):
    """A TCP port that accepts connections and never answers (a GCS that is not there)."""
    server = socket.socket()
    server.bind((host, 0))
    server.listen(16)
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


@pytest.mark.parametrize("command", [["status"], ["deploy", str(SMOLLM2)]])
def test_a_cluster_that_never_answers_fails_within_30s_naming_the_address(tmp_path, command):
    with silent_listener("0.0.0.0") as port:
        env = {**_base_env(tmp_path, free_port()), "RAY_ADDRESS": f"127.0.0.1:{port}"}
        started = time.monotonic()
        proc = subprocess.run([str(ATOMR), *command], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
        took = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert took < 30, f"took {took:.1f}s"
    error = next(line for line in proc.stderr.splitlines() if line.startswith("error:"))
    assert f"could not join the Ray cluster at 127.0.0.1:{port} within 25s: its GCS does not answer" in error
    assert "(hint: check the address" in error


def test_a_head_on_loopback_only_fails_at_once_saying_why(tmp_path):
    from ray._private.services import get_node_ip_address

    swapped = get_node_ip_address()
    if swapped in ("127.0.0.1", "::1"):
        pytest.skip("this machine has no address but loopback: Ray does not swap the host")
    with silent_listener("127.0.0.1") as port:
        env = {**_base_env(tmp_path, free_port()), "RAY_ADDRESS": f"127.0.0.1:{port}"}
        proc = subprocess.run([str(ATOMR), "status"], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    [line] = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert f"the Ray head at 127.0.0.1:{port} (RAY_ADDRESS) listens on loopback only" in line, line
    assert f"Ray connects to {swapped}:{port}" in line and "--node-ip-address=127.0.0.1" in line, line
