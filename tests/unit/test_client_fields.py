"""``Client`` checks field names in the caller and maps vLLM's errors to atomr's (no Ray)."""

from __future__ import annotations

import json

import pytest

from atomr_infer.client import CHAT, COMPLETION, EMBEDDING, _error, _request
from atomr_infer.errors import EngineError, InvalidRequest, RequestError


def _body(endpoint, name, fields):
    facts, request = _request(endpoint, name, fields)
    assert facts.deployment == name and request.path == endpoint.path
    return request.body


def test_fields_of_vllms_requests_are_accepted():
    body = json.loads(_body(CHAT, "smollm2", {"messages": [], "tools": [], "response_format": {"type": "json_object"},
                                              "top_k": 5, "ignore_eos": True}))
    assert body["model"] == "smollm2" and body["top_k"] == 5
    assert json.loads(_body(COMPLETION, "m", {"prompt": ["a", "b"], "echo": True}))["echo"] is True
    assert json.loads(_body(EMBEDDING, "m", {"input": "x"}))["input"] == "x"


def test_a_misspelt_field_fails_in_the_caller_with_a_suggestion():
    with pytest.raises(TypeError, match="unknown request field 'temprature' \\(did you mean 'temperature'\\?\\)"):
        _body(CHAT, "smollm2", {"messages": [], "temprature": 0})


def test_vllms_errors_become_typed_errors():
    bad = _error(400, b'{"error": {"message": "temperature must be >= 0", "param": "temperature", "code": 400}}')
    assert isinstance(bad, InvalidRequest) and bad.field == "temperature" and "must be" in bad.message
    assert isinstance(_error(404, b'{"error": {"message": "nope"}}'), RequestError)
    assert isinstance(_error(500, b"not json"), EngineError)
