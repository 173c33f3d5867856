"""``atomr chat``'s checks before it asks anything, over the real manager (tests/unit/test_manager.py's
harness) and a Client that answers with the name it was given."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from atomr_infer.cli import common
from atomr_infer.cli.main import app
from tests.unit.test_manager import Harness, spec


@pytest.fixture
def chat(monkeypatch: pytest.MonkeyPatch):
    import atomr_infer.client

    harness = Harness()
    tuned = spec(name="tuned", serving={"openai": {"served_model_name": ["my-model"]}},
                 lora={"adapters": {"pirate": "/srv/pirate"}})
    harness.call("apply", tuned)
    harness.converge()

    class Control:  # ControlPlane's calls, answered by the manager
        handle = None

        def status(self, name):
            return harness.call("status", name)

        def list(self):
            return harness.call("list")

        def routing_table(self):
            return harness.call("routing_table")

    class Client:
        def __init__(self, manager=None) -> None:
            pass

        async def astream_chat_events(self, name, messages, **fields):
            yield {"choices": [{"delta": {"content": f"answered by {name}"}, "finish_reason": "stop"}]}

        async def aclose(self) -> None:
            pass

    monkeypatch.setattr(common, "control_plane", lambda *args, **kwargs: Control())
    monkeypatch.setattr(atomr_infer.client, "Client", Client)
    return lambda *args: CliRunner().invoke(app, ["chat", *args])


@pytest.mark.parametrize("name", ["tuned", "my-model", "tuned:pirate", "pirate"])
def test_chat_takes_every_name_the_http_api_routes(chat, name) -> None:
    """Aliases and adapters were refused: "no deployment named 'tuned:pirate'", exit 1."""
    result = chat(name, "hi")
    assert result.exit_code == 0 and f"answered by {name}" in result.output, result.output


def test_chat_refuses_an_unknown_name_and_an_empty_prompt_in_one_line(chat) -> None:
    unknown = chat("nobody", "hi")
    assert unknown.exit_code == 1 and "no deployment named 'nobody'" in unknown.output, unknown.output
    empty = chat("tuned", "  ")
    assert empty.exit_code == 2 and "the prompt is empty" in empty.output, empty.output


def test_chat_with_a_model_that_does_not_chat_says_so_at_once(chat, monkeypatch) -> None:
    """An embedding model: it printed vLLM's 404 body, 'HTTP 404: {"detail":"Not Found"}'."""
    import dataclasses

    from atomr_infer.cli import common as cli_common

    control = cli_common.control_plane()
    pooling = ("POST /v1/embeddings", "POST /pooling", "POST /tokenize")

    class Embedder(type(control)):
        def status(self, name):
            status = super().status(name)
            return dataclasses.replace(status, replicas=tuple(
                dataclasses.replace(r, routes=pooling) for r in status.replicas))

    monkeypatch.setattr(cli_common, "control_plane", lambda *args, **kwargs: Embedder())
    result = chat("tuned", "hi")
    assert result.exit_code == 1 and "deployment 'tuned' does not chat" in result.output, result.output
    assert "/v1/embeddings" in result.output
