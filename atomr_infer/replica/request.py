"""What a caller sends to a replica, and what it gets back.

``GenerateRequest`` is validated at the replica's door: a bad value raises ``InvalidRequest``
naming the field, before anything reaches the engine. ``Chunk`` is one streamed piece; the
last one carries ``finish_reason`` and ``usage``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from atomr_infer.errors import InvalidRequest


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class GenerateRequest(BaseModel):
    """A completion (``prompt``) or chat (``messages``) request with its sampling settings."""

    model_config = ConfigDict(extra="forbid")

    request_id: str | None = Field(None, description="Caller's id, for logs; one is made if absent.")
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Most tokens to generate; default: what is left of max_model_len."
    )
    temperature: Annotated[float, Field(ge=0, le=100)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = -1
    stop: list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    n: Literal[1] = 1

    @model_validator(mode="before")
    @classmethod
    def _stop_as_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("stop"), str):
            data = {**data, "stop": [data["stop"]]}
        return data

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            which = "both" if self.prompt is not None else "neither"
            raise ValueError(f"give exactly one of prompt or messages (got {which})")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty")
        return self

    @property
    def input_field(self) -> str:
        return "prompt" if self.prompt is not None else "messages"


def parse_request(request: GenerateRequest | dict[str, Any]) -> GenerateRequest:
    """Validate a request; the first problem becomes ``InvalidRequest(field, message)``."""
    if isinstance(request, GenerateRequest):
        return request
    if not isinstance(request, dict):
        raise InvalidRequest("request", f"expected a mapping, got {type(request).__name__}")
    try:
        return GenerateRequest.model_validate(request)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "request"
        if first["type"] == "value_error":
            msg = first["msg"].removeprefix("Value error, ")
            loc = "prompt" if "prompt or messages" in msg else loc
            raise InvalidRequest(loc, msg) from None
        if first["type"] == "extra_forbidden":
            raise InvalidRequest(loc, f"unsupported field {loc!r}") from None
        msg = first["msg"][0].lower() + first["msg"][1:]
        raise InvalidRequest(loc, f"{msg}, got {first.get('input')!r}") from None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Chunk:
    """One streamed piece of output: the text and token ids generated since the last chunk."""

    text_delta: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last chunk
    usage: Usage | None = None  # on the last chunk

    def merge(self, later: Chunk) -> None:
        """Fold a later chunk into this one (used when the consumer lags)."""
        self.text_delta += later.text_delta
        self.token_ids.extend(later.token_ids)
        self.finish_reason = later.finish_reason or self.finish_reason
        self.usage = later.usage or self.usage
