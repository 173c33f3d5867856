"""What the ingress answers itself: errors in the shape of the API asked (OpenAI's, or
Anthropic's on ``/v1/messages``), the relay of a replica's stream, a model card, and the
``model`` of a multipart form (audio requests are routed by it)."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from atomr_infer.errors import AtomrError, InvalidRequest, ResponseNotFound
from atomr_infer.log import get_logger
from atomr_infer.serve.errors import ManagerUnreachable, http_error
from atomr_infer.serve.routes import served_paths
from atomr_infer.status import ADAPTER_ROUTED, DeploymentStatus
from atomr_infer.wire import LastBytes, RequestKind

log = get_logger(__name__)
ANTHROPIC_PREFIX = "/v1/messages"  # Anthropic's API: its clients read its error shape


def speaks_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def unexpected(exc: BaseException) -> BaseException | None:
    """``exc`` where it is none of our errors (a bug, to be logged with its traceback), else None."""
    return None if isinstance(exc, AtomrError) else exc


def error_response(exc: BaseException, path: str = "") -> JSONResponse:
    if isinstance(exc, ResponseNotFound):  # vLLM's own body for it
        return response_not_found(exc.response_id)
    err = http_error(exc)
    if err.status >= 500:
        log.warning("request_failed", status=err.status, error=repr(exc), exc_info=unexpected(exc))
    body = err.anthropic_body() if speaks_anthropic(path) else err.body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def response_not_found(response_id: str) -> JSONResponse:
    """vLLM's answer for a stored response it does not hold (its ``_make_not_found_error``):
    given by the ingress for an id that names no replica of atomr's."""
    message = f"Response with id '{response_id}' not found."
    body = {"error": {"message": message, "type": "invalid_request_error", "param": "response_id", "code": 404}}
    return JSONResponse(body, status_code=404)


class SSEResponse(StreamingResponse):
    """A streaming response that always closes its body iterator, also when the task is cancelled.

    It streams in the handler's task: Starlette's ``StreamingResponse`` runs the stream in a task
    group of its own beside a second task that waits for the client to leave, about 10% of the
    ingress's CPU per request in a profile (scripts/bench_dataplane.py, 16-token streams). The
    listener does that wait already (serve/listener.py ``cancel_on_hang_up``): when the client
    leaves, it cancels the handler, and this closes the stream, which aborts it in the engine."""

    media_type = "text/event-stream"

    async def stream_response(self, send: Any) -> None:
        """Starlette's, but the router's ``LastBytes`` end the response at once: when a batch ends
        many streams, every one of them ends for its client before any does its bookkeeping (the
        router's, the access log's, the rate limits'), which runs as the iterator stops after it.
        At 64 streams ending on one engine step, the last stream ended a median 2 ms sooner with
        this in alternating runs (8 bursts each), within the runs' spread (docs/performance.md,
        "where HTTP's last 0.3% at 64 streams goes"). A ``str`` chunk is encoded as Starlette does."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            if ended:  # nothing follows LastBytes; an error's event could not be sent any more
                log.warning("stream_bytes_after_end", size=len(chunk))
                continue
            ended = isinstance(chunk, LastBytes)
            if not isinstance(chunk, (bytes, memoryview)):
                chunk = chunk.encode(self.charset)
            await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
            if ended:
                await asyncio.sleep(0)  # the other streams this turn ended write their ends first
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.stream_response(send)
            if self.background is not None:
                await self.background()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


_NUMBER = re.compile(rb"\s*(\d+)")


async def relay(items: AsyncIterator[bytes], kind: RequestKind = RequestKind.OTHER) -> AsyncIterator[bytes]:
    """The replica's SSE bytes as they come; a failure mid-stream ends it with an error event
    in the stream's own shape (a Messages or Responses event, else OpenAI's ``data:`` error). A
    Responses error event is numbered after the last event relayed, as vLLM numbers its own: the
    openai client's resuming stream compares every event's ``sequence_number`` (None: TypeError)."""
    responses = kind in (RequestKind.RESPONSES, RequestKind.STORED)
    sequence = -1
    try:
        async for chunk in items:
            if responses and (at := chunk.rfind(b'"sequence_number":')) >= 0:
                found = _NUMBER.match(chunk, at + len(b'"sequence_number":'))
                sequence = int(found.group(1)) if found else sequence
            yield chunk
    except Exception as exc:  # noqa: BLE001 - the status line is gone; tell the client in-band
        err = http_error(exc)
        log.warning("stream_failed", status=err.status, error=repr(exc), exc_info=unexpected(exc))
        if kind is RequestKind.MESSAGES:
            yield b"event: error\ndata: " + json.dumps(err.anthropic_body()).encode() + b"\n\n"
        elif responses:
            event = {"type": "error", "code": err.code, "message": err.message, "param": err.param,
                     "sequence_number": sequence + 1}
            yield b"event: error\ndata: " + json.dumps(event).encode() + b"\n\n"
        else:
            yield err.sse()
            yield b"data: [DONE]\n\n"
    finally:
        await items.aclose()  # type: ignore[attr-defined]


def model_card(status: DeploymentStatus, name: str | None = None) -> dict[str, Any]:
    """The deployment's card (or one of an alias of it, ``name``), with the fields of vLLM's
    ``ModelCard``; ``endpoints`` says which routes its model serves (an embedding model has no chat)."""
    started = [r.started_at or 0 for r in status.replicas]
    created = int(min(started)) if started else 0
    card = {
        "id": name or status.name,
        "object": "model",
        "created": created,
        "owned_by": "atomr",
        "root": status.model,
        "parent": None,
        "max_model_len": next((r.max_model_len for r in status.replicas if r.max_model_len), None),
        "permission": [_permission(created)],
    }
    routes = next((r.routes for r in status.replicas if r.routes), ())
    if routes:
        card["endpoints"] = served_paths(routes)
    return card


def _permission(created: int) -> dict[str, Any]:
    """vLLM's ``ModelPermission``, as its cards carry one (the same values: nothing is restricted)."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
        "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True, "allow_search_indices": False,
        "allow_view": True, "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False,
    }


def adapter_cards(status: DeploymentStatus) -> list[dict[str, Any]]:
    """A card per LoRA adapter of the deployment that requests are routed to: each loaded on a ready
    replica, or, while none is ready (scaled to zero, starting: a request starts one), each of its
    spec, as ``vllm serve --lora-modules`` always lists its adapters. As vLLM's adapter cards: the
    ``parent`` is the deployment, the ``root`` the adapter's source (a path or a repo id), and no
    ``max_model_len``."""
    ready = [r for r in status.replicas if r.state == "ready"]
    names = {a for r in ready for a, state in r.adapters.items() if state in ADAPTER_ROUTED} if ready \
        else set(status.adapter_sources)
    base = model_card(status)
    return [{**base, "id": f"{status.name}:{a}", "root": status.adapter_sources.get(a), "parent": status.name,
             "max_model_len": None} for a in sorted(names)]


async def form_model(raw: bytes, content_type: str) -> Any:
    """The ``model`` field of a ``multipart/form-data`` (or urlencoded) body; ``InvalidRequest``
    naming ``body`` if it is not a form."""
    from starlette.datastructures import Headers
    from starlette.formparsers import FormParser, MultiPartParser

    async def stream() -> AsyncIterator[bytes]:
        yield raw

    headers = Headers({"content-type": content_type})
    if content_type.startswith("multipart/form-data"):
        parser: Any = MultiPartParser(headers, stream())
    elif content_type.startswith("application/x-www-form-urlencoded"):
        parser = FormParser(headers, stream())
    else:
        raise InvalidRequest("body", f"expected a multipart/form-data body, got content type {content_type!r}")
    try:
        form = await parser.parse()
    except Exception as exc:  # noqa: BLE001 - starlette's MultiPartException and friends
        raise InvalidRequest("body", f"the form cannot be parsed: {exc}") from None
    try:
        model = form.get("model")
        return model if isinstance(model, str) else None
    finally:
        await form.close()


def only_deployment(table: Any, key: Any = None) -> str:
    """The name a request that names no ``model`` (absent, null or empty) goes by: the one
    deployment served, as ``vllm serve`` answers such a request with its one model, by a name
    ``key`` may use it by (its own, or an alias the key lists). ``InvalidRequest`` naming ``model``
    where more are served, or none, or none the key may use (no name is said: ``/v1/models``
    lists them to those allowed to see them); ``ManagerUnreachable`` while there is no table."""
    from atomr_infer.serve.api_keys import may_use_as_asked

    if table.version < 0:
        raise ManagerUnreachable("no routing table yet: the manager is not answering")
    names = list(table.deployments)
    if len(names) != 1:
        where = "more than one deployment is served" if names else "no deployment is served"
        raise InvalidRequest("model", f"is required where {where}: name one (GET /v1/models lists them)")
    name = names[0]
    if key is None or key.may_use(name):
        return name
    for alias in table.deployments[name].aliases:
        if may_use_as_asked(key, alias, name):
            return alias
    raise InvalidRequest("model", "is required: name a model this API key may use (GET /v1/models lists them)")
