"""Integration fixtures (``ray_cluster``, ``manager``, ``smollm2``, ``smollm2_replica``) live in
``tests/conftest.py``, shared with the e2e tier so one session starts one Ray and one engine."""

from __future__ import annotations

from tests.conftest import LOGICAL_GPUS, REPO, smollm2_spec

__all__ = ["LOGICAL_GPUS", "REPO", "smollm2_spec"]
