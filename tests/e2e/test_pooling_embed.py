"""Conformance of the pooling endpoints with ``vllm serve`` on an embedding deployment
(deployments/smollm2-embed.yaml): the same statuses and bodies, apart from ids and timestamps.
A module of its own: its two engines live only while it runs (the machine has room for few)."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.pooling import CHAT, alike, answer, servers_of

pytestmark = pytest.mark.e2e
NAME = "smollm2-embed"
servers = servers_of("smollm2-embed.yaml")


def test_embeddings_are_the_same_vectors(servers):
    ours_url, theirs_url = servers
    for body in ({"model": NAME, "input": "Paris is the capital of France."},
                 {"model": NAME, "input": ["one", "two words", "three more words"]}):
        ours, theirs = answer(ours_url, "/v1/embeddings", body), answer(theirs_url, "/v1/embeddings", body)
        assert ours[0] == 200 and len(ours[1]["data"][0]["embedding"]) > 100, ours
        assert alike(ours, theirs), (ours, theirs)


CASES = {
    "score": ("/score", {"text_1": "What is the capital of France?",
                         "text_2": ["Paris is the capital of France.", "Bananas are yellow."]}),
    "v1_score": ("/v1/score", {"text_1": "capital of France", "text_2": "Paris"}),
    "rerank": ("/rerank", {"query": "capital of France", "documents": ["Bananas are yellow.", "Paris is in France."]}),
    "v1_rerank": ("/v1/rerank", {"query": "capital of France", "documents": ["Paris", "Rome"], "top_n": 1}),
    "v2_rerank": ("/v2/rerank", {"query": "capital of France", "documents": ["Paris", "Rome"]}),
    "pooling": ("/pooling", {"input": "Paris is the capital of France."}),
    "v2_embed": ("/v2/embed", {"texts": ["Paris"], "embedding_types": ["float"]}),
    "classify": ("/classify", {"input": "Paris"}),  # not an embedding model's: vLLM's 404, both sides
    "chat": ("/v1/chat/completions", {"messages": CHAT}),  # an embedding model has no chat route
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pooling_endpoints_match(servers, case):
    ours_url, theirs_url = servers
    path, body = CASES[case]
    body = {"model": NAME, **body}
    ours, theirs = answer(ours_url, path, body), answer(theirs_url, path, body)
    assert ours[0] == (404 if case in ("classify", "chat") else 200), ours
    assert alike(ours, theirs), (ours, theirs)


def test_a_models_card_says_which_endpoints_it_serves(servers, smollm2):
    ours_url, _ = servers
    embed = httpx.get(f"{ours_url}/v1/models/{NAME}", timeout=30).json()
    assert {"/v1/embeddings", "/pooling", "/v1/score", "/v1/rerank"} <= set(embed["endpoints"]), embed
    assert "/v1/chat/completions" not in embed["endpoints"]
    chat_card = httpx.get(f"{ours_url}/v1/models/{smollm2}", timeout=30).json()
    assert {"/v1/chat/completions", "/v1/responses", "/v1/messages"} <= set(chat_card["endpoints"]), chat_card
    assert "/v1/embeddings" not in chat_card["endpoints"]
