"""Streams that survive their replica: a chat or completion stream whose replica dies goes on
on another replica of the deployment, after the token ids it had generated.

The router asks the replica for the token ids of resumable streams (``OpenRequest.want_token_ids``:
the replica reports each output's ids once its bytes are out, engine/vllm/resume.py) and, when
the replica dies, unreachable, or its channel breaks, opens the same request on another replica
with ``resume`` = those ids. That replica continues at the token level (the prompt gains them,
the budget loses them) and answers in the same stream format with the whole answer's usage; the
router drops what the client already has at the seam: the head, and a chat stream's opening
role-only chunk. The chunks' ids stay the same (vLLM builds them from the body's ``request_id``
or, where it has none, the ``X-Request-Id`` the router gives the request).

Which streams can move (``RoutingFacts.resumable``, wire.py): a chat or completion stream with one
choice (not ``n`` > 1, nor several prompts) anywhere, unless a grammar (``response_format``,
structured outputs), logprobs, echo, returned token ids, tools (a tool-call parser reads only
requests with tools), stop strings (vLLM holds back the text that may begin one: the ids run
ahead of the text sent), beam search or prompt embeddings are in play, or the deployment's
answers are parsed (a reasoning parser, or a Harmony model such as gpt-oss: the replica reports it);
those move only before their first token. A stream whose answer was whole when its replica died
only lacks its end (``end_of``); a continuation that dies before its first output is the same
move, tried on another replica (bounded by the router's ``MAX_ATTEMPTS``, not ``max_tries``).
Non-streaming requests send nothing before their end and are re-run from the start on another
replica, as before. A ``seed`` seeds the
continuation afresh: a resumed sampled answer is not the one an unbroken run would have given.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Container

from atomr_infer.errors import EngineError, EngineQueueFull
from atomr_infer.log import get_logger
from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute
from atomr_infer.wire import HttpHead, HttpRequest, RequestKind, RoutingFacts

log = get_logger(__name__)

Item = HttpHead | bytes


def can_move(facts: RoutingFacts, dep: DeploymentRoute, moved: int, generated: int) -> bool:
    """Whether a stream that had ``generated`` tokens when its replica died may move again."""
    if moved >= dep.migration_tries or not facts.resumable:
        return False
    return generated == 0 or (facts.resumable == "anywhere" and not dep.parses_output)


DONE = b"data: [DONE]\n\n"


def end_of(last: bytes) -> bytes | None:
    """What a one-choice stream whose replica died after ``last`` (its last body bytes) still
    needs to end, where its answer was whole: nothing after ``[DONE]``, ``[DONE]`` after the
    choice's finish_reason or the usage chunk that follows it. None: the answer was not whole
    (a continuation after a whole answer would add a token past its end)."""
    if last.endswith(DONE):
        return b""
    return DONE if _WHOLE.search(last) else None


# A choice's finish_reason (not null), or the usage chunk after it (no choice): vLLM's JSON is
# compact, and a quote inside content is escaped, so neither matches text the model wrote.
_WHOLE = re.compile(rb'"finish_reason": ?"|"choices": ?\[\]')


def on_model(
    usable: list[ReplicaRoute], dep: DeploymentRoute, model: str, excluded: Container[str]
) -> list[ReplicaRoute]:
    """The replicas a moved stream may continue on: those that serve the model its tokens came
    from (a roll may change the model). ``EngineError`` if the live ones all serve another."""
    same = [r for r in usable if r.model == model]
    live = [r for r in dep.replicas if r.actor_name not in excluded]
    # None live at all (its one replica died): wait for the replacement, as an unstarted request
    # waits for a replica; live ones, none on its model: a roll replaced them.
    if not same and live and not any(r.model == model for r in live):
        raise EngineError(f"its replica died mid-request, and no replica of {dep.name} serves {model} any more "
                          "to continue it on (a roll changed the model)")
    return same


def log_moved(deployment: str, replica: str, failed_at: float, tokens: int) -> None:
    """The first output of a moved stream arrived: log the gap the move cost."""
    log.info("request_migrated", deployment=deployment, replica=replica, tokens_before=tokens,
             gap_ms=round((time.monotonic() - failed_at) * 1000, 1))


def named(request: HttpRequest) -> HttpRequest:
    """The request with an ``X-Request-Id`` (if it has none): vLLM builds the stream's chunk ids
    from it, so a continuation's chunks carry the same id."""
    if any(k.lower() == "x-request-id" for k, _ in request.headers):
        return request
    return HttpRequest(request.method, request.path, (*request.headers, ("x-request-id", uuid.uuid4().hex)),
                       request.body)


async def seam(
    kind: RequestKind, items: AsyncIterator[Item], body_sent: bool, retry: tuple[str, int] | None = None
) -> AsyncIterator[Item]:
    """A continuation's items less what the client already has: the head, and (once the first
    part sent body bytes) a chat's opening chunk that only names the role (``response_role``, or
    the last message's without ``add_generation_prompt``). A
    continuation that failed (its head not 200) is an ``EngineError``, not text in the stream; one
    that a replica's vLLM refused with 503 (its queue full), where ``retry`` (the replica, its limit)
    says tries are left, ``EngineQueueFull``: the router continues it on another."""
    pending = b""
    opened = kind is not RequestKind.CHAT or not body_sent
    async for item in items:
        if isinstance(item, HttpHead):
            if item.status == 503 and retry is not None:
                await items.aclose()  # type: ignore[attr-defined] - (the router's request: closed, as on a first try)
                raise EngineQueueFull(*retry)
            if item.status != 200:
                body = b"".join([b async for b in items if isinstance(b, bytes)])[:300]
                raise EngineError(f"its replica died mid-request, and the continuation on another failed: "
                                  f"HTTP {item.status}: {body.decode(errors='replace')}")
            continue
        if opened:
            yield item
            continue
        pending += item
        while not opened and (end := pending.find(b"\n\n")) >= 0:
            event, pending = pending[: end + 2], pending[end + 2:]
            opened = not event.startswith(b":")  # an SSE comment (a keep-alive) opens nothing
            if not _role_only(event):
                yield event
        if opened and pending:
            yield pending
            pending = b""
    if pending:
        yield pending


def _role_only(event: bytes) -> bool:
    if not event.startswith(b"data: {"):
        return False
    try:
        choices = json.loads(event[6:])["choices"]
    except (ValueError, KeyError, TypeError):
        return False
    return (
        len(choices) == 1 and not choices[0].get("finish_reason")
        and {k for k, v in choices[0].get("delta", {}).items() if v} == {"role"}
    )
