"""Conformance of classification and scoring with ``vllm serve`` on deployments/smollm2-classify.yaml
(the bundled model as vLLM's LLM-as-reranker classifier): the same statuses and bodies. A module
of its own: its two engines live only while it runs."""

from __future__ import annotations

import pytest

from tests.e2e.pooling import alike, answer, servers_of

pytestmark = pytest.mark.e2e
NAME = "smollm2-classify"
servers = servers_of("smollm2-classify.yaml")


CASES = {
    "classify": ("/classify", {"input": ["Paris is lovely.", "I hate rain."]}),
    "pooling": ("/pooling", {"input": "Paris is lovely."}),
    "score": ("/score", {"text_1": "What is the capital of France?",
                         "text_2": ["Paris is the capital of France.", "Bananas are yellow."]}),
    "rerank": ("/v1/rerank", {"query": "capital of France", "documents": ["Bananas are yellow.", "Paris."]}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_classification_endpoints_match(servers, case):
    ours_url, theirs_url = servers
    path, body = CASES[case]
    body = {"model": NAME, **body}
    ours, theirs = answer(ours_url, path, body), answer(theirs_url, path, body)
    assert ours[0] == 200, ours
    assert alike(ours, theirs), (ours, theirs)
