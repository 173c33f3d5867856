"""``serving.openai.server_args``: more of ``vllm serve``'s options for the model's server,
reaching vLLM's own server in a replica (the emulated engine under vLLM's real serving layer);
and the chat template and template defaults that server renders with reaching the routers that
tokenize prompts for ``routing.policy: kv_events``."""

from __future__ import annotations

import json

import pytest
import ray

from atomr_infer.spec import parse_deployment
from tests.replica_http import http_request, read, run

# The model's own template, but each role marked by a default template argument (``shout``).
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}{% if shout %}!{% endif %}\n{{ m['content'] }}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

pytestmark = pytest.mark.integration


def test_server_args_reach_vllms_server_in_the_replica_and_routers_render_as_it_does(
    ray_cluster, bundled_model_dir, tmp_path
):
    from atomr_infer.engine.vllm.emulated import emulated_backend
    from atomr_infer.replica import replica_actor_class
    from atomr_infer.routing.prompt_tokens import PromptTokenizer
    from atomr_infer.wire import RoutingFacts

    (tmp_path / "chat.jinja").write_text(TEMPLATE)
    spec = parse_deployment({
        "name": "args", "model": str(bundled_model_dir), "device": "cpu",
        "serving": {"openai": {"chat_template": str(tmp_path / "chat.jinja"), "server_args": {
            "response_role": "narrator", "enable_prompt_tokens_details": True,
            "default_chat_template_kwargs": {"shout": True}}}},
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
        # The router's token ids of a chat (kv_events) are those vLLM's server renders in the replica.
        body = {"model": "args", "messages": [{"role": "user", "content": "hello there"}]}
        served = read([ray.get(ref) for ref in actor.http.remote(http_request("/tokenize", dict(body)))])
        theirs = json.loads(served.body)["tokens"]
        facts = RoutingFacts.of("/v1/chat/completions", body)
        ours = PromptTokenizer(ray.get(actor.tokenizer_files.remote())).tokens(facts.prompt, facts.template)
        assert ours == theirs
        assert "user!" in PromptTokenizer({"tokenizer.json": (bundled_model_dir / "tokenizer.json").read_text()})\
            ._tokenizer.decode(theirs)  # the template and its default argument were the server's
    finally:
        ray.kill(actor)
