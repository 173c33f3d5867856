"""``atomr validate`` driven as a user runs it: a subprocess, exit codes, one line per problem."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from atomr_infer.spec import load_deployments

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS_DIR = ROOT / "deployments"
ATOMR = Path(sys.executable).parent / "atomr"


def validate(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    if not ATOMR.exists():
        pytest.fail(f"atomr console script not found at {ATOMR}: install the package into this environment")
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "CLICOLOR_FORCE")}
    env.update(NO_COLOR="1", TERM="dumb", COLUMNS="80")
    proc = subprocess.run(
        [str(ATOMR), "validate", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd or ROOT,
        env=env,
    )
    for stream in (proc.stdout, proc.stderr):
        assert "Traceback" not in stream, stream
    return proc


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_shipped_deployments_are_valid() -> None:
    expected = load_deployments(DEPLOYMENTS_DIR)
    proc = validate(DEPLOYMENTS_DIR)
    assert proc.returncode == 0, proc.stderr
    out = lines(proc.stdout)
    assert len(out) == len(expected)
    assert all(line.startswith("valid: ") for line in out)
    assert [line.split()[1] for line in out] == [d.name for d in expected]
    assert proc.stderr == ""


def test_each_file_given_by_name_is_valid() -> None:
    files = sorted(DEPLOYMENTS_DIR.glob("*.yaml"))
    proc = validate(*files)
    assert proc.returncode == 0, proc.stderr
    assert len(lines(proc.stdout)) == sum(len(load_deployments(f)) for f in files)


def test_typo_in_a_key_is_one_line_with_a_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("name: demo\nmodel: org/model\nreplcas: 2\n")
    proc = validate(path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    [line] = lines(proc.stderr)
    assert line.startswith(f"error: {path}: replcas: ")
    assert "did you mean 'replicas'" in line


def test_several_problems_give_one_line_each(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: Demo_1\n"
        "model: org/model\n"
        "replicas: -1\n"
        "runtime_config:\n"
        "  max_num_seq: 4\n"
        "  gpu_memory_utilization: 1.5\n"
        "serving:\n"
        "  on_capacity_exhausted: drop\n"
    )
    proc = validate(path)
    assert proc.returncode == 2
    err = lines(proc.stderr)
    assert len(err) == 5, err
    assert all(line.startswith(f"error: {path}: ") for line in err)
    by_field = {line.split(": ")[2]: line for line in err}
    assert set(by_field) == {
        "name",
        "replicas",
        "runtime_config.max_num_seq",
        "runtime_config.gpu_memory_utilization",
        "serving.on_capacity_exhausted",
    }
    assert "'Demo_1'" in by_field["name"]
    assert "got -1" in by_field["replicas"]
    assert "did you mean 'max_num_seqs'" in by_field["runtime_config.max_num_seq"]
    assert "got 1.5" in by_field["runtime_config.gpu_memory_utilization"]
    assert "'queue' or 'reject', got 'drop'" in by_field["serving.on_capacity_exhausted"]


def test_problems_in_several_files_are_all_reported(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("name: good\nmodel: org/model\n")
    one = tmp_path / "one.yaml"
    one.write_text("name: one\nmodel: org/model\ngpus: 0\n")
    two = tmp_path / "two.yaml"
    two.write_text("name: two\nmodel: org/model\n  device: cpu\n")
    proc = validate(good, one, two)
    assert proc.returncode == 2
    err = lines(proc.stderr)
    assert len(err) == 2, err
    assert err[0].startswith(f"error: {one}: gpus: ")
    assert err[1].startswith(f"error: {two}: invalid YAML at line 3")
    assert "valid:" not in proc.stdout


def test_nonexistent_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    proc = validate(path)
    assert proc.returncode == 2
    [line] = lines(proc.stderr)
    assert line == f"error: {path}: no such file or directory"


def test_directory_with_duplicate_names(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("name: demo\nmodel: org/one\n")
    (tmp_path / "b.yaml").write_text("name: demo\nmodel: org/two\n")
    proc = validate(tmp_path)
    assert proc.returncode == 2
    [line] = lines(proc.stderr)
    assert line == f"error: {tmp_path / 'b.yaml'}: name: 'demo' is already used by {tmp_path / 'a.yaml'}"


def test_brackets_and_colons_in_values_are_printed_as_written(tmp_path: Path) -> None:
    # The console renders markup and :emoji: codes; user text must reach the terminal untouched.
    path = tmp_path / "odd[red]name.yaml"
    path.write_text("name: '[/]x:smile:'\nmodel: org/model\n")
    proc = validate(path)
    assert proc.returncode == 2
    [line] = lines(proc.stderr)
    assert line.startswith(f"error: {path}: name: '[/]x:smile:' is not a valid name")

    ok = tmp_path / "ok.yaml"
    ok.write_text("name: ok\nmodel: './models/[/]x:smile:'\n")
    proc = validate(ok)
    assert proc.returncode == 0, proc.stderr
    assert f"{tmp_path}/models/[/]x:smile:" in proc.stdout  # made absolute from the spec file's directory


def test_the_old_name_idempotent_is_valid_with_a_warning_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text("name: old\nmodel: bundled:smollm2-135m-instruct\ndevice: cpu\nidempotent: false\n")
    proc = validate(path)
    assert proc.returncode == 0, proc.stderr
    assert lines(proc.stderr) == [f"warning: {path}: idempotent is deprecated: write restart_on_apply: true instead"]
    assert lines(proc.stdout) == ["valid: old  bundled:smollm2-135m-instruct  (1 replica, cpu)"]


@pytest.mark.parametrize(("command", "flag"), [
    (("serve", "--port", "70000"), "'--port'"), (("up", "--serve", "--port", "0"), "'--port'"),
    (("serve", "--allowed-origins", '["https://a.example"'), "'--allowed-origins': '[\"https://a.example\"' is not"),
    (("up", "--serve", "--allowed-headers", "a,,b"), "'--allowed-headers': 'a,,b' has an empty entry"),
])
def test_a_bad_api_flag_is_refused_before_anything_starts(command, flag):
    proc = subprocess.run([str(ATOMR), *command], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "NO_COLOR": "1", "RAY_ADDRESS": "127.0.0.1:1", "COLUMNS": "300"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert flag in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_chat_with_ignore_eos_and_no_max_tokens_is_refused_before_connecting():
    proc = subprocess.run([str(ATOMR), "chat", "smollm2", "hi", "--ignore-eos"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "NO_COLOR": "1", "RAY_ADDRESS": "127.0.0.1:1"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        "error: --ignore-eos needs --max-tokens (without it the answer runs to the end of the context)"
    ), proc.stderr


def test_up_refuses_the_apis_flags_without_serve_instead_of_ignoring_them():
    proc = subprocess.run([str(ATOMR), "up", "--port", "9000", "--max-body-mb", "2", "--allowed-origins", "*"],
                          capture_output=True,
                          text=True, timeout=60, env={**os.environ, "NO_COLOR": "1", "RAY_ADDRESS": "127.0.0.1:1"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip() == (
        "error: --port, --max-body-mb, --allowed-origins: for the HTTP API, which only --serve starts "
        "(or use `atomr serve`)"
    ), proc.stderr
    assert proc.stdout == ""  # nothing started
