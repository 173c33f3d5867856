"""``serving.openai.server_args``: more of ``vllm serve``'s options for the model's server,
reaching vLLM's own server in a replica (the emulated engine under vLLM's real serving layer)."""

from __future__ import annotations

import pytest
import ray

from atomr_infer.spec import parse_deployment
from tests.replica_http import run

pytestmark = pytest.mark.integration


def test_server_args_reach_vllms_server_in_the_replica(ray_cluster, bundled_model_dir):
    from atomr_infer.engine.vllm.emulated import emulated_backend
    from atomr_infer.replica import replica_actor_class

    spec = parse_deployment({
        "name": "args", "model": str(bundled_model_dir), "device": "cpu",
        "serving": {"openai": {"server_args": {"response_role": "narrator", "enable_prompt_tokens_details": True}}},
    })
    actor = replica_actor_class().options(num_cpus=0).remote(
        spec.model_dump(mode="json"), "r0", backend=emulated_backend(str(bundled_model_dir), 0.01)
    )
    try:
        ray.get(actor.ready.remote(300))
        answer = run(actor, {"model": "args", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                     "/v1/chat/completions")
        assert answer.status == 200, answer.body[:300]
        roles = [c["delta"].get("role") for e in answer.events for c in e.get("choices", ()) if c["delta"].get("role")]
        assert roles == ["narrator"], roles  # vLLM's default is "assistant"
        assert "prompt_tokens_details" in answer.usage, answer.usage  # off by default in vLLM
    finally:
        ray.kill(actor)
