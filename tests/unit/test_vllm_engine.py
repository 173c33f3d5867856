"""How a Deployment becomes vLLM's engine arguments and environment (no vLLM import here)."""

from __future__ import annotations

import os

import pytest

from atomr_infer.engine.cpu import GiB
from atomr_infer.engine.vllm.engine_args import engine_args, prepare_environment
from atomr_infer.spec import parse_deployment

MULTIPROCESSING = "VLLM_ENABLE_V1_MULTIPROCESSING"


def deployment(**runtime_config):
    return parse_deployment({"name": "d", "model": "bundled:smollm2-135m-instruct", "runtime_config": runtime_config})


def test_unset_fields_are_left_to_vllm() -> None:
    args = engine_args(deployment(), "/models/m", "cuda")
    assert args == {"model": "/models/m", "tensor_parallel_size": 1, "disable_log_stats": False}


def test_set_fields_pass_through_and_cpu_kv_cache_becomes_bytes() -> None:
    dep = deployment(dtype="bfloat16", max_num_seqs=8, enforce_eager=True, cpu_kvcache_space_gb=1.5)
    cpu = engine_args(dep, "/m", "cpu")
    assert cpu["dtype"] == "bfloat16" and cpu["max_num_seqs"] == 8 and cpu["enforce_eager"] is True
    assert cpu["kv_cache_memory_bytes"] == int(1.5 * GiB)
    assert "kv_cache_memory_bytes" not in engine_args(dep, "/m", "cuda")  # a CPU-backend setting


def test_on_cpu_gpus_is_no_tensor_parallel_size_unless_the_spec_sets_one() -> None:
    """``gpus`` reserves GPUs; a CPU replica runs on one CPU worker unless the spec asks for more."""
    two = parse_deployment({"name": "d", "model": "bundled:smollm2-135m-instruct", "gpus": 2})
    assert engine_args(two, "/m", "cuda")["tensor_parallel_size"] == 2
    assert engine_args(two, "/m", "cpu")["tensor_parallel_size"] == 1
    asked = parse_deployment({"name": "d", "model": "bundled:smollm2-135m-instruct", "gpus": 2,
                              "runtime_config": {"tensor_parallel_size": 2}})
    assert engine_args(asked, "/m", "cpu")["tensor_parallel_size"] == 2


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (MULTIPROCESSING, "HF_HUB_CACHE", "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_on_cpu_the_engine_core_runs_in_process(clean_env: pytest.MonkeyPatch) -> None:
    prepare_environment(deployment(), "cpu")
    assert os.environ[MULTIPROCESSING] == "0"


def test_on_gpu_vllm_keeps_its_core_process(clean_env: pytest.MonkeyPatch) -> None:
    prepare_environment(deployment(), "cuda")
    assert MULTIPROCESSING not in os.environ


def test_the_user_may_override_the_core_process_choice(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(MULTIPROCESSING, "1")
    prepare_environment(deployment(), "cpu")
    assert os.environ[MULTIPROCESSING] == "1"


def test_hf_cache_dir_is_exported_before_vllm_is_imported(clean_env: pytest.MonkeyPatch) -> None:
    prepare_environment(deployment(hf_cache_dir="/data/hf"), "cpu")
    assert os.environ["HF_HUB_CACHE"] == "/data/hf"


def test_a_vllm_outside_the_tested_range_is_refused_naming_both_versions() -> None:
    from atomr_infer.engine.vllm.engine_args import SUPPORTED_VLLM, check_vllm_version
    from atomr_infer.errors import EngineError

    for ok in ("0.32.0", "0.32.3", "0.32.0+cpu"):
        check_vllm_version(ok)
    with pytest.raises(EngineError) as info:
        check_vllm_version("0.33.0")
    assert "0.33.0" in str(info.value) and SUPPORTED_VLLM in str(info.value)
    import vllm

    check_vllm_version(vllm.__version__)  # what make setup installed is in the range


def test_unknown_parser_names_are_refused_with_a_suggestion() -> None:
    from atomr_infer.engine.vllm.engine_args import check_server_options
    from atomr_infer.errors import SpecError

    def with_openai(**openai):
        return parse_deployment({"name": "d", "model": "org/m", "serving": {"openai": openai}})

    ok = with_openai(tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser="gemma4")
    check_server_options(ok)
    with pytest.raises(SpecError) as info:
        check_server_options(with_openai(tool_call_parser="hermess", reasoning_parser="gemma5"))
    fields = [p.field for p in info.value.problems]
    assert fields == ["serving.openai.tool_call_parser", "serving.openai.reasoning_parser"]
    assert "did you mean 'hermes'?" in str(info.value) and "'gemma5'" in str(info.value)


def test_a_tensor_parallel_replica_on_gpus_runs_vllms_worker_processes_in_its_actor() -> None:
    """In a placement group (as the replica was) vLLM picks its Ray executor inside a Ray actor,
    which refuses a bundle of several GPUs ("Placement group bundle cannot have more than 1 GPU")
    and would wait for GPUs the actor holds: every ``gpus`` > 1 replica failed at engine start.
    The actor now holds its GPUs itself (ray_replicas.py) and vLLM runs one process per GPU."""
    three = parse_deployment({"name": "d", "model": "m", "device": "cuda", "gpus": 3})
    assert engine_args(three, "/m", "cuda")["distributed_executor_backend"] == "mp"
    assert "distributed_executor_backend" not in engine_args(deployment(), "/m", "cuda")


@pytest.mark.parametrize("key, value, kept", [
    ("pipeline_parallel_size", 2, 1), ("data_parallel_size", 2, 1), ("nnodes", 2, 1),
    ("prefill_context_parallel_size", 2, 1),  # vLLM multiplies it into the world size
    ("data_parallel_size_local", 2, 1), ("node_rank", 1, 0), ("distributed_executor_backend", "ray", None),
    ("data_parallel_external_lb", True, False), ("data_parallel_hybrid_lb", True, False),
    ("data_parallel_multi_port_external_lb", True, False), ("data_parallel_rank", 0, None),
    ("data_parallel_start_rank", 1, None),
])
def test_a_parallel_layout_beyond_one_tensor_parallel_group_is_refused(key, value, kept) -> None:
    """They took GPUs (or nodes) the replica never reserved: the budget counts ``gpus``."""
    from atomr_infer.errors import SpecError

    with pytest.raises(SpecError) as info:
        deployment(extra_engine_args={key: value})
    [problem] = info.value.problems
    assert problem.field.startswith("runtime_config.extra_engine_args") and key in str(problem), problem
    if kept is not None:
        assert problem.field == f"runtime_config.extra_engine_args.{key}" and repr(value) in problem.message
        assert deployment(extra_engine_args={key: kept})  # the value atomr runs with


def test_device_ids_are_refused_whatever_they_say() -> None:
    """vLLM would pick GPUs by index, outside those Ray reserved for the replica."""
    from atomr_infer.errors import SpecError

    for ids in ([3], [0], None):
        with pytest.raises(SpecError) as info:
            deployment(extra_engine_args={"device_ids": ids})
        [problem] = info.value.problems
        assert problem.field == "runtime_config.extra_engine_args.device_ids", problem
        assert problem.message.startswith(f"is {ids!r}, but the replica runs on the GPUs Ray reserved"), problem
        assert "\n" not in str(problem)


def test_two_sizes_of_the_cpu_kv_cache_are_refused() -> None:
    from atomr_infer.errors import SpecError

    with pytest.raises(SpecError, match="kv_cache_memory_bytes: and runtime_config.cpu_kvcache_space_gb both size"):
        deployment(cpu_kvcache_space_gb=1, extra_engine_args={"kv_cache_memory_bytes": 100 * GiB})


def test_a_cpu_replica_refuses_a_vllm_built_for_gpus() -> None:
    """vLLM's CUDA build picks the GPU from NVML whatever the actor reserved (none, on cpu): the
    replica ran on an unreserved GPU, sized as a CPU replica. Refused, saying what to install."""
    from atomr_infer.engine.vllm.engine_args import check_cpu_build
    from atomr_infer.errors import DeviceUnavailable

    check_cpu_build(deployment(), "cpu")
    with pytest.raises(DeviceUnavailable, match="vLLM here is its cuda build.*hint: install vLLM's CPU build"):
        check_cpu_build(deployment(), "cuda")


def test_max_model_len_above_the_models_context_is_refused_at_apply(tmp_path, monkeypatch) -> None:
    """vLLM refuses it only at engine start: three full model loads, then the deployment failed."""
    import json

    from atomr_infer.engine.vllm.spec_check import check_spec
    from atomr_infer.errors import SpecError

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "num_hidden_layers": 2,
                                                      "rope_parameters": {"rope_type": "default"}}))  # no factor
    spec = {"name": "d", "model": str(tmp_path), "device": "cpu"}
    with pytest.raises(SpecError, match=r"runtime_config.max_model_len: 16384 is above the model's context length, "
                                        r"8192 \(max_position_embeddings\)"):
        check_spec(parse_deployment({**spec, "runtime_config": {"max_model_len": 16384}}))
    check_spec(parse_deployment({**spec, "runtime_config": {"max_model_len": 8192}}))
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # as vLLM: allowed when told
    check_spec(parse_deployment({**spec, "runtime_config": {"max_model_len": 16384}}))
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN")
    # As vLLM 0.32 derives it: the tokenizer's model_max_length counts only for a pooling model with
    # absolute position embeddings (it refused 8192 for a generating model whose tokenizer says 4096)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 4096}))
    check_spec(parse_deployment({**spec, "runtime_config": {"max_model_len": 8192}}))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192,
                                                      "position_embedding_type": "absolute"}))  # BERT-like
    with pytest.raises(SpecError, match=r"4096 \(model_max_length in tokenizer_config.json\)"):
        check_spec(parse_deployment({**spec, "runtime_config": {"max_model_len": 8192}}))
    # a config's own model_max_length overrides the other keys (Command-R); hf_overrides: vLLM's to judge
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "model_max_length": 131072}))
    check_spec(parse_deployment({**spec, "runtime_config": {"max_model_len": 16384}}))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    check_spec(parse_deployment({**spec, "runtime_config": {
        "max_model_len": 16384, "extra_engine_args": {"hf_overrides": {"max_position_embeddings": 16384}}}}))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192,
                                                      "rope_scaling": {"rope_type": "linear", "factor": 4.0}}))
    check_spec(parse_deployment({**spec, "runtime_config": {"max_model_len": 16384}}))  # scaled: vLLM's to judge


def test_a_chat_template_that_is_not_there_is_refused_before_the_engine_loads(tmp_path) -> None:
    from atomr_infer.engine.vllm.engine_args import check_server_options
    from atomr_infer.errors import SpecError

    def spec(template):
        return parse_deployment({"name": "d", "model": "bundled:smollm2-135m-instruct",
                                 "serving": {"openai": {"chat_template": template}}})

    with pytest.raises(SpecError, match=r"serving.openai.chat_template: '/nowhere/chatml.jinja' on this node: .*"
                                        r"path-like, but doesn't exist"):
        check_server_options(spec("/nowhere/chatml.jinja"))
    (tmp_path / "chatml.jinja").write_text("{{ messages }}")
    check_server_options(spec(str(tmp_path / "chatml.jinja")))
    check_server_options(spec("{% for m in messages %}{{ m.content }}{% endfor %}"))  # inline


def test_an_unknown_quantization_or_kv_cache_dtype_is_refused_at_apply_and_on_the_replica(monkeypatch) -> None:
    """vLLM refused them only once the model was fetched and its config read."""
    from typing import get_args

    from vllm.config.cache import CacheDType
    from vllm.model_executor.layers.quantization import QuantizationMethods

    from atomr_infer.engine.vllm import spec_check
    from atomr_infer.engine.vllm.engine_args import check_engine_names
    from atomr_infer.errors import SpecError

    assert spec_check.quantization_names() == frozenset(get_args(QuantizationMethods))  # read without vLLM
    assert spec_check.literal_names("config/cache.py", "CacheDType") == frozenset(get_args(CacheDType))
    bad = deployment(quantization="awqq", extra_engine_args={"kv_cache_dtype": "fp9"})
    for check in (spec_check.check_spec, check_engine_names):
        with pytest.raises(SpecError) as info:
            check(bad)
        assert [str(p) for p in info.value.problems] == [
            "d: runtime_config.quantization: 'awqq' is not a vLLM quantization method (did you mean 'awq'?)",
            "d: runtime_config.extra_engine_args.kv_cache_dtype: 'fp9' is not a vLLM KV-cache dtype "
            "(did you mean 'fp8'?)",
        ]
        check(deployment(quantization="fp8", extra_engine_args={"kv_cache_dtype": "fp8_e5m2"}))

    class Plugin:  # a plugin's own quantization method: the manager cannot know it, the replica can
        value = "acme_quant.plugin:register"

    monkeypatch.setattr(spec_check, "entry_points", lambda group: [Plugin()])
    spec_check.check_spec(deployment(quantization="acme_int3"))


def test_an_extra_engine_arg_of_the_wrong_type_is_refused_naming_it_before_the_model_is_fetched(monkeypatch) -> None:
    """`max_num_batched_tokens: "lots"` failed on the replica after the model download, with
    "Input should be a valid integer, …" and no field name. The manager refuses it at apply (the
    simple types read from vLLM's source), the replica with vLLM's own types before it fetches."""
    from vllm import EngineArgs

    from atomr_infer.engine.vllm import engine_args as args_module
    from atomr_infer.engine.vllm.arg_checks import dataclass_hints
    from atomr_infer.engine.vllm.spec_check import check_spec, engine_arg_scalar_types
    from atomr_infer.errors import SpecError

    scalars, hints = engine_arg_scalar_types(), dataclass_hints(EngineArgs)
    assert scalars["max_num_batched_tokens"] == int | None and len(scalars) > 100
    assert all(hints[name] == hint for name, hint in scalars.items())  # read by ast as vLLM has them
    lots = "d: runtime_config.extra_engine_args.max_num_batched_tokens: 'lots' does not fit vLLM's type, int | None: " \
           "input should be a valid integer, unable to parse string as an integer"
    bad = deployment(extra_engine_args={"max_num_batched_tokens": "lots", "compilation_config": {"mode": "x"}})
    with pytest.raises(SpecError) as at_apply:
        check_spec(bad)
    assert [str(p) for p in at_apply.value.problems] == [lots]  # a vLLM config class: the replica's to check
    check_spec(deployment(extra_engine_args={"max_num_batched_tokens": "2048", "async_scheduling": True}))  # as vLLM

    def no_download(*_args, **_kwargs):
        raise AssertionError("the model was fetched before the spec was checked")

    monkeypatch.setattr("atomr_infer.models.resolve.resolve_model", no_download)
    for name in (MULTIPROCESSING, "VLLM_LOGGING_LEVEL"):  # restored after the test
        monkeypatch.setenv(name, os.environ.get(name, "0" if name == MULTIPROCESSING else "WARNING"))
    monkeypatch.setattr(args_module, "check_cpu_build", lambda *_: None)  # whichever build is here
    with pytest.raises(SpecError) as on_replica:
        args_module.build_vllm_engine(parse_deployment({"name": "d", "model": "org/m", "device": "cpu",
                                                        "runtime_config": bad.runtime_config.model_dump()}))
    assert str(on_replica.value.problems[0]) == lots
    assert str(on_replica.value.problems[1]).startswith(
        "d: runtime_config.extra_engine_args.compilation_config: {'mode': 'x'} does not fit vLLM's type, "
        "CompilationConfig: mode: invalid compilation mode: x.")


def test_a_generation_config_folder_that_is_not_there_is_refused_before_the_model_is_fetched(tmp_path) -> None:
    """vLLM falls back to its own sampling defaults without a word when the folder is missing."""
    from atomr_infer.engine.vllm.engine_args import check_server_options
    from atomr_infer.errors import SpecError

    def spec(folder):
        return parse_deployment({"name": "d", "model": "org/m", "serving": {"openai": {"generation_config": folder}}})

    with pytest.raises(SpecError) as info:
        check_server_options(spec(str(tmp_path / "gen")))
    assert str(info.value.problems[0]) == (f"d: serving.openai.generation_config: '{tmp_path / 'gen'}' on this node: "
                                           "no such folder (vLLM would quietly serve its own sampling defaults)")
    (tmp_path / "gen").mkdir()
    for folder in (str(tmp_path / "gen"), "auto", "vllm", "org/generation-config"):
        check_server_options(spec(folder))


def built_config(monkeypatch, bundled_model_dir, **spec) -> tuple[object, dict]:
    """The ``VllmConfig`` the replica builds its engine from, and what else it passes vLLM (no engine starts)."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.llm_engine import LLMEngine

    from atomr_infer.engine.vllm import engine_args as args_module
    from atomr_infer.models.resolve import ResolvedModel

    got: dict = {}

    def capture(vllm_config, **kwargs):
        got.update(kwargs, config=vllm_config)
        return "engine"

    def from_args(args, usage_context=UsageContext.ENGINE_CONTEXT, **kwargs):  # as vLLM's, without the engine
        return capture(args.create_engine_config(usage_context), usage_context=usage_context, **kwargs)

    for name in (MULTIPROCESSING, "VLLM_LOGGING_LEVEL"):  # restored after the test
        monkeypatch.setenv(name, os.environ.get(name, "0" if name == MULTIPROCESSING else "WARNING"))
    monkeypatch.setattr("atomr_infer.models.resolve.resolve_model",
                        lambda model, **_kw: ResolvedModel(bundled_model_dir, "bundled", model))
    monkeypatch.setattr(args_module, "check_cpu_build", lambda *_: None)  # whichever build is here
    monkeypatch.setattr(LLMEngine, "from_vllm_config", capture)
    monkeypatch.setattr(LLMEngine, "from_engine_args", from_args)
    dep = parse_deployment({"name": "d", "model": "bundled:smollm2-135m-instruct", "device": "cpu", **spec})
    assert args_module.build_vllm_engine(dep) == "engine"
    return got.pop("config"), got


def test_quoted_extra_engine_args_reach_vllm_as_the_check_read_them(monkeypatch, bundled_model_dir) -> None:
    """The checks read "false" as false and "2048" as 2048, but vLLM's EngineArgs got the strings:
    "no" turned routed experts on, "false" skipped the tokenizer, "2048" failed the engine's start
    ('<' not supported between str and int) and a quoted kv_cache_memory_bytes was not the size the
    replica's memory check read. Found by a review; fails without the conversion."""
    quoted = {"tokens_only": "false", "enable_return_routed_experts": "no", "max_num_batched_tokens": "2048",
              "kv_cache_memory_bytes": str(GiB // 2)}
    config, _ = built_config(monkeypatch, bundled_model_dir,
                             runtime_config={"max_model_len": 1024, "extra_engine_args": quoted})
    assert config.scheduler_config.max_num_batched_tokens == 2048
    assert config.model_config.skip_tokenizer_init is False
    assert config.aux_output_config.enable_return_routed_experts is False
    assert config.cache_config.kv_cache_memory_bytes == GiB // 2


def test_the_replica_gets_vllm_serves_scheduler_defaults(monkeypatch, bundled_model_dir) -> None:
    """The replica serves vLLM's OpenAI server, so unset scheduler limits are `vllm serve`'s
    (UsageContext.OPENAI_API_SERVER), not the bare engine's: on 3 CPU workers 6144 batched tokens
    and 384 sequences where the engine's context gave 2048 and 128 (on an H100: 8192 and 1024).
    Found by a review; fails without the usage context."""
    from vllm.usage.usage_lib import UsageContext

    config, passed = built_config(monkeypatch, bundled_model_dir, runtime_config={
        "max_model_len": 512, "tensor_parallel_size": 3, "cpu_kvcache_space_gb": 0.5})  # 9 heads, 3 KV heads
    assert (config.scheduler_config.max_num_batched_tokens, config.scheduler_config.max_num_seqs) == (6144, 384)
    assert passed["usage_context"] == UsageContext.OPENAI_API_SERVER
