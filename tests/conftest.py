"""Fixtures shared by every test tier."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def bundled_model_dir() -> Path:
    """The bundled SmolLM2 as an HF directory in the default cache (``$ATOMR_CACHE_DIR`` or
    ``~/.cache/atomr-infer``): converted once per machine (~20-30 s), reused by later sessions."""
    from atomr_infer.models import prepare_bundled

    return prepare_bundled("smollm2-135m-instruct")
