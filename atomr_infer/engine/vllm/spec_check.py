"""A spec's vLLM settings checked against the vLLM installed, without importing it.

The manager refuses a misspelt ``extra_engine_args`` key or parser name before anything
runs, but its process is long-lived and must not map torch or vLLM (~1 GiB on a GPU node). So
the names are read from vLLM's own source, as Python's ``ast`` parses it: ``EngineArgs``'s
dataclass fields (and the types of those annotated ``int``, ``float``, ``bool``, ``str``), the
registries of tool-call and reasoning parsers (literal dicts in vLLM 0.32), and the
``Literal``s of quantization methods and KV-cache dtypes. Where vLLM is not installed (a head
node that runs no replica), or its source is not laid out as expected, nothing is checked here,
and the replica makes the same checks with vLLM imported before it fetches its model
(engine_args.py), failing with the same message.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from atomr_infer import heavy_imports
from atomr_infer.engine.vllm.arg_checks import check_arg_types, check_choices, check_server_arg_names
from atomr_infer.engine.vllm.engine_args import check_extra_engine_args, check_names
from atomr_infer.errors import SpecError, SpecProblem
from atomr_infer.spec import Deployment


def _vllm_dir() -> Path | None:
    # Finds the package without running it. Not importlib.util.find_spec: that asks every finder
    # on sys.meta_path, heavy_imports' watch among them, which would log an import of vLLM.
    spec = importlib.machinery.PathFinder.find_spec("vllm")
    if spec is None:  # an editable install has a finder of its own on sys.meta_path
        finders = [f for f in sys.meta_path if not heavy_imports.is_watch(f) and hasattr(f, "find_spec")]
        spec = next((found for f in finders if (found := f.find_spec("vllm", None)) is not None), None)
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    return Path(locations[0]) if locations else None


@functools.lru_cache(maxsize=4)
def _class_annotations(module: str, name: str) -> dict[str, ast.expr] | None:
    """A class's fields in ``vllm/<module>`` (annotated class attributes) and their annotations,
    or None if unreadable."""
    root = _vllm_dir()
    source = root / module if root else None
    if source is None or not source.is_file():
        return None
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {
                n.target.id: n.annotation
                for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            }
    return None


def _engine_arg_annotations() -> dict[str, ast.expr] | None:
    return _class_annotations("engine/arg_utils.py", "EngineArgs")


def engine_arg_names() -> frozenset[str] | None:
    """``EngineArgs``'s field names, or None if unreadable."""
    fields = _engine_arg_annotations()
    return frozenset(fields) if fields is not None else None


def engine_arg_scalar_types() -> dict[str, Any]:
    """The types of ``EngineArgs``'s fields annotated with ``int``, ``float``, ``bool``, ``str``
    and ``None`` alone (``int | None``), as Python types; the others (vLLM's config classes,
    aliases of its own) are checked on the replica, where vLLM is imported (check_arg_types)."""
    found = {name: _scalar_type(node) for name, node in (_engine_arg_annotations() or {}).items()}
    return {name: hint for name, hint in found.items() if hint is not None}


_SCALARS: dict[str, Any] = {"int": int, "float": float, "bool": bool, "str": str}


def _scalar_type(node: ast.expr) -> Any:
    if isinstance(node, ast.Name):
        return _SCALARS.get(node.id)
    if isinstance(node, ast.Constant) and node.value is None:
        return type(None)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        left, right = _scalar_type(node.left), _scalar_type(node.right)
        return left | right if left is not None and right is not None else None
    return None


@functools.lru_cache(maxsize=4)
def literal_names(module: str, alias: str) -> frozenset[str] | None:
    """The strings of a module-level ``alias = Literal[...]`` in ``vllm/<module>``
    (``QuantizationMethods``, ``CacheDType``), or None if unreadable."""
    root = _vllm_dir()
    source = root / module if root else None
    if source is None or not source.is_file():
        return None
    for node in ast.parse(source.read_text()).body:
        target, value = (node.targets[0] if len(node.targets) == 1 else None, node.value) \
            if isinstance(node, ast.Assign) else (None, None)
        if isinstance(target, ast.Name) and target.id == alias and isinstance(value, ast.Subscript):
            items = value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice]
            names = [item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)]
            return frozenset(names) if len(names) == len(items) else None
    return None


def quantization_names() -> frozenset[str] | None:
    """vLLM's quantization methods; None (unchecked) where a vLLM plugin other than vLLM's own is
    installed, since a plugin may register methods of its own (register_quantization_config)."""
    plugins = entry_points(group="vllm.general_plugins")
    if any(not plugin.value.startswith("vllm.") for plugin in plugins):
        return None
    return literal_names("model_executor/layers/quantization/__init__.py", "QuantizationMethods")


@functools.lru_cache(maxsize=4)
def registered_names(package: str, registry: str) -> frozenset[str] | None:
    """The keys of a module-level dict literal ``registry`` in ``vllm/<package>/__init__.py``."""
    root = _vllm_dir()
    source = root / package / "__init__.py" if root else None
    if source is None or not source.is_file():
        return None
    for node in ast.parse(source.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        target, value = targets[0] if len(targets) == 1 else None, getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id == registry and isinstance(value, ast.Dict):
            return frozenset(k.value for k in value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return None


def check_spec(deployment: Deployment) -> None:
    """Raise ``SpecError`` naming each vLLM setting of ``deployment`` that vLLM does not have."""
    problems: list[SpecProblem] = []
    names = engine_arg_names()
    o = deployment.serving.openai
    tools = registered_names("tool_parsers", "_TOOL_PARSERS_TO_REGISTER")
    reasoning = registered_names("reasoning", "_REASONING_PARSERS_TO_REGISTER")
    checks = [
        lambda: check_names(deployment, o.tool_call_parser if tools else None,
                            o.reasoning_parser if reasoning else None, tools or frozenset(), reasoning or frozenset()),
        lambda: check_choices(deployment, quantization_names(), literal_names("config/cache.py", "CacheDType")),
    ]
    server = _class_annotations("entrypoints/launchers/cli_args.py", "BaseFrontendArgs")
    if server is not None and o.server_args:
        checks.append(lambda: check_server_arg_names(deployment, frozenset(server)))
    if names is not None and deployment.runtime_config.extra_engine_args:
        checks[:0] = [lambda: check_extra_engine_args(deployment, set(names)),
                      lambda: check_arg_types(deployment, engine_arg_scalar_types())]
    for check in checks:  # every problem at once, as the spec's own validation reports them
        try:
            check()
        except SpecError as exc:
            problems += exc.problems
    if deployment.lora is not None:  # an adapter here (on this node, in the hub cache) that cannot be served
        from atomr_infer.models.adapters import adapter_problems
        from atomr_infer.models.estimate import local_model_dir
        from atomr_infer.models.resolve import revision_of

        lora, cache = deployment.lora, deployment.runtime_config.hf_cache_dir
        base = local_model_dir(deployment.model, cache, revision_of(deployment))
        found = adapter_problems(lora.adapters, lora.max_lora_rank, cache, base)
        problems += [SpecProblem(deployment.name, field, problem) for field, problem in found]
    problems += _context_problems(deployment)
    if problems:
        raise SpecError(problems)


def _context_problems(deployment: Deployment) -> list[SpecProblem]:
    """``max_model_len`` above the model's context, where its config is here: vLLM refuses it
    only at engine start (three full model loads, then the deployment fails) unless told to
    allow it (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``)."""
    from atomr_infer.models.estimate import context_limit, local_model_dir
    from atomr_infer.models.resolve import revision_of

    cfg = deployment.runtime_config
    if not cfg.max_model_len or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").lower() in ("1", "true"):
        return []
    if cfg.extra_engine_args.get("hf_overrides"):  # it may change the length keys: vLLM's to judge
        return []
    directory = local_model_dir(deployment.model, cfg.hf_cache_dir, revision_of(deployment))
    limit = context_limit(directory, cfg.runner == "generate") if directory is not None else None
    if limit is None or cfg.max_model_len <= limit[0]:
        return []
    return [SpecProblem(deployment.name, "runtime_config.max_model_len", f"{cfg.max_model_len} is above the model's "
                        f"context length, {limit[0]} ({limit[1]}): lower it (vLLM would refuse it at engine start)")]
