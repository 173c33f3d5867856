"""A spec's engine settings checked against vLLM's names, one check for both places that run it:
the manager, with the names read from vLLM's source (spec_check.py, no vLLM import), and the
replica, with vLLM imported, before its model is fetched (engine_args.py). Each refusal is one
line naming the field and the value, the same from both."""

from __future__ import annotations

import difflib
from collections.abc import Collection

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
