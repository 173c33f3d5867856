"""vLLM's engine settings as the spec can read them before anything runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

_INT: TypeAdapter[int] = TypeAdapter(int)


def engine_arg_int(extra: Mapping[str, Any], key: str) -> int | None:
    """An ``extra_engine_args`` value of one of vLLM's ``int`` fields as vLLM's types read it
    (``"2048"`` is 2048, as the replica passes it); None if unset or not a whole number."""
    value = extra.get(key)
    if value is None or isinstance(value, bool):
        return None
    try:
        return _INT.validate_python(value, strict=False)
    except ValidationError:  # refused by the type check (engine/vllm/arg_checks.py)
        return None
