"""What a router needs to move a stream, and a stream moved here after its replica died
(routing/migration.py).

``TOKENS`` (set per request by the backend, for requests that ask) is told the token ids of
each output once vLLM's serving layer has put that output's bytes, when it asks for the next:
never ahead of the text the router has, so a stream resumed after them repeats and skips
nothing. Ids that end inside a character (an emoji's bytes, several tokens of a byte-level
vocabulary) have no text yet: they are told with the ids that complete it (``CharBoundary``),
since a prompt that ends inside a character makes vLLM's incremental detokenizer of the
continuation start over from the prompt's beginning (the client would get its prompt again).

The router re-sends the original request with the token ids already generated (``resume``).
vLLM's serving layer renders and tokenizes the request as it did the first time; the engine
request is then extended at the token level: the prompt gains the generated ids (so the
continuation is conditioned exactly on what the client has, and the incremental detokenizer
joins the text at the seam), the token budget loses them. On the way out, each output's prompt
is the original one again and the first step's tokens count the resumed ones before them, so
the serving layer's usage is the whole answer's (prompt tokens as asked, completion tokens of
both parts) while its text is the continuation's alone.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

# Per request, set by the backend's ``serve`` and read by the engine client: vLLM's handler runs in
# the serving task or in a task it starts, which copies this context.
# The token ids the request being served resumes after.
RESUME: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("atomr_resume", default=None)
# Told the token ids of the request being served, as its bytes go out (set per request).
TOKENS: contextvars.ContextVar[Callable[[list[int]], None] | None] = contextvars.ContextVar(
    "atomr_tokens", default=None
)


def extend_request(request: Any, resume: list[int]) -> None:
    """Continue ``request`` (an ``EngineCoreRequest``) after ``resume``."""
    request.prompt_token_ids = [*(request.prompt_token_ids or ()), *resume]
    params = request.sampling_params
    if params is not None:
        if params.max_tokens is not None:  # at least one: a request that died at its last token ends
            params.max_tokens = max(1, params.max_tokens - len(resume))
        if params.min_tokens:
            params.min_tokens = max(0, params.min_tokens - len(resume))


def as_whole(output: Any, resume: list[int], first: bool) -> Any:
    """``output`` as a step of the whole answer: the original prompt; on the first step, the
    resumed tokens counted before the new ones."""
    if resume and output.prompt_token_ids is not None:
        output.prompt_token_ids = output.prompt_token_ids[: len(output.prompt_token_ids) - len(resume)]
    completions = getattr(output, "outputs", None)
    if first and resume and completions:
        completions[0].token_ids = [*resume, *completions[0].token_ids]
    return output


class CharBoundary:
    """Where the text of a run of token ids ends with a whole character, for one tokenizer."""

    MAX_HELD = 4  # a character is at most 4 bytes of UTF-8, each id one byte or more
    _WINDOW = 8  # ids decoded to look at the end of the text (enough context for any character)

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._partial: dict[int, bool] = {}  # id -> decoded alone, it holds part of a character

    def _maybe_partial(self, token_id: int) -> bool:
        partial = self._partial.get(token_id)
        if partial is None:  # once per id seen: most outputs cost a dict lookup, not a decode
            partial = self._partial[token_id] = "\ufffd" in self._tokenizer.decode([token_id])
        return partial

    def held(self, ids: list[int]) -> int:
        """How many of ``ids``' last ids end inside a character (0 to ``MAX_HELD``)."""
        held = 0
        while held < min(len(ids), self.MAX_HELD) and self._maybe_partial(ids[-1 - held]):
            end = len(ids) - held
            if not self._tokenizer.decode(ids[max(0, end - self._WINDOW) : end]).endswith("\ufffd"):
                break
            held += 1
        return held

    def split(self, unsaid: list[int], new: list[int]) -> tuple[list[int], list[int]]:
        """The ids to tell after ``unsaid`` (held before) and ``new``, and those to hold still."""
        ids = [*unsaid, *new]
        held = self.held(ids)
        return (ids[:-held], ids[-held:]) if held else (ids, [])
