"""Conformance of classification and scoring with ``vllm serve`` on deployments/smollm2-classify.yaml
(the bundled model as vLLM's LLM-as-reranker classifier): the same statuses and bodies. A module
of its own: its two engines live only while it runs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.pooling import answer, pooling_servers, spec_file

pytestmark = pytest.mark.e2e
NAME = "smollm2-classify"


@pytest.fixture(scope="module")
def servers(bundled_model_dir, manager, ray_cluster, openai_server) -> Iterator[tuple[str, str]]:
    for theirs in pooling_servers(spec_file("smollm2-classify.yaml"), bundled_model_dir, manager, ray_cluster):
        yield openai_server.url, theirs


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
    assert ours == theirs
