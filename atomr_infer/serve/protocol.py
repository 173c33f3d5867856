"""OpenAI request models for the fields atomr-infer supports, and their translation.

The models follow OpenAI's schema for ``/v1/chat/completions`` and ``/v1/completions``
(plus vLLM's ``top_k`` and ``ignore_eos`` extensions). Every other field is rejected with
``InvalidRequest`` naming it, never silently ignored (a few that clients send by default are
accepted at their "off" value, e.g. ``presence_penalty: 0``). ``parse_chat`` / ``parse_completion``
turn a JSON body into a model; ``to_generate_request`` into the dict a replica takes.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError, model_validator

from atomr_infer.errors import InvalidRequest


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = Field(False, description="Send a last chunk with token usage and no choices.")


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] = Field(description="Text, or a list of text parts (joined by newlines).")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class _Sampling(_Strict):
    """Fields common to both endpoints."""

    model: StrictStr = Field(description="The deployment name.")
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(None, description="Most tokens to generate.")
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = Field(None, description="vLLM extension; -1 = all tokens.")
    stop: StrictStr | list[StrictStr] | None = Field(None, description="Up to 4 stop strings.")
    seed: int | None = None
    n: Literal[1] | None = Field(1, description="Choices per request; only 1 is supported.")
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = Field(None, description="End-user id (accepted for compatibility).")
    ignore_eos: StrictBool | None = Field(None, description="vLLM extension: keep generating past EOS.")

    @model_validator(mode="after")
    def _check_stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError("stop takes at most 4 sequences")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def max_tokens_field(self) -> str:
        """The name the caller used for the token limit (for error ``param``s)."""
        return "max_tokens"


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="OpenAI's newer name for max_tokens; wins when both are given."
    )

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(_Sampling):
    prompt: StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=1)] = Field(
        description="One prompt (a string, or a list holding one string)."
    )


def _param(loc: tuple[Any, ...]) -> str:
    """A pydantic location as OpenAI-style param text: ``messages[0].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "str" or "[" in str(part):
            continue  # a union member's label (``str``, ``list[TextPart]``), not a field
        else:
            out += f".{part}" if out else str(part)
    return out


_MESSAGE_FOR_PARAM = {
    "n": "only n=1 is supported",
    "temperature": "temperature must be between 0 and 2",
    "top_p": "top_p must be greater than 0 and at most 1",
    "max_tokens": "max_tokens must be a positive integer",
    "max_completion_tokens": "max_completion_tokens must be a positive integer",
    "prompt": "prompt must be a string, or a list holding one string",
}


# Unsupported fields that clients often send at the value meaning "off" (or null): accepted at
# exactly that value (nothing is ignored: off is what we do), rejected at any other.
_NEUTRAL: dict[str, Any] = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logprobs": False,
    "logit_bias": {},
    "echo": False,
    "best_of": 1,
}


def _is_neutral(name: str, value: Any) -> bool:
    neutral = _NEUTRAL[name]
    return value is None or (value == neutral and isinstance(value, bool) == isinstance(neutral, bool))


def _parse(model: type[_Sampling], body: Any) -> Any:
    if not isinstance(body, dict):
        raise InvalidRequest("body", f"expected a JSON object, got {type(body).__name__}")
    body = {k: v for k, v in body.items() if not (k in _NEUTRAL and _is_neutral(k, v))}
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _to_invalid(exc) from None


def _to_invalid(exc: ValidationError) -> InvalidRequest:
    errors = exc.errors(include_url=False)
    extra = [_param(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        names = ", ".join(repr(n) for n in extra)
        plural = "s" if len(extra) > 1 else ""
        only = [f"{n}={json.dumps(_NEUTRAL[n])}" for n in extra if n in _NEUTRAL]
        hint = f" (accepted only as {', '.join(only)})" if only else ""
        return InvalidRequest(extra[0], f"unsupported field{plural} {names}: atomr-infer does not implement it{hint}")
    first = errors[0]
    param = _param(first["loc"])
    if first["type"] == "missing":
        return InvalidRequest(param, f"{param} is required")
    if first["type"] == "value_error":
        msg = first["msg"].removeprefix("Value error, ")
        return InvalidRequest(msg.split(" ", 1)[0], msg)
    known = _MESSAGE_FOR_PARAM.get(param)
    detail = first["msg"][0].lower() + first["msg"][1:]
    msg = f"{known}, got {first.get('input')!r}" if known else f"{param}: {detail}, got {first.get('input')!r}"
    return InvalidRequest(param, msg)


def parse_chat(body: Any) -> ChatCompletionRequest:
    """Validate a ``/v1/chat/completions`` body; the first problem raises ``InvalidRequest``."""
    return _parse(ChatCompletionRequest, body)


def parse_completion(body: Any) -> CompletionRequest:
    """Validate a ``/v1/completions`` body; the first problem raises ``InvalidRequest``."""
    return _parse(CompletionRequest, body)


def to_generate_request(req: ChatCompletionRequest | CompletionRequest, request_id: str) -> dict[str, Any]:
    """The replica's request dict (``atomr_infer.replica.request.GenerateRequest``)."""
    out: dict[str, Any] = {"request_id": request_id}
    if isinstance(req, ChatCompletionRequest):
        out["messages"] = [{"role": m.role, "content": m.text()} for m in req.messages]
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    else:
        out["prompt"] = req.prompt if isinstance(req.prompt, str) else req.prompt[0]
        max_tokens = req.max_tokens
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    for name in ("temperature", "top_p", "top_k", "stop", "seed", "ignore_eos"):
        value = getattr(req, name)
        if value is not None:
            out[name] = value
    return out
