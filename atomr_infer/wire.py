"""The typed wire between routers (the ingress's, a ``Client``'s) and replicas.

A request is parsed once at the edge (the ingress, or the ``Client`` from its own fields) into
``RoutingFacts``, which the router reads to pick a replica, and an ``HttpRequest``, which the
replica's vLLM server parses once more (and only there) to answer it:

    edge ── RoutingFacts + HttpRequest ──► Router ── OpenRequest ──► replica (open_many)
    router ◄── Batch (items, ends, token ids; load) ── replica (channel)
    router ── cancel(channel, request ids) / keepalive(channel) ──► replica

One ``open_many`` call carries every request a router opened on a replica in one turn of its
event loop; one streaming ``channel`` call per (router, replica) carries their outputs in
``Batch``es, one Ray object per engine step, not one per request (replica/channel.py). A
channel is a lease: the router renews it every ``KEEPALIVE_S``; the replica closes one not
heard from for ``LEASE_S`` and cancels its requests (a router that died says nothing).

``OpenRequest.want_token_ids`` and ``Batch.token_ids`` carry what a stream generated (a request
resumed on another replica continues after it). Where a replica publishes its KV-cache events
travels in the routing table (``ReplicaRoute.kv_events``), not on a channel: a router's index
must cover replicas it never opened a channel to. The LoRA adapter a request names is resolved by
the router from the routing table (``RoutingTable.resolve``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter, ValidationError

from atomr_infer.errors import InvalidRequest

KEEPALIVE_S = 3.0  # how often a router renews its channels
LEASE_S = 15.0  # a channel not renewed for this long belongs to a router that is gone


class RequestKind(enum.StrEnum):
    """What a request asks of the model, from the route it came in on."""

    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"
    TOKENIZE = "tokenize"
    DETOKENIZE = "detokenize"
    RESPONSES = "responses"  # a Responses-API request (POST /v1/responses)
    MESSAGES = "messages"  # an Anthropic Messages request (POST /v1/messages)
    COUNT_TOKENS = "count_tokens"  # Anthropic's POST /v1/messages/count_tokens
    RENDER = "render"  # the prompt a request would run, rendered (POST .../render, .../derender)
    STORED = "stored"  # a stored Responses-API response retrieved or cancelled (GET /v1/responses/{id}...)
    OTHER = "other"  # a route of vLLM's server routed by model, with no facts of its own

    @classmethod
    def of_path(cls, path: str) -> RequestKind:
        return _KIND_OF_PATH.get(path.partition("?")[0], cls.OTHER)

    @property
    def runs_engine(self) -> bool:
        """Whether it takes a place in the engine's batch. Tokenizing, rendering, and retrieving or
        cancelling a stored response do not (vLLM's serving layer answers them), so they are not
        held to ``serving.max_concurrent`` nor charged tokens: a client that counts tokens, or polls
        a background response, is answered at once, not after a generation ends (or with 429), as
        on ``vllm serve``."""
        return self not in _NO_ENGINE


_KIND_OF_PATH = {
    "/v1/chat/completions": RequestKind.CHAT,
    "/v1/completions": RequestKind.COMPLETION,
    "/v1/embeddings": RequestKind.EMBEDDING,
    "/tokenize": RequestKind.TOKENIZE,
    "/detokenize": RequestKind.DETOKENIZE,
    "/v1/responses": RequestKind.RESPONSES,
    "/v1/messages": RequestKind.MESSAGES,
    "/v1/messages/count_tokens": RequestKind.COUNT_TOKENS,
    **dict.fromkeys(("/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
                     "/v1/responses/render", "/cohere/v2/chat/render", "/v1/chat/completions/derender",
                     "/v1/completions/derender"), RequestKind.RENDER),
}
_NO_ENGINE = frozenset({RequestKind.TOKENIZE, RequestKind.DETOKENIZE, RequestKind.COUNT_TOKENS, RequestKind.RENDER,
                        RequestKind.STORED})
NO_LIMIT = 1 << 30  # OpenRequest.limit of a request that runs no engine step (RequestKind.runs_engine)
_RESUMABLE = frozenset({RequestKind.CHAT, RequestKind.COMPLETION})
# Kinds whose streams always report usage (chat and completions do on request).
_USAGE_ALWAYS = frozenset({RequestKind.RESPONSES, RequestKind.MESSAGES})


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """One OpenAI API request as the edge forwards it: vLLM's app parses and validates it."""

    method: str
    path: str  # with the query string, e.g. "/v1/chat/completions"
    headers: tuple[tuple[str, str], ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class HttpHead:
    """The start of an HTTP response: what the edge sends before the body."""

    status: int
    headers: tuple[tuple[str, str], ...]


class LastBytes(bytes):
    """A response's last body bytes: the stream ended without error after them, nothing follows.

    A router yields its body pieces as plain ``bytes`` and the last as ``LastBytes`` when it
    knows, by then, that the replica ended the response (the end came with them, as at the end
    of an engine step): the ingress sends them with the end of the HTTP response, before the
    bookkeeping of the stream's end. A hop that rebuilds the last piece keeps its type
    (``without_usage``: ``type(chunk)(...)``) or yields plain ``bytes`` (the migration seam);
    with plain bytes the end goes as it always did, after the iterator stops."""

    __slots__ = ()


_BOOL: TypeAdapter[bool] = TypeAdapter(bool)


def as_vllm_reads(flag: Any) -> bool:
    """A boolean field as vLLM's pydantic request models read it (lax: 1, "true", "yes", "off", …);
    a value they refuse is False here (vLLM answers 400). Read as ``is True``, ``"stream": 1``
    streamed without the usage a token budget is charged from."""
    try:
        return _BOOL.validate_python(flag) if flag is not None else False
    except ValidationError:
        return False


@dataclass(slots=True)
class RoutingFacts:
    """What routing needs of a request, read once at the edge from the parsed body. Stays in
    the router's process (the replica gets the body itself)."""

    deployment: str
    kind: RequestKind
    stream: bool = False
    usage_wanted: bool = True  # a stream that did not ask for usage says False
    # A stored response the request names (previous_response_id, or the path's id for a
    # retrieve or cancel): routed to the replica that holds it (routing/response_ids.py).
    response_id: str | None = None
    # A Responses-API request that sets no ``request_id``: the router names its response after
    # the replica it picks, so that a later request for it finds that replica.
    names_response: bool = False
    # The body names the request (``request_id``): vLLM builds its ids from it, as the router's
    # ``X-Request-Id`` for a stream that may move would otherwise (routing/migration.py).
    named: bool = False
    # Whether another replica may take over this stream if its replica dies (``resumable``):
    # "anywhere" after the token ids generated so far, "unstarted" only before its first token.
    resumable: str = ""
    # The body's ``messages`` (a list: chat, Messages), ``prompt`` (a string: completion) or
    # ``input`` (Responses), as parsed:
    # the prefix key of routing.prefix is computed from it only where the deployment routes by
    # prefix. None when the body has neither.
    prompt: Any = None
    # A chat's fields its template renders besides the messages (tools, chat_template_kwargs, …)
    # and how it is tokenized (a completion's too: add_special_tokens): routing.policy kv_events
    # tokenizes the prompt as vLLM renders it. None when it has none.
    template: dict[str, Any] | None = None
    # Whether waiting for it may start a replica of a deployment scaled to zero (demand): not
    # for a caller the API did not authenticate (tokenizing is open where it has keys).
    wakes: bool = True
    # The body's ``cache_salt``: vLLM hashes it into the prompt's first block, so only a request
    # with the same salt reuses its cache (routing.policy kv_events matches by it). None: unsalted.
    cache_salt: str | None = None

    @classmethod
    def of(cls, path: str, data: Any, unnamed_to: str | None = None) -> RoutingFacts:
        """The facts of a parsed request body; ``InvalidRequest`` naming ``model`` (or ``body``)
        when it does not name a deployment. ``unnamed_to``: the deployment of a body whose
        ``model`` is absent, null or empty (vLLM's server answers it with its one model)."""
        if not isinstance(data, dict):
            raise InvalidRequest("body", f"expected a JSON object, got {type(data).__name__}")
        model = data.get("model") if unnamed_to is None or data.get("model") not in (None, "") else unnamed_to
        if not isinstance(model, str) or not model:
            raise InvalidRequest("model", f"model must name a deployment (a non-empty string), got {model!r}")
        stream = as_vllm_reads(data.get("stream"))
        options = data.get("stream_options")
        asked = isinstance(options, dict) and as_vllm_reads(options.get("include_usage"))
        previous = data.get("previous_response_id")
        salt = data.get("cache_salt")  # vLLM refuses one not a non-empty string (400)
        kind = RequestKind.of_path(path)
        # As routing has always read them: a chat's messages if a list, else a prompt's text.
        messages, text = data.get("messages"), data.get("prompt")
        if kind is RequestKind.RESPONSES and not isinstance(messages, list):
            messages = data.get("input")
            text, messages = (messages, None) if isinstance(messages, str) else (text, messages)
        return cls(
            deployment=model,
            kind=kind,
            stream=stream,
            usage_wanted=(
                not stream or asked or kind in _USAGE_ALWAYS or (options is not None and not isinstance(options, dict))
            ),
            response_id=previous if isinstance(previous, str) else None,
            names_response=kind is RequestKind.RESPONSES and "request_id" not in data,
            named=isinstance(data.get("request_id"), str),
            resumable=resumable(data, kind is RequestKind.CHAT) if stream and kind in _RESUMABLE else "",
            prompt=messages if isinstance(messages, list) else text if isinstance(text, str) else None,
            template={k: data[k] for k in _TEMPLATE_FIELDS.get(kind, ()) if k in data} or None,
            cache_salt=salt if isinstance(salt, str) and salt else None,
        )

    @classmethod
    def of_http(cls, request: HttpRequest) -> RoutingFacts:
        """The facts of a request held only as bytes (tools, tests): parses its body."""
        import json

        try:
            data = json.loads(request.body)
        except ValueError as exc:
            raise InvalidRequest("body", f"the request body is not valid JSON: {exc}") from None
        return cls.of(request.path, data)


# The fields besides the prompt by which vLLM renders and tokenizes a chat or a completion
# (ChatCompletionRequest.build_chat_params and build_tok_params; CompletionRequest's).
_TEMPLATE_FIELDS = {
    RequestKind.CHAT: ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                       "documents", "reasoning_effort", "add_special_tokens", "chat_template"),
    RequestKind.COMPLETION: ("add_special_tokens",),
}

# Request fields under which a continuation is not the answer the client would have had: a
# grammar's or a parser's state mid-way, logprobs computed with another context, several choices.
# Beam search: each beam step is an engine request of its own; prompt embeddings: the prompt is
# not the token ids a continuation extends.
_STATEFUL = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
             "guided_grammar", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "return_token_ids",
             "use_beam_search", "prompt_embeds")


def resumable(data: dict[str, Any], chat: bool = False) -> str:
    """``RoutingFacts.resumable`` of a chat (``chat``) or completion stream's body: "anywhere" where a
    continuation after the generated token ids is the same answer; "unstarted" where it is not
    but a start elsewhere before the first token is (one choice); "" otherwise."""
    # Several prompts: one engine request and one choice each, whose token ids one stream cannot
    # tell apart (nor its end: one choice's finish_reason is not the answer's).
    prompt = data.get("prompt")
    prompts = isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(p, int) for p in prompt)
    if data.get("n", 1) not in (1, None) or data.get("best_of", 1) not in (1, None) or prompts:
        return ""
    stateful = any(_asked(k, data.get(k), chat) for k in _STATEFUL)
    fmt = data.get("response_format")
    if stateful and isinstance(fmt, dict) and fmt.get("type") == "text":  # text is no format at all
        stateful = any(_asked(k, data.get(k), chat) for k in _STATEFUL if k != "response_format")
    tools = data.get("tools") and data.get("tool_choice") != "none"
    # Stop strings: vLLM holds back the text that may begin one, so the token ids a replica
    # reports run ahead of the text it sent, and one across the seam would go unseen.
    stops = data.get("stop")
    return "unstarted" if stateful or tools or stops else "anywhere"


_FLAGS = frozenset({"echo", "return_token_ids", "use_beam_search"})


def _asked(key: str, value: Any, chat: bool) -> bool:
    """Whether a ``_STATEFUL`` field asks for what it names, as vLLM reads it: a flag (a chat's
    ``logprobs`` too) as a boolean, ``0`` false; ``top_logprobs: 0`` is vLLM's default, none; a
    completion's ``logprobs`` and ``prompt_logprobs`` as a number, where ``0`` asks for the chosen
    token's logprob (though ``0 == False``); a format or a grammar whenever set."""
    if value is None or value is False:
        return False
    if key in _FLAGS or (key == "logprobs" and chat):
        return as_vllm_reads(value)
    return value != 0 if key == "top_logprobs" else True


@dataclass(slots=True)
class OpenRequest:
    """One request a router opens on a replica (a list of them per ``open_many`` call)."""

    request_id: str  # the router's id for it on this channel
    http: HttpRequest
    limit: int | None = None  # the routing table's max_concurrent (changes in place); None: the spec's
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base model)
    want_token_ids: bool = False  # batches carry the token ids this request generates
    # The token ids it generated on a replica that died mid-stream: continue after them
    # (routing/migration.py), as one answer with the first part's.
    resume: list[int] | None = None
    # kv_events: the blocks of its prompt its router expects the replica to prefill (those the
    # replica does not hold), counted in ``Batch.prefill`` until its first output, or until the
    # engine prefilled it (an answer not streamed: ``Batch.prefilled``).
    prefill_blocks: int = 0

    @property
    def runs_engine(self) -> bool:
        """False for tokenizing (``limit`` NO_LIMIT): neither held to a limit nor counted in one."""
        return self.limit is None or self.limit < NO_LIMIT


@dataclass(slots=True)
class Batch:
    """What one message of a channel carries, for every request of that router with news."""

    load: int  # requests open on the replica (from every router) when the batch left
    items: dict[str, list[HttpHead | bytes]] = field(default_factory=dict)  # request id -> new items, in order
    ended: dict[str, BaseException | None] = field(default_factory=dict)  # request id -> its error, or None
    # request id -> the token ids it generated since the last batch (requests that asked).
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Blocks of prefill waiting on the replica (from every router): its open requests' with no
    # output yet, as their routers estimated them (``OpenRequest.prefill_blocks``).
    prefill: int = 0
    # Requests whose prompt the replica computed though they have no output yet (an answer not
    # streamed comes whole at the end): their prefill no longer waits.
    prefilled: list[str] = field(default_factory=list)
    # The last batch of a channel the replica closed because its engine failed: why (its router
    # moves or re-runs those requests elsewhere, once: routing/channel.py ``EngineGone``).
    engine_failed: str | None = None

    def __bool__(self) -> bool:
        return bool(self.items or self.ended or self.token_ids or self.prefilled or self.engine_failed)
