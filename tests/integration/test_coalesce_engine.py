"""Merged core steps through vLLM's real front half (engine/vllm/coalesce.py over the emulated
engine: vLLM's input and output processors, detokenizer and stop strings over a core that steps
on its own, as a GPU core process does). A request whose core ran far ahead of the front half
comes out in a few outputs instead of one per token, with the same text and finish reason."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from atomr_infer.engine.vllm.coalesce import CoalescingCoreClient, coalesce_core_outputs
from atomr_infer.engine.vllm.emulated import emulated_engine
from tests.waiting import wait_until

STEP_S = 0.002


@pytest.fixture(scope="module")
def engines(bundled_model_dir):
    plain, merging = emulated_engine(str(bundled_model_dir), STEP_S), emulated_engine(str(bundled_model_dir), STEP_S)
    assert coalesce_core_outputs(merging)
    yield plain, merging
    for engine in (plain, merging):
        engine.engine_core.shutdown()


def run_ahead(engine, request_id: str, **params) -> list:
    """Add one request, let the core run ahead of the front half, then step it to its end."""
    engine.add_request(request_id, "count", SamplingParams(output_kind=RequestOutputKind.DELTA, **params))
    # Until the core ran its last step (its output queued at most a step later); a liveness bound.
    wait_until(lambda: not engine.engine_core._running, 60, 0.01, what="the emulated core's last step")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def text(outputs) -> str:
    return "".join(o.outputs[0].text for o in outputs)


@pytest.mark.parametrize("params", [
    {"max_tokens": 40, "ignore_eos": True},
    {"max_tokens": 40, "stop": ["go go go go"]},  # found inside one merged delta
])
def test_merged_steps_give_the_same_text_and_finish(engines, params):
    plain, merging = engines
    unmerged = run_ahead(plain, f"plain-{len(params)}", **params)
    merged = run_ahead(merging, f"merged-{len(params)}", **params)
    assert isinstance(merging.engine_core, CoalescingCoreClient)
    assert len(unmerged) >= 4 and len(merged) <= 2, (len(unmerged), len(merged))
    assert text(merged) == text(unmerged)
    assert merged[-1].finished and unmerged[-1].finished
    assert merged[-1].outputs[0].finish_reason == unmerged[-1].outputs[0].finish_reason
    assert sum(len(o.outputs[0].token_ids) for o in merged) == sum(len(o.outputs[0].token_ids) for o in unmerged)
