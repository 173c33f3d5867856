"""``runtime_config.limit_mm_per_prompt`` as vLLM 0.32 takes it: a count per modality, or a
modality's profiling options (``config/multimodal.py``: for a multimodal model, unknown keys are
refused and sizes must be above 0; a warning says so here)."""

from __future__ import annotations

import warnings
from typing import Any

from atomr_infer.spec.base import FieldValueError

# Each modality's profiling options besides ``count`` (another modality's are ignored by vLLM).
_MM_SIZES = {"image": ("width", "height"), "video": ("num_frames", "width", "height"), "audio": ("length",)}


def check_mm_limits(limits: dict[str, Any] | None) -> dict[str, Any] | None:
    for modality, limit in (limits or {}).items():
        field = modality  # (under the field's own path)
        if isinstance(limit, dict):  # vLLM's per-modality options: count and the sizes it profiles
            sizes = _MM_SIZES.get(modality)  # None: another modality (vLLM reads only its count)
            for key, value in limit.items():
                if type(value) is not int or value < 0:
                    raise FieldValueError(f"{field}.{key}", f"should be a whole number of 0 or more, got {value!r}")
                # What vLLM refuses for a multimodal model (and ignores for a text one): said, not
                # refused, as a restarted manager stops the replicas of a stored spec it refuses.
                if key != "count" and sizes is not None and key not in sizes:
                    _warn(f"{field}.{key} is not an option of {modality} (its options: count, {', '.join(sizes)}): "
                          "vLLM refuses it for a multimodal model")
                elif key != "count" and sizes is not None and value < 1:
                    _warn(f"{field}.{key} is 0: vLLM wants a size of 1 or more for a multimodal model")
        elif type(limit) is not int or not 0 <= limit <= 1024:
            raise FieldValueError(field, f"should be a count of 0 to 1024 (or {{count: N, ...}}), got {limit!r}")
    return limits


def _warn(message: str) -> None:
    warnings.warn(f"runtime_config.limit_mm_per_prompt.{message}", FutureWarning, stacklevel=4)
