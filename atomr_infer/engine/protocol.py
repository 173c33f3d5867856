"""The engine contract: the four methods of vLLM's ``LLMEngine``, plus its tokenizer.

Any object with these methods plugs into a replica (FuriosaAI's ``furiosa_llm.LLMEngine``
copies the same surface). The replica drives it from exactly one thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Engine(Protocol):
    def add_request(self, request_id: str, prompt: Any, params: Any) -> Any:
        """Queue a request. ``prompt`` is ``{"prompt_token_ids": [...]}``; ``params`` a SamplingParams."""

    def step(self) -> list[Any]:
        """Run one engine iteration; return ``RequestOutput``s (DELTA kind) of requests that progressed."""

    def abort_request(self, request_ids: Sequence[str]) -> None:
        """Forget these requests; no further output is produced for them."""

    def has_unfinished_requests(self) -> bool:
        """Whether ``step()`` has work to do."""

    def get_tokenizer(self) -> Any:
        """The HF-compatible tokenizer the engine uses (``encode``, ``apply_chat_template``)."""
