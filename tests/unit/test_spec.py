"""The deployment spec's validation rules, as a user writing YAML meets them.

Every rejection must name the field (a dotted path) and show the bad value, so the user can
fix the file from the message alone.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from atomr_infer.errors import SpecError, SpecProblem
from atomr_infer.models.registry import BUNDLED_MODELS
from atomr_infer.spec import Budget, Deployment, Serving, VllmConfig, load_deployments, parse_deployment

BASE: dict[str, Any] = {"name": "demo", "model": "org/model"}

# Every field set to a valid value that is not its default.
FULL: dict[str, Any] = {
    "name": "full-spec-1",
    "model": "google/gemma-4-E4B-it",
    "runtime": "vllm",
    "device": "auto",  # (cuda refuses the CPU settings it sets too)
    "runtime_config": {
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.85,
        "max_model_len": 8192,
        "hf_cache_dir": "/data/hf",
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": False,
        "max_num_seqs": 128,
        "block_size": 32,
        "quantization": "fp8",
        "limit_mm_per_prompt": {"image": 2, "audio": 0, "video": {"count": 1, "num_frames": 32}},
        "cpu_offload_gb": 4.0,
        "runner": "generate",
        "convert": "none",
        "cpu_kvcache_space_gb": 2.5,
        "cpu_threads": 4,
        "engine_metrics": False,
        "extra_engine_args": {"swap_space": 8, "seed": 7, "kv_cache_dtype": "fp8"},
    },
    "gpus": 2,
    "replicas": 3,
    "autoscaling": {
        "min_replicas": 1,
        "max_replicas": 4,
        "target_ongoing_requests": 8.0,
        "upscale_delay_s": 5.0,
        "downscale_delay_s": 120.0,
        "look_back_period_s": 10.0,
        "cold_start_timeout_s": 60.0,
    },
    "placement": "pack",
    "routing": {"policy": "prefix_affinity", "load_bound": 1.5, "adapter_affinity": False},
    "serving": {
        "max_concurrent": 16,
        "on_capacity_exhausted": "reject",
        "openai": {
            "served_model_name": ["gemma-4", "gemma"],
            "chat_template": "{{ messages }}",
            "tool_call_parser": "gemma4",
            "enable_auto_tool_choice": True,
            "reasoning_parser": "gemma4",
            "generation_config": "vllm",
            "override_generation_config": {"temperature": 0.6},
            "server_args": {"response_role": "bot"},
            "response_store": {"enabled": True, "max_responses": 500, "max_age_s": 600.0},
        },
        "rate_limits": {"requests_per_minute": 600, "tokens_per_minute": 60000},
        "migration": {"enabled": False, "max_tries": 3},
    },
    "lora": {"adapters": {"french": "/srv/adapters/french"}, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4},
    "budget": {"max_spend_per_hour_usd": 5.0, "max_spend_per_day_usd": 100.0, "on_exceeded": "warn"},
    "restart_on_apply": True,
}


def with_field(path: str, value: Any, doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of ``doc`` (BASE by default) with the dotted ``path`` set to ``value``."""
    out: dict[str, Any] = {**(BASE if doc is None else doc)}
    *parents, leaf = path.split(".")
    node = out
    for part in parents:
        node[part] = dict(node.get(part) or {})
        node = node[part]
    node[leaf] = value
    return out


def spec(**fields: Any) -> dict[str, Any]:
    """BASE with each dotted path in ``fields`` set."""
    doc: dict[str, Any] = {**BASE}
    for path, value in fields.items():
        doc = with_field(path, value, doc)
    return doc


def problems_of(doc: Any) -> list[SpecProblem]:
    with pytest.raises(SpecError) as info:
        parse_deployment(doc)
    return info.value.problems


def one_problem(doc: Any) -> SpecProblem:
    found = problems_of(doc)
    assert len(found) == 1, [str(p) for p in found]
    return found[0]


def load_problems(*sources: Any) -> list[SpecProblem]:
    with pytest.raises(SpecError) as info:
        load_deployments(*sources)
    return info.value.problems


def write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    "name",
    ["Demo", "DEMO", "my_model", "a" * 64, "-demo", "demo-", "-", "", "my model", "demo.v2", "déjà"],
    ids=[
        "uppercase",
        "all-caps",
        "underscore",
        "64-chars",
        "leading-dash",
        "trailing-dash",
        "only-dash",
        "empty",
        "space",
        "dot",
        "non-ascii",
    ],
)
def test_bad_name_is_rejected_with_the_value_and_the_rule(name: str) -> None:
    problem = one_problem(with_field("name", name))
    assert problem.field == "name"
    assert repr(name) in problem.message
    assert "1-63 lowercase letters, digits and '-'" in problem.message


@pytest.mark.parametrize("name", ["a", "0", "a" * 63, "gemma-4-e4b", "x1-2-3"])
def test_good_names_are_accepted(name: str) -> None:
    assert parse_deployment(with_field("name", name)).name == name


# ----------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    ("path", "key", "suggestion"),
    [
        ("replcas", "replcas", "replicas"),
        ("runtime_config.max_num_seq", "max_num_seq", "max_num_seqs"),
        ("serving.max_concurent", "max_concurent", "max_concurrent"),
        ("budget.on_exceed", "on_exceed", "on_exceeded"),
        ("runtime_config.gpu_mem_utilization", "gpu_mem_utilization", "gpu_memory_utilization"),
    ],
)
def test_unknown_key_names_its_path_and_suggests_the_close_one(path: str, key: str, suggestion: str) -> None:
    problem = one_problem(with_field(path, 2))
    assert problem.field == path
    assert f"unknown key {key!r}" in problem.message
    assert f"did you mean {suggestion!r}?" in problem.message


@pytest.mark.parametrize(
    ("path", "model"),
    [("xyzzy", Deployment), ("runtime_config.zzzzzz", VllmConfig), ("serving.qqq", Serving), ("budget.xyzzy", Budget)],
)
def test_unknown_key_with_no_close_match_lists_the_allowed_keys(path: str, model: type) -> None:
    problem = one_problem(with_field(path, 1))
    assert problem.field == path
    key = path.rsplit(".", 1)[-1]
    assert f"unknown key {key!r}" in problem.message
    assert "did you mean" not in problem.message
    assert "allowed keys: " + ", ".join(model.model_fields) in problem.message


# ------------------------------------------------------------------------------ wrong types


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("replicas", "3", "valid integer"),
        ("replicas", True, "valid integer"),
        ("replicas", 2.0, "valid integer"),
        ("gpus", "1", "valid integer"),
        ("gpus", False, "valid integer"),
        ("runtime_config.max_model_len", "4096", "valid integer"),
        ("runtime_config.max_model_len", True, "valid integer"),
        ("serving.max_concurrent", "32", "valid integer"),
        ("runtime_config.gpu_memory_utilization", "0.9", "valid number"),
        ("runtime_config.gpu_memory_utilization", True, "valid number"),
        ("runtime_config.cpu_offload_gb", "4", "valid number"),
        ("budget.max_spend_per_hour_usd", "5", "valid number"),
        ("idempotent", "yes", "valid boolean"),
        ("idempotent", 1, "valid boolean"),
        ("restart_on_apply", "yes", "valid boolean"),
        ("restart_on_apply", 1, "valid boolean"),
        ("runtime_config.enforce_eager", "true", "valid boolean"),
        ("name", 5, "valid string"),
        ("model", ["org/model"], "valid string"),
        ("runtime_config.hf_cache_dir", 3, "valid string"),
        ("serving", ["max_concurrent", 4], "valid dictionary"),
        ("runtime_config", [{"dtype": "half"}], "valid dictionary"),
        ("budget", [5], "valid dictionary"),
        ("serving", "fast", "valid dictionary"),
        ("runtime_config.extra_engine_args", ["seed", 1], "valid dictionary"),
        ("runtime_config.limit_mm_per_prompt", ["image"], "valid dictionary"),
        ("autoscaling", 5, "valid dictionary"),
        ("autoscaling", "fast", "valid dictionary"),
        ("serving.openai.response_store.max_age_s", "60", "valid number"),
        ("serving.openai.response_store.max_age_s", True, "valid number"),
        ("runtime_config.block_size", True, "valid integer"),
        ("runtime_config.block_size", "16", "valid integer"),
        ("lora.max_lora_rank", True, "valid integer"),
        ("lora.max_lora_rank", "16", "valid integer"),
    ],
)
def test_wrong_type_is_not_coerced(path: str, value: Any, expected: str) -> None:
    problem = one_problem(with_field(path, value))
    assert problem.field == path
    assert expected in problem.message
    assert problem.message.endswith(f"got {value!r}")


def test_wrong_type_inside_a_mapping_names_the_key() -> None:
    problem = one_problem(spec(**{"runtime_config.limit_mm_per_prompt": {"image": "1"}}))
    assert problem.field == "runtime_config.limit_mm_per_prompt.image"
    assert "should be a count of 0 to 1024" in problem.message and "got '1'" in problem.message


@pytest.mark.parametrize(("limits", "expected"), [
    ({"image": {"count": 2, "widht": 512}}, "image.widht is not an option of image (its options: count, width"),
    ({"video": {"count": 1, "num_frames": 0}}, "video.num_frames is 0: vLLM wants a size of 1 or more"),
])
def test_a_modalitys_profiling_options_vllm_refuses_are_said(limits, expected) -> None:
    """vLLM refuses unknown keys and sizes of 0 there for a multimodal model (each replica failed
    after loading it) and ignores them for a text model (those ran): a warning, not a refusal, as a
    restarted manager stops the replicas of a stored spec it refuses."""
    with pytest.warns(FutureWarning, match=re.escape(f"runtime_config.limit_mm_per_prompt.{expected}")):
        parse_deployment(spec(**{"runtime_config.limit_mm_per_prompt": limits}))
    problem = one_problem(spec(**{"runtime_config.limit_mm_per_prompt": {"image": {"count": -1}}}))
    assert problem.field == "runtime_config.limit_mm_per_prompt.image.count"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_deployment(spec(**{"runtime_config.limit_mm_per_prompt": {"video": {"count": 1, "num_frames": 8},
                                                                         "audio": {"count": 1, "length": 16000},
                                                                         "vision_chunk": {"count": 1, "x": 0}}}))


@pytest.mark.parametrize("name", ["cpu_kvcache_space_gb", "cpu_threads"])
def test_a_cpu_replicas_settings_on_device_cuda_are_said_to_do_nothing(name) -> None:
    """They were accepted without a word, and nothing reads them on a GPU. A warning, not a
    refusal: a restarted manager stops the replicas of a stored spec it refuses."""
    with pytest.warns(FutureWarning, match=rf"runtime_config.{name} is set but device is cuda, where it does nothing"):
        parse_deployment(spec(**{"device": "cuda", f"runtime_config.{name}": 4}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_deployment(spec(**{"device": "auto", f"runtime_config.{name}": 4}))  # auto may run on CPUs


def test_null_for_a_section_reads_as_left_out_but_not_for_a_setting() -> None:
    # ``serving:`` with nothing after it in YAML is None: every key under it commented out.
    assert parse_deployment(with_field("serving", None)).serving.max_concurrent == 32
    problem = one_problem(with_field("serving.max_concurrent", None))
    assert problem.field == "serving.max_concurrent"
    assert "got None" in problem.message


def test_long_bad_values_are_shortened_in_messages() -> None:
    value = "x" * 500
    problem = one_problem(with_field("device", value))
    assert problem.field == "device"
    assert len(problem.message) < 200
    assert problem.message.endswith("...")


# ------------------------------------------------------------------------------ number ranges


@pytest.mark.parametrize(
    ("path", "value", "bound"),
    [
        ("replicas", -1, "greater than or equal to 0"),
        ("replicas", 5000, "less than or equal to 1024"),
        ("gpus", 0, "greater than or equal to 1"),
        ("gpus", 1000, "less than or equal to 64"),
        ("gpus", -2, "greater than or equal to 1"),
        ("runtime_config.gpu_memory_utilization", 0, "greater than 0"),
        ("runtime_config.gpu_memory_utilization", 0.0, "greater than 0"),
        ("runtime_config.gpu_memory_utilization", -0.5, "greater than 0"),
        ("runtime_config.gpu_memory_utilization", 1.5, "less than or equal to 1"),
        ("runtime_config.gpu_memory_utilization", float("nan"), "less than or equal to 1"),
        ("runtime_config.max_model_len", 8, "greater than or equal to 16"),
        ("runtime_config.max_model_len", 10**9, "less than or equal to 10485760"),
        ("runtime_config.tensor_parallel_size", 0, "greater than or equal to 1"),
        ("runtime_config.max_num_seqs", 0, "greater than or equal to 1"),
        ("runtime_config.limit_mm_per_prompt.image", -1, "should be a count of 0 to 1024"),
        ("serving.max_concurrent", 0, "greater than or equal to 1"),
        ("serving.max_concurrent", -4, "greater than or equal to 1"),
        ("runtime_config.cpu_offload_gb", -1, "greater than or equal to 0"),
        ("runtime_config.cpu_offload_gb", float("inf"), "less than or equal to 4096"),
        ("runtime_config.cpu_kvcache_space_gb", 0, "greater than 0"),
        ("runtime_config.cpu_kvcache_space_gb", -1.5, "greater than 0"),
        ("runtime_config.cpu_threads", 0, "greater than or equal to 1"),
        ("budget.max_spend_per_hour_usd", 0, "greater than 0"),
        ("budget.max_spend_per_hour_usd", -5, "greater than 0"),
        ("budget.max_spend_per_hour_usd", float("nan"), "less than or equal to 1000000"),
        ("budget.max_spend_per_day_usd", 0, "greater than 0"),
        ("budget.max_spend_per_day_usd", -0.01, "greater than 0"),
    ],
)
def test_out_of_range_number_names_the_bound_and_the_value(path: str, value: float, bound: str) -> None:
    problem = one_problem(with_field(path, value))
    assert problem.field == path
    assert bound in problem.message
    assert problem.message.endswith(f"got {value!r}")


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("replicas", 0),
        ("replicas", 1024),
        ("gpus", 64),
        ("runtime_config.gpu_memory_utilization", 1),
        ("runtime_config.gpu_memory_utilization", 0.01),
        ("runtime_config.max_model_len", 16),
        ("runtime_config.max_model_len", 10_485_760),
        ("runtime_config.cpu_offload_gb", 0),
        ("runtime_config.cpu_kvcache_space_gb", 0.25),
        ("serving.max_concurrent", 1),
        ("budget.max_spend_per_hour_usd", 0.01),
    ],
)
def test_numbers_at_the_edges_of_their_range_are_accepted(path: str, value: float) -> None:
    dep = parse_deployment(with_field(path, value))
    node: Any = dep
    for part in path.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    assert node == value


def test_daily_budget_below_hourly_names_both_values() -> None:
    problem = one_problem(spec(**{"budget.max_spend_per_hour_usd": 10, "budget.max_spend_per_day_usd": 5}))
    assert problem.field == "budget.max_spend_per_day_usd"
    assert "5" in problem.message
    assert "budget.max_spend_per_hour_usd (10)" in problem.message


def test_daily_budget_equal_to_hourly_is_accepted() -> None:
    dep = parse_deployment(spec(**{"budget.max_spend_per_hour_usd": 10, "budget.max_spend_per_day_usd": 10}))
    assert dep.budget is not None and dep.budget.max_spend_per_day_usd == 10


# ------------------------------------------------------------------------------------ literals


@pytest.mark.parametrize(
    ("path", "value", "allowed"),
    [
        ("device", "tpu", "'auto', 'cuda' or 'cpu'"),
        ("device", "CUDA", "'auto', 'cuda' or 'cpu'"),
        ("device", "gpu", "'auto', 'cuda' or 'cpu'"),
        ("runtime", "sglang", "'vllm'"),
        ("runtime_config.dtype", "int8", "'auto', 'half', 'float16', 'bfloat16', 'float' or 'float32'"),
        ("runtime_config.dtype", "bf16", "'auto', 'half', 'float16', 'bfloat16', 'float' or 'float32'"),
        ("serving.on_capacity_exhausted", "drop", "'queue' or 'reject'"),
        ("budget.on_exceeded", "ignore", "'reject' or 'warn'"),
        ("budget.on_exceeded", False, "'reject' or 'warn'"),  # YAML `on_exceeded: no`
        ("runtime_config.block_size", 24, "1, 8, 16, 32, 64, 128 or 256"),
        ("runtime_config.block_size", 0, "1, 8, 16, 32, 64, 128 or 256"),
        ("lora.max_lora_rank", 100, "1, 8, 16, 32, 64, 128, 256, 320 or 512"),
    ],
)
def test_bad_literal_lists_the_allowed_values(path: str, value: Any, allowed: str) -> None:
    problem = one_problem(with_field(path, value))
    assert problem.field == path
    assert allowed in problem.message
    assert problem.message.endswith(f"got {value!r}")


# ---------------------------------------------------------------------------------------- model


def test_unknown_bundled_model_lists_the_bundled_ones() -> None:
    problem = one_problem(with_field("model", "bundled:llama-70b"))
    assert problem.field == "model"
    assert "'bundled:llama-70b'" in problem.message
    for name in BUNDLED_MODELS:
        assert f"bundled:{name}" in problem.message


@pytest.mark.parametrize(
    "model",
    [
        "a/b/c",
        "has space",
        "org/model name",
        "https://huggingface.co/org/model",
        "org/a--b",
        "org/a..b",
        "-org/model",
        "org/-model",
        "org/",
        "org//model",
        "org/" + "m" * 97,
        "C:\\models\\x",
    ],
)
def test_bad_model_string_is_rejected_with_the_value(model: str) -> None:
    problem = one_problem(with_field("model", model))
    assert problem.field == "model"
    assert repr(model) in problem.message
    assert "HF repo id" in problem.message


@pytest.mark.parametrize("model", ["", "   "])
def test_empty_model_is_rejected(model: str) -> None:
    problem = one_problem(with_field("model", model))
    assert problem.field == "model"
    assert "model is empty" in problem.message


@pytest.mark.parametrize(
    "model",
    [
        "gpt2",
        "org/model",
        "google/gemma-4-E4B-it",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        "org/model_v1.5",
        "/abs/path/model",
        "./relative/model",
        "../up/model",
        "~/models/x",
        *(f"bundled:{n}" for n in BUNDLED_MODELS),
    ],
)
def test_good_model_strings_are_accepted(model: str) -> None:
    assert parse_deployment(with_field("model", model)).model == model


# --------------------------------------------------------------------------- cross-field rules


def test_tensor_parallel_size_must_equal_gpus() -> None:
    problem = one_problem(spec(gpus=2, **{"runtime_config.tensor_parallel_size": 4}))
    assert problem.field == "runtime_config.tensor_parallel_size"
    assert "is 4" in problem.message
    assert "gpus is 2" in problem.message


def test_tensor_parallel_size_equal_to_gpus_is_accepted() -> None:
    dep = parse_deployment(spec(gpus=4, **{"runtime_config.tensor_parallel_size": 4}))
    assert dep.tensor_parallel_size == 4


@pytest.mark.parametrize(
    ("keys", "instead"),
    [
        (["max_num_seqs"], "runtime_config.max_num_seqs"),
        (["tensor_parallel_size"], "runtime_config.tensor_parallel_size"),
        (["gpu_memory_utilization"], "runtime_config.gpu_memory_utilization"),
        (["model"], "set model instead"),
        (["download_dir"], "runtime_config.hf_cache_dir"),
        (["dtype", "max_num_seqs"], "runtime_config.dtype, runtime_config.max_num_seqs"),
    ],
)
def test_extra_engine_args_may_not_shadow_a_typed_field(keys: list[str], instead: str) -> None:
    problem = one_problem(spec(**{"runtime_config.extra_engine_args": {k: 1 for k in keys}}))
    assert problem.field == "runtime_config.extra_engine_args"
    for key in keys:
        assert repr(key) in problem.message
    assert instead in problem.message


def test_extra_engine_args_pass_other_keys_through() -> None:
    extra = {"swap_space": 4, "seed": 0, "kv_cache_dtype": "fp8"}
    dep = parse_deployment(spec(**{"runtime_config.extra_engine_args": extra}))
    assert dep.runtime_config.extra_engine_args == extra


# --------------------------------------------------------------------------- missing / document


@pytest.mark.parametrize("missing", ["name", "model"])
def test_missing_required_field(missing: str) -> None:
    doc = {k: v for k, v in BASE.items() if k != missing}
    problem = one_problem(doc)
    assert problem.field == missing
    assert "required field is missing" in problem.message


def test_every_problem_in_a_document_is_reported_at_once() -> None:
    doc = {"model": "org/model", "replicas": -1, "gpus": "2", "replcas": 3, "serving": {"max_concurent": 1}}
    fields = sorted(p.field for p in problems_of(doc))
    assert fields == ["gpus", "name", "replcas", "replicas", "serving.max_concurent"]


@pytest.mark.parametrize(
    ("text", "kind"),
    [("- name: demo\n- model: org/model\n", "a list"), ("just a string\n", "a string"), ("42\n", "a number")],
)
def test_document_that_is_not_a_mapping(tmp_path: Path, text: str, kind: str) -> None:
    path = write(tmp_path / "d.yaml", text)
    [problem] = load_problems(path)
    assert problem.source == str(path)
    assert problem.field == ""
    assert f"expected a mapping of deployment fields, got {kind}" in problem.message


@pytest.mark.parametrize("doc", [["name", "demo"], "name: demo"])
def test_parse_deployment_rejects_a_non_mapping(doc: Any) -> None:
    problem = one_problem(doc)
    assert "expected a mapping" in problem.message


# ------------------------------------------------------------------------------- files and dirs


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n", "---\n---\n"])
def test_empty_file(tmp_path: Path, text: str) -> None:
    path = write(tmp_path / "empty.yaml", text)
    [problem] = load_problems(path)
    assert problem.source == str(path)
    assert "file is empty" in problem.message


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("name: demo\n  model: org/model\n", 2),
        ("name: demo\nmodel: org/model\nruntime_config:\n  dtype: [half\n", 5),
        ("name: demo\nmodel: org/model\nserving: {max_concurrent: 4\n", 4),
        ("name: demo\nmodel: 'org/model\n", 3),
        ("name: demo\n\tmodel: org/model\n", 2),
    ],
)
def test_yaml_syntax_error_has_the_line_number(tmp_path: Path, text: str, line: int) -> None:
    path = write(tmp_path / "broken.yaml", text)
    [problem] = load_problems(path)
    assert problem.source == str(path)
    assert problem.message.startswith("invalid YAML")
    assert f"line {line}" in problem.message


def test_unreadable_file(tmp_path: Path) -> None:
    path = write(tmp_path / "secret.yaml", "name: demo\nmodel: org/model\n")
    path.chmod(0)
    try:
        if os.access(path, os.R_OK):
            pytest.skip("running with privileges that read a mode-000 file")
        [problem] = load_problems(path)
    finally:
        path.chmod(0o644)
    assert problem.source == str(path)
    assert "cannot read file" in problem.message
    assert "ermission denied" in problem.message


def test_non_utf8_file(tmp_path: Path) -> None:
    path = write(tmp_path / "latin1.yaml", "name: demo\nmodel: org/caf\xe9\n".encode("latin-1"))
    [problem] = load_problems(path)
    assert problem.source == str(path)
    assert "cannot read file" in problem.message
    assert "utf-8" in problem.message


def test_nonexistent_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    [problem] = load_problems(path)
    assert problem.source == str(path)
    assert "no such file or directory" in problem.message


def test_directory_with_no_yaml(tmp_path: Path) -> None:
    write(tmp_path / "readme.txt", "name: demo\nmodel: org/model\n")
    write(tmp_path / "spec.json", "{}")
    [problem] = load_problems(tmp_path)
    assert problem.source == str(tmp_path)
    assert "directory has no *.yaml or *.yml files" in problem.message


def test_duplicate_names_across_two_files(tmp_path: Path) -> None:
    first = write(tmp_path / "a.yaml", "name: demo\nmodel: org/one\n")
    second = write(tmp_path / "b.yaml", "name: demo\nmodel: org/two\n")
    [problem] = load_problems(tmp_path)
    assert problem.source == str(second)
    assert problem.field == "name"
    assert "'demo'" in problem.message
    assert f"already used by {first}" in problem.message


def test_duplicate_names_across_two_arguments(tmp_path: Path) -> None:
    path = write(tmp_path / "a.yaml", "name: demo\nmodel: org/one\n")
    [problem] = load_problems(path, {"name": "demo", "model": "org/two"})
    assert problem.source == "<dict>" and problem.field == "name"
    assert str(path) in problem.message


def test_duplicate_names_within_one_multi_document_file(tmp_path: Path) -> None:
    path = write(tmp_path / "multi.yaml", "name: demo\nmodel: org/one\n---\nname: demo\nmodel: org/two\n")
    [problem] = load_problems(path)
    assert problem.source == f"{path}#2"
    assert problem.field == "name"
    assert f"'demo' is already used by {path}#1" in problem.message


def test_multi_document_file_loads_every_deployment(tmp_path: Path) -> None:
    path = write(
        tmp_path / "multi.yaml", "name: one\nmodel: org/one\n---\nname: two\nmodel: org/two\nreplicas: 2\n---\n"
    )
    deps = load_deployments(path)
    assert [(d.name, d.model, d.replicas) for d in deps] == [("one", "org/one", 1), ("two", "org/two", 2)]


def test_problem_in_a_multi_document_file_names_the_document(tmp_path: Path) -> None:
    path = write(tmp_path / "multi.yaml", "name: one\nmodel: org/one\n---\nname: two\nmodel: org/two\nreplicas: -1\n")
    [problem] = load_problems(path)
    assert (problem.source, problem.field) == (f"{path}#2", "replicas")


def test_directory_loads_every_yaml_file_in_name_order(tmp_path: Path) -> None:
    write(tmp_path / "b.yaml", "name: bee\nmodel: org/b\n")
    write(tmp_path / "a.yml", "name: ay\nmodel: org/a\n")
    write(tmp_path / "nested" / "c.yaml", "name: sea\nmodel: org/c\n---\nname: dee\nmodel: org/d\n")
    write(tmp_path / "notes.txt", "not a spec")
    deps = load_deployments(tmp_path)
    assert [d.name for d in deps] == ["ay", "bee", "sea", "dee"]


def test_every_problem_in_every_file_is_collected(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yaml", "name: Bad\nmodel: org/a\n")
    b = write(tmp_path / "b.yaml", "name: fine\nmodel: org/b\nreplicas: x\n")
    c = write(tmp_path / "c.yaml", "name: ok\nmodel: org/c\n")
    missing = tmp_path / "missing.yaml"
    problems = load_problems(tmp_path, missing)
    assert [(p.source, p.field) for p in problems] == [(str(a), "name"), (str(b), "replicas"), (str(missing), "")]
    assert str(c) not in {p.source for p in problems}


def test_load_accepts_dicts_and_deployments() -> None:
    dep = parse_deployment(BASE)
    loaded = load_deployments({"name": "other", "model": "org/other"}, dep)
    assert [d.name for d in loaded] == ["other", "demo"]
    assert loaded[1] == dep


@pytest.mark.parametrize(("update", "field"), [({"replicas": -1}, "replicas"), ({"replicas": "2"}, "replicas"),
                                               ({"name": "Bad Name!"}, "name")])
def test_a_deployment_changed_by_model_copy_is_validated(update, field) -> None:
    """``model_copy(update=...)`` (how a frozen spec is changed, as docs/python.md does) skips
    pydantic's validation: apply and plan accepted -1 replicas, or a name no replica can have."""
    with pytest.raises(SpecError) as caught:
        parse_deployment(parse_deployment(BASE).model_copy(update=update))
    assert [p.field for p in caught.value.problems] == [field]


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:os.mkdir [{target}]",
        "!!python/object/new:pathlib.Path [{target}]",
        "!!python/name:os.system",
        "!!python/object:argparse.Namespace {{path: {target}}}",
    ],
)
def test_loading_uses_safe_yaml(tmp_path: Path, tag: str) -> None:
    target = tmp_path / "pwned"
    path = write(tmp_path / "evil.yaml", f"name: demo\nmodel: {tag.format(target=target)}\n")
    [problem] = load_problems(path)
    assert problem.source == str(path)
    assert problem.message.startswith("invalid YAML at line 2")
    assert "could not determine a constructor for the tag" in problem.message
    assert not target.exists()


# ---------------------------------------------------------------------------------- happy path


def test_every_field_set_round_trips() -> None:
    dep = parse_deployment(FULL)
    assert dep.model_dump() == FULL
    assert parse_deployment(dep.model_dump()) == dep


def test_every_field_set_round_trips_through_a_yaml_file(tmp_path: Path) -> None:
    path = write(tmp_path / "full.yaml", yaml.safe_dump(FULL, sort_keys=False))
    [dep] = load_deployments(path)
    assert dep.model_dump() == FULL


def test_defaults() -> None:
    dep = parse_deployment(BASE)
    assert dep.replicas == 1
    assert dep.gpus == 1
    assert dep.tensor_parallel_size == 1
    assert dep.runtime == "vllm"
    assert dep.device == "auto"
    assert dep.restart_on_apply is False and dep.idempotent is True
    assert dep.budget is None
    assert dep.serving == Serving(max_concurrent=32, on_capacity_exhausted="queue")
    cfg = dep.runtime_config
    assert cfg.extra_engine_args == {}
    assert cfg.engine_metrics is True  # vLLM's own metrics exported, as Ray Serve LLM does by default
    unset = {name: getattr(cfg, name) for name in VllmConfig.model_fields
             if name not in ("extra_engine_args", "engine_metrics")}
    assert unset == dict.fromkeys(unset)


def test_budget_defaults() -> None:
    budget = parse_deployment(spec(budget={})).budget
    assert budget == Budget(max_spend_per_hour_usd=None, max_spend_per_day_usd=None, on_exceeded="reject")


def test_whole_numbers_are_accepted_for_float_fields() -> None:
    dep = parse_deployment(spec(**{"runtime_config.cpu_offload_gb": 4, "budget.max_spend_per_hour_usd": 5}))
    assert dep.runtime_config.cpu_offload_gb == 4.0
    assert dep.budget is not None and dep.budget.max_spend_per_hour_usd == 5.0


def test_specs_are_immutable() -> None:
    dep = parse_deployment(BASE)
    with pytest.raises(ValueError):
        dep.replicas = 5  # type: ignore[misc]


def test_problem_renders_as_source_field_message() -> None:
    problem = SpecProblem("d.yaml", "serving.max_concurrent", "input should be greater than or equal to 1, got 0")
    assert str(problem) == "d.yaml: serving.max_concurrent: input should be greater than or equal to 1, got 0"
    assert str(SpecProblem("d.yaml", "", "file is empty")) == "d.yaml: file is empty"


@pytest.mark.parametrize("old, new", [(False, True), (True, False)])
def test_the_old_name_idempotent_is_accepted_with_a_warning(old: bool, new: bool) -> None:
    with pytest.warns(FutureWarning, match=f"idempotent is deprecated: write restart_on_apply: {str(new).lower()}"):
        dep = parse_deployment({**BASE, "idempotent": old})
    assert dep.restart_on_apply is new
    assert "idempotent" not in dep.model_dump()  # hashed and recorded by the new name only


def test_both_names_disagreeing_is_an_error_naming_the_old_one() -> None:
    problem = one_problem({**BASE, "idempotent": False, "restart_on_apply": False})
    assert problem.field == "idempotent"
    assert "keep restart_on_apply only" in problem.message


def test_on_cpu_tensor_parallel_size_need_not_equal_gpus() -> None:
    """docs/spec.md: on ``device: cpu`` the replica shards over CPU workers only as
    ``runtime_config.tensor_parallel_size`` says; it was refused unless ``gpus`` (a GPU
    reservation, none on cpu) said the same."""
    from atomr_infer.engine.vllm.engine_args import engine_args

    dep = parse_deployment(spec(device="cpu", **{"runtime_config.tensor_parallel_size": 2}))
    assert dep.gpus == 1 and engine_args(dep, "/m", "cpu", native_bf16=True)["tensor_parallel_size"] == 2


def test_local_paths_written_relative_are_made_absolute_from_the_spec_file(tmp_path: Path, monkeypatch) -> None:
    """The manager and the replicas resolve paths in their own working directory (the raylet's):
    `model: ./models/tiny` named a directory the replica did not have, after apply said fits."""
    project = tmp_path / "project"
    (project / "deployments").mkdir(parents=True)
    spec_file = write(project / "deployments" / "tiny.yaml", """
name: tiny
model: ../models/tiny
runtime_config: {hf_cache_dir: ./cache}
serving: {openai: {chat_template: ./chatml.jinja, generation_config: ./gen}}
lora: {adapters: {pirate: ../adapters/pirate, robot: org/robot-lora}}
""")
    monkeypatch.chdir(tmp_path)  # not the spec file's directory
    [dep] = load_deployments(spec_file)
    assert dep.model == str(project / "models" / "tiny")
    assert dep.runtime_config.hf_cache_dir == str(project / "deployments" / "cache")
    assert dep.serving.openai.chat_template == str(project / "deployments" / "chatml.jinja")
    assert dep.serving.openai.generation_config == str(project / "deployments" / "gen")
    for word in ("auto", "vllm"):  # not folders
        [named] = load_deployments({"name": "g", "model": "org/m", "serving": {"openai": {"generation_config": word}}})
        assert named.serving.openai.generation_config == word
    assert dep.lora.adapters == {"pirate": str(project / "adapters" / "pirate"), "robot": "org/robot-lora"}
    [from_dict] = load_deployments({"name": "d", "model": "./models/tiny"})  # from Python: the caller's directory
    assert from_dict.model == str(tmp_path / "models" / "tiny")
    [hub] = load_deployments({"name": "h", "model": "org/model"})  # a repo id stays one
    assert hub.model == "org/model"
