"""What a router needs to move a stream, and a stream moved here after its replica died
(routing/migration.py).

``TOKENS`` (set per request by the backend, for requests that ask) is told the token ids of
each output once vLLM's serving layer has put that output's bytes, when it asks for the next:
never ahead of the text the router has, so a stream resumed after them repeats and skips
nothing.

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
