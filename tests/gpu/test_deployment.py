"""The bundled model on one GPU, as a user runs it: deploy eager, chat, serve over HTTP, roll to
CUDA graphs, survive a killed replica, remove. In file order, on one deployment."""

from __future__ import annotations

import time

import pytest

from tests.gpu import steps

pytestmark = pytest.mark.gpu(1)
ENGINE_S = 600.0  # one engine start: 27 s eager, 82 s with CUDA graphs on an H100


def test_an_eager_deployment_runs_on_the_gpu_and_answers(stack):
    print(steps.deploy_eager(stack, time.monotonic() + ENGINE_S))
    print(steps.chat(stack, time.monotonic() + 120))


def test_atomr_serve_answers_plain_and_streamed_chat_completions(stack):
    print(steps.serve_http(stack, time.monotonic() + 300))


def test_cuda_graphs_roll_the_replica_and_it_still_answers(stack):
    print(steps.roll_to_graphs(stack, time.monotonic() + ENGINE_S))


def test_a_killed_replica_is_replaced_and_answers(stack):
    print(steps.replace_killed(stack, time.monotonic() + ENGINE_S))


def test_remove_drains_and_removes_the_deployment(stack):
    print(steps.remove(stack, time.monotonic() + 180))
