"""The emulated core process (engine/vllm/emulated.py) sends each step as one array of outputs
encoded once per request (``encoded_array``): vLLM's decoder must read exactly what vLLM's
encoder gives for the same ``EngineCoreOutputs``, at every msgpack array size."""

from __future__ import annotations

import msgspec
import pytest
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from atomr_infer.engine.vllm.emulated import encoded_array


@pytest.mark.parametrize("n", [0, 1, 15, 16, 65_535, 65_536])
def test_a_step_built_from_encoded_outputs_decodes_as_vllms_own(n):
    outputs = [EngineCoreOutput(f"cmpl-{i}", [42]) for i in range(n)]
    if n:
        outputs[-1] = EngineCoreOutput(f"cmpl-{n - 1}", [42], finish_reason=FinishReason.LENGTH)
    element, encoder, decoder = msgspec.msgpack.Encoder(), MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    ours = EngineCoreOutputs(outputs=encoded_array([element.encode(o) for o in outputs]), timestamp=1.5)
    theirs = EngineCoreOutputs(outputs=outputs, timestamp=1.5)
    assert decoder.decode(encoder.encode(ours)) == decoder.decode(encoder.encode(theirs))
    assert b"".join(encoder.encode(ours)) == b"".join(encoder.encode(theirs))
