"""``runtime_config.limit_mm_per_prompt`` as vLLM 0.32 takes it: a count per modality, or a
modality's profiling options (``config/multimodal.py``: unknown keys refused, sizes above 0)."""

from __future__ import annotations

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
                if key != "count" and sizes is not None and key not in sizes:
                    raise FieldValueError(f"{field}.{key}", f"is not an option of {modality} (its options: count, "
                                          f"{', '.join(sizes)})")
                if key == "count" and (type(value) is not int or value < 0):  # (uncapped: as vLLM, and as before)
                    raise FieldValueError(f"{field}.{key}", f"should be a whole number of 0 or more, got {value!r}")
                if key != "count" and (type(value) is not int or value < 1):
                    raise FieldValueError(f"{field}.{key}", f"should be a whole number of 1 or more, got {value!r}")
        elif type(limit) is not int or not 0 <= limit <= 1024:
            raise FieldValueError(field, f"should be a count of 0 to 1024 (or {{count: N, ...}}), got {limit!r}")
    return limits
