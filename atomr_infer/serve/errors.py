"""Our typed errors as OpenAI-style JSON bodies and HTTP statuses (only here, at the edge);
on Anthropic's ``/v1/messages`` routes, the same statuses in Anthropic's shape.

    DeploymentNotFound  404  invalid_request_error  model_not_found
    InvalidRequest      400  invalid_request_error  param = the field
    RequestTooLarge     413  invalid_request_error  param = body, the limit in the message
    ApiKeyError         401  invalid_request_error  missing_api_key | invalid_api_key (WWW-Authenticate)
                        403  permission_error       model_not_allowed
    RateLimited         429  rate_limit_error       rate_limit_exceeded, Retry-After, x-ratelimit-*
    CapacityExhausted   429  rate_limit_error       Retry-After header
    NoReadyReplica      503  service_unavailable    Retry-After header (AdapterNotLoaded too: ready, the adapter not)
    ManagerUnreachable  503  service_unavailable    Retry-After header
    ManagerRecovering   503  service_unavailable    manager_recovering, Retry-After header
    ReplicaUnavailable  503  service_unavailable
    EngineError         500  server_error           (mid-stream: a final SSE error event, then [DONE])
    anything else       500  server_error           logged with its traceback
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from atomr_infer.errors import (
    AtomrError,
    CapacityExhausted,
    DeploymentNotFound,
    EngineError,
    InvalidRequest,
    NoReadyReplica,
    ReplicaUnavailable,
    RequestTooLarge,
    ResponseNotFound,
    RoutingError,
)
from atomr_infer.serve.api_keys import ApiKeyError
from atomr_infer.serve.rate_limit import RateLimited


class ManagerUnreachable(RoutingError):
    """The ingress has no routing table: the manager is not answering (not started, or restarting)."""

    retryable = True

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return f"the atomr manager is unreachable ({self.reason}); hint: `atomr up`, or check `atomr status`"


class ManagerRecovering(ManagerUnreachable):
    """The manager answers, but restarted and cannot say what is deployed yet (its stored state
    not read back): the catalog has no answer, which is not "no deployments"."""

    def __str__(self) -> str:
        return self.reason


# Anthropic's error types by status (docs.anthropic.com "Errors").
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
}


@dataclass(frozen=True)
class HttpError:
    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, object]:
        """The error in Anthropic's shape (``/v1/messages``), with its type for the status."""
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def sse(self) -> bytes:
        """The error as one SSE event, for failures after the stream has started."""
        return b"data: " + json.dumps(self.body()).encode() + b"\n\n"


def _retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def http_error(exc: BaseException) -> HttpError:
    """Map an exception to its HTTP error."""
    if isinstance(exc, RateLimited):
        return HttpError(429, str(exc), "rate_limit_error", None, "rate_limit_exceeded", exc.verdict.headers())
    if isinstance(exc, ApiKeyError):
        if exc.status == 401:
            return HttpError(401, exc.message, "invalid_request_error", None, exc.code, {"WWW-Authenticate": "Bearer"})
        return HttpError(exc.status, exc.message, "permission_error", "model", exc.code)
    if isinstance(exc, RequestTooLarge):
        return HttpError(413, exc.message, "invalid_request_error", "body", "request_too_large")
    if isinstance(exc, InvalidRequest):
        return HttpError(400, exc.message, "invalid_request_error", exc.field, "invalid_value")
    if isinstance(exc, DeploymentNotFound):
        return HttpError(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, ResponseNotFound):
        return HttpError(404, str(exc), "invalid_request_error", "response_id", "response_not_found")
    if isinstance(exc, CapacityExhausted):
        return HttpError(
            429, str(exc), "rate_limit_error", None, "capacity_exhausted", _retry_after(exc.retry_after_s)
        )
    if isinstance(exc, NoReadyReplica):
        return HttpError(503, str(exc), "service_unavailable", None, "no_ready_replica", _retry_after(1))
    if isinstance(exc, ManagerRecovering):
        return HttpError(503, str(exc), "service_unavailable", None, "manager_recovering", _retry_after(1))
    if isinstance(exc, ManagerUnreachable):
        return HttpError(503, str(exc), "service_unavailable", None, "manager_unreachable", _retry_after(1))
    if isinstance(exc, ReplicaUnavailable):
        return HttpError(503, str(exc), "service_unavailable", None, "replica_unavailable", _retry_after(1))
    if isinstance(exc, EngineError):
        return HttpError(500, str(exc), "server_error", None, "engine_error")
    if isinstance(exc, AtomrError):
        return HttpError(500, str(exc), "server_error", None, type(exc).__name__)
    return HttpError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error")
