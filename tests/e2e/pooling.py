"""What the pooling conformance modules share: a deployment file on atomr beside `vllm serve`
with the same flags, and the comparison of conformance (tests/e2e/test_conformance.py)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.test_conformance import CHAT, _answer
from tests.vllm_serve import vllm_server

answer = _answer
__all__ = ["CHAT", "alike", "answer", "servers_of", "spec_file"]


def alike(ours: Any, theirs: Any) -> bool:
    """The same answer, its numbers equal to float rounding: two engines that sum in another
    order (their threads) differ in the last bits, which vLLM does not promise alike."""
    if isinstance(ours, float) or isinstance(theirs, float):
        return isinstance(ours, int | float) and isinstance(theirs, int | float) and \
            math.isclose(ours, theirs, rel_tol=1e-3, abs_tol=1e-4)
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return ours.keys() == theirs.keys() and all(alike(ours[k], theirs[k]) for k in ours)
    if isinstance(ours, list | tuple) and isinstance(theirs, list | tuple):
        return len(ours) == len(theirs) and all(alike(a, b) for a, b in zip(ours, theirs, strict=True))
    return ours == theirs


def spec_file(name: str):  # noqa: ANN201 - a Deployment
    from atomr_infer.spec import load_deployments
    from tests.conftest import REPO

    return load_deployments(os.path.join(REPO, "deployments", name))[0]


def servers_of(file: str) -> Any:
    """A module fixture: deployments/``file`` applied on atomr and `vllm serve` with the same
    flags, as (atomr's URL, vllm serve's URL) while the module runs; then both stopped."""

    @pytest.fixture(scope="module")
    def servers(bundled_model_dir, manager, ray_cluster, openai_server) -> Iterator[tuple[str, str]]:  # noqa: ANN001
        spec = spec_file(file)
        ray_cluster.get(manager.apply.remote(spec))
        try:
            status = ray_cluster.get(manager.wait_ready.remote(spec.name, 600))
            assert status is not None and status.replicas_ready == 1, status
            with vllm_server(spec, bundled_model_dir) as theirs:
                yield openai_server.url, theirs
        finally:
            ray_cluster.get(manager.remove.remote(spec.name))

    return servers
