"""A spec's engine settings checked against vLLM's names, one check for both places that run it:
the manager, with the names read from vLLM's source (spec_check.py, no vLLM import), and the
replica, with vLLM imported, before its model is fetched (engine_args.py). Each refusal is one
line naming the field and the value, the same from both."""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Collection, Mapping
from typing import Any

from atomr_infer.errors import SpecError, SpecProblem
from atomr_infer.spec import Deployment


def did_you_mean(value: str, known: Collection[str]) -> str:
    """`` (did you mean 'a' or 'b'?)``, or every name vLLM has where none is close."""
    close = difflib.get_close_matches(value, sorted(known), n=3)
    if not close:
        return f" (vLLM has: {', '.join(sorted(known))})"
    names = ", ".join(map(repr, close[:-1])) + (" or " if len(close) > 1 else "") + repr(close[-1])
    return f" (did you mean {names}?)"


def check_choices(
    deployment: Deployment, quantizations: Collection[str] | None, cache_dtypes: Collection[str] | None
) -> None:
    """Refuse a quantization method or KV-cache dtype vLLM does not have (vLLM refuses them only
    once the model is fetched and its config read). None: that list is unknown, left unchecked."""
    cfg = deployment.runtime_config
    checks = [
        ("runtime_config.quantization", cfg.quantization, quantizations, "quantization method"),
        ("runtime_config.extra_engine_args.kv_cache_dtype", cfg.extra_engine_args.get("kv_cache_dtype"),
         cache_dtypes, "KV-cache dtype"),
    ]
    problems = [
        SpecProblem(deployment.name, field, f"{value!r} is not a vLLM {what}{did_you_mean(str(value), known)}")
        for field, value, known, what in checks
        if value is not None and known is not None and value not in known
    ]
    if problems:
        raise SpecError(problems)


def dataclass_hints(cls: type) -> dict[str, Any]:
    """``cls``'s field types, each resolved on its own: ``typing.get_type_hints`` fails whole on
    one name its module imports only for type checkers (EngineArgs' ``QuantizationConfigArgs``)."""
    hints = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        holder = type("_Field", (), {"__annotations__": {field.name: field.type}, "__module__": cls.__module__})
        try:
            hints[field.name] = typing.get_type_hints(holder)[field.name]
        except Exception:  # noqa: BLE001 - NameError, TypeError, ...: left to vLLM
            continue
    return hints


def check_arg_types(deployment: Deployment, hints: Mapping[str, Any]) -> dict[str, Any]:
    """Refuse an ``extra_engine_args`` value that does not fit its ``EngineArgs`` field's type
    (``hints``), validated as vLLM's pydantic configs do, not strictly ("8" is 8). Else vLLM
    refused it once the replica had fetched the model, in a message that named no field. A type
    pydantic cannot validate (``torch.dtype``) is left to vLLM.

    Returns the values as validated ("false" is False, "8" is 8): what to pass to ``EngineArgs``,
    which converts nothing (``EngineArgs(tokens_only="false")`` is on, ``"2048"`` fails inside it)."""
    from pydantic import TypeAdapter, ValidationError

    problems, values = [], dict(deployment.runtime_config.extra_engine_args)
    for key, value in deployment.runtime_config.extra_engine_args.items():
        if key not in hints:
            continue
        try:
            adapter: TypeAdapter[Any] = TypeAdapter(hints[key])
        except Exception:  # noqa: BLE001 - PydanticSchemaGenerationError, ...
            continue
        try:
            values[key] = adapter.validate_python(value, strict=False)
        except ValidationError as exc:
            error = exc.errors()[0]
            where = ".".join(map(str, error["loc"]))
            reason = " ".join(error["msg"].removeprefix("Value error, ").split())
            reason = (f"{where}: " if where else "") + reason[0].lower() + reason[1:]
            problems.append(SpecProblem(
                deployment.name, f"runtime_config.extra_engine_args.{key}",
                f"{_cut(repr(value), 80)} does not fit vLLM's type, {_type_text(hints[key])}: {_cut(reason, 240)}",
            ))
    if problems:
        raise SpecError(problems)
    return values


def _type_text(hint: Any) -> str:
    text = hint.__name__ if isinstance(hint, type) else str(hint)
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", text)  # typing.Any -> Any


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_keys(deployment: Deployment, keys: Collection[str], known: Collection[str], field: str, what: str) -> None:
    """Refuse each of ``keys`` (of the mapping at ``field``) not among ``known``: "not ``what``",
    with the closest name vLLM has."""
    problems = []
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(SpecProblem(deployment.name, f"{field}.{key}", f"not {what}{hint}"))
    if problems:
        raise SpecError(problems)


def check_server_arg_names(deployment: Deployment, known: frozenset[str]) -> None:
    """Refuse ``serving.openai.server_args`` keys that vLLM's model server does not take
    (``BaseFrontendArgs``' fields): its parser would take a prefix of one as that one."""
    check_keys(deployment, deployment.serving.openai.server_args, known, "serving.openai.server_args",
               "an option of vLLM's OpenAI server")
