"""Where replicas' GPUs are: one GPU each for two replicas, and one replica over three GPUs
(tensor parallel: SmolLM2-135M's 9 attention heads split over 3, not over 2), on one node."""

from __future__ import annotations

import time

import pytest

from tests.gpu import steps

ENGINE_S = 600.0


@pytest.mark.gpu(2)
def test_two_replicas_get_a_gpu_each(stack):
    print(steps.two_replicas(stack, time.monotonic() + ENGINE_S))


@pytest.mark.gpu(steps.TP_SIZE)
def test_a_tensor_parallel_replica_holds_its_gpus_on_one_node(stack):
    print(steps.tensor_parallel(stack, time.monotonic() + ENGINE_S))
