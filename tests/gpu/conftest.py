"""The GPU tier: the bundled model on ``device: cuda`` through atomr's CLI and manager, on a
private head (tests/atomr_head.py) that this package starts with ``atomr up`` and stops with
``atomr down``. ``make test-gpu`` runs it, then ``scripts/gpu_smoke.sh --device cuda``.

A test marked ``gpu(n)`` needs ``n`` CUDA GPUs (vLLM's ``multi_gpu_test(num_gpus=n)`` habit: a
skip that says how many are missing); where CUDA is absent every test here is skipped with the
reason, so ``make test`` collects them on a CPU host and stays green. Only the skip helper
imports torch in this process; the engines run in the replicas' processes. The head never joins
this process to Ray, so the tier runs beside the in-process Ray of the other tiers.
"""

from __future__ import annotations

import functools
import shutil
import time
from collections.abc import Iterator

import pytest

from tests.atomr_head import AtomrHead
from tests.gpu.steps import Stack, start, stop

START_S = 180.0


@functools.cache
def cuda_gpus() -> tuple[int, str]:
    """CUDA GPUs torch sees in this process, and why there are none when there are none."""
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed"
    except Exception as exc:  # noqa: BLE001 - an undefined symbol, a missing library: say which
        return 0, f"torch is installed but fails to import: {type(exc).__name__}: {exc}"
    if not torch.cuda.is_available():
        build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return 0, f"torch {torch.__version__} ({build}) sees no CUDA GPU"
    return torch.cuda.device_count(), ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        wanted = marker.args[0] if marker.args else 1
        found, why = cuda_gpus()
        if found == 0:
            item.add_marker(pytest.mark.skip(reason=f"needs a CUDA GPU: {why}"))
        elif found < wanted:
            item.add_marker(pytest.mark.skip(reason=f"needs {wanted} CUDA GPUs, this host has {found}"))


@pytest.fixture(scope="package")
def stack(bundled_model_dir) -> Iterator[Stack]:
    """The private head, up (the bundled model converted first, so no step times it); at the
    end ``atomr down``, which must leave no process of the head behind."""
    head = AtomrHead()
    stack = Stack(head, "cuda")
    try:
        start(stack, time.monotonic() + START_S)
        yield stack
        stop(stack, time.monotonic() + START_S)
    finally:
        head.down()
        shutil.rmtree(head.workdir, ignore_errors=True)
