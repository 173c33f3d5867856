"""``atomr logs`` asks again when the dashboard says a live node's agent does not exist (its table
of agents catching up), and fails at once on any other error (cli/status.py ``_tail``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray
import ray.util.state

from atomr_infer.cli import status


def answers(monkeypatch, *results):
    """get_log answering each call with the next of ``results`` (an exception is raised)."""
    calls = []

    def get_log(**kwargs):
        calls.append(kwargs)
        result = results[len(calls) - 1]
        if isinstance(result, Exception):
            raise result
        return iter(result)

    monkeypatch.setattr(ray.util.state, "get_log", get_log)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="127.0.0.1:1"))
    monkeypatch.setattr(status, "AGENT_PAUSE_S", 0.0)
    return calls


def test_a_missing_agent_is_asked_again_until_it_answers(monkeypatch):
    missing = ValueError("Agent for node id: 2b73 doesn't exist.")
    calls = answers(monkeypatch, missing, missing, ["a\n", "b\n"])
    assert status._tail("actor", 10) == "a\nb\n"
    assert len(calls) == 3 and calls[0]["actor_id"] == "actor" and calls[0]["tail"] == 10


def test_it_gives_up_after_its_tries_and_other_errors_fail_at_once(monkeypatch):
    missing = ValueError("Agent for node id: 2b73 doesn't exist.")
    calls = answers(monkeypatch, missing, missing, missing, ["never"])
    with pytest.raises(ValueError, match="Agent for node id"):
        status._tail("actor", 10)
    assert len(calls) == status.AGENT_TRIES
    calls = answers(monkeypatch, ConnectionError("dashboard down"), ["never"])
    with pytest.raises(ConnectionError):
        status._tail("actor", 10)
    assert len(calls) == 1
