"""One OpenAI request sent straight to a replica actor's ``http`` method (no router, no HTTP
server), read back as a caller of vLLM's server would: the status, and for a stream its
events, text, finish reason, usage and (with ``return_token_ids``) token ids."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from atomr_infer.wire import HttpHead, HttpRequest

JSON = (("content-type", "application/json"),)


def http_request(path: str, body: dict[str, Any]) -> HttpRequest:
    return HttpRequest("POST", path, JSON, json.dumps({"model": body.pop("model", "smollm2"), **body}).encode())


@dataclass
class Answer:
    status: int
    body: bytes = b""
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def error(self) -> dict[str, Any]:
        return json.loads(self.body)["error"]

    @property
    def text(self) -> str:
        return "".join(c.get("text") or (c.get("delta") or {}).get("content") or ""
                       for e in self.events for c in e.get("choices", ()))

    @property
    def finish_reason(self) -> str | None:
        reasons = [c.get("finish_reason") for e in self.events for c in e.get("choices", ())]
        return next((r for r in reversed(reasons) if r), None)

    @property
    def usage(self) -> dict[str, int]:
        return next(e["usage"] for e in reversed(self.events) if e.get("usage"))

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for c in e.get("choices", ()) for t in (c.get("token_ids") or ())]


def read(items: list[HttpHead | bytes]) -> Answer:
    head, body = items[0], b"".join(i for i in items[1:] if isinstance(i, bytes))
    assert isinstance(head, HttpHead), items[:2]
    answer = Answer(head.status, body)
    for event in body.split(b"\n\n"):
        data = event.removeprefix(b"data: ").strip()
        if event.startswith(b"data: {"):
            answer.events.append(json.loads(data))
    return answer


def run(replica: Any, body: dict[str, Any], path: str = "/v1/completions") -> Answer:
    """A streamed request (usage included) to ``replica`` (an actor handle), read whole."""
    import ray

    body = {"stream": True, "stream_options": {"include_usage": True}, **body}
    return read([ray.get(ref) for ref in replica.http.remote(http_request(path, body))])
