"""Every route of vLLM 0.32's OpenAI server, and what atomr's HTTP API does with it.

The replica runs vLLM's own server (engine/vllm/openai_app.py), so every route below exists
there; the ingress decides which are reachable over atomr's API and how each is routed:

- ``BODY``: a model-facing route, routed by its JSON body's ``model`` to that deployment, as
  chat is (router, channels, limits, usage, access log); vLLM's handler answers in the replica.
- ``FORM``: the same, for a multipart body (audio): routed by the form's ``model`` field.
- ``RESPONSE``: a stored Responses-API response, routed by its id (routing/response_ids.py).
- ``INGRESS``: answered by the ingress itself, over every deployment.
- ``OPERATOR``: acts on one server's engine or process (sleep, weights, profiling, caches,
  adapters): never reachable by API-key holders; where an operator needs it, the control plane
  does it on every replica of a deployment (``atomr reset-cache``, ``ControlPlane``).
- ``NOT_SERVED``: describes one vLLM server (its metrics, load, version, docs, SageMaker's
  health check); atomr has its own (Ray's metrics endpoint, ``/health``, ``/v1/models``).

tests/unit/test_api_routes.py checks that this table names every route vLLM's app registers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Via(enum.StrEnum):
    BODY = "body"
    FORM = "form"
    RESPONSE = "response"
    INGRESS = "ingress"
    OPERATOR = "operator"
    NOT_SERVED = "not served"


@dataclass(frozen=True)
class ApiRoute:
    method: str
    path: str
    via: Via
    why: str = ""  # for routes not routed: why, and what to use instead

    @property
    def key(self) -> str:
        return f"{self.method} {self.path}"


def _all(via: Via, paths: str, why: str = "", method: str = "POST") -> list[ApiRoute]:
    return [ApiRoute(method, path, via, why) for path in paths.split()]


_SERVER = "describes one vLLM server; atomr's metrics are on Ray's endpoint (`atomr status`, docs/monitoring.md)"
_ENGINE = "acts on one replica's engine or process; not for API-key holders"
_ADAPTERS = f"{_ENGINE}: LoRA adapters are declared in the deployment's spec"

ROUTES: tuple[ApiRoute, ...] = (
    # Generation (a model whose runner generates).
    *_all(Via.BODY, "/v1/chat/completions /v1/completions /v1/responses /v1/messages /v1/messages/count_tokens"),
    *_all(Via.BODY, "/v1/chat/completions/batch /cohere/v2/chat /generative_scoring /v1/systemone"),
    *_all(Via.BODY, "/inference/v1/generate"),  # token ids in, token ids out
    # Rendering: the prompt a request becomes, and back (tokenizer only).
    *_all(Via.BODY, "/v1/chat/completions/render /v1/completions/render /v1/messages/render /v1/responses/render"),
    *_all(Via.BODY, "/cohere/v2/chat/render /v1/chat/completions/derender /v1/completions/derender"),
    *_all(Via.BODY, "/tokenize /detokenize"),
    # Pooling (a model whose runner pools): embeddings, scores, classes.
    *_all(Via.BODY, "/v1/embeddings /v2/embed /pooling /classify /score /v1/score /rerank /v1/rerank /v2/rerank"),
    *_all(Via.BODY, "/invocations"),  # SageMaker's one route: the body's shape says which endpoint
    # Speech to text: multipart bodies.
    *_all(Via.FORM, "/v1/audio/transcriptions /v1/audio/translations"),
    # Stored responses.
    ApiRoute("GET", "/v1/responses/{response_id}", Via.RESPONSE),
    ApiRoute("POST", "/v1/responses/{response_id}/cancel", Via.RESPONSE),
    # The ingress's own, over every deployment.
    *_all(Via.INGRESS, "/v1/models /health", method="GET"),
    # Operators' routes.
    *_all(Via.OPERATOR, "/reset_prefix_cache", f"{_ENGINE}: `atomr reset-cache DEPLOYMENT` resets every replica's"),
    *_all(Via.OPERATOR, "/reset_mm_cache /reset_encoder_cache /sleep /wake_up /release_kv_cache_memory", _ENGINE),
    *_all(Via.OPERATOR, "/collective_rpc /start_profile /stop_profile /pause /resume /abort_requests", _ENGINE),
    *_all(Via.OPERATOR, "/inference/v1/abort_requests /scale_elastic_ep /is_scaling_elastic_ep", _ENGINE),
    *_all(Via.OPERATOR, "/init_weight_transfer_engine /shutdown_weight_transfer_engine", _ENGINE),
    *_all(Via.OPERATOR, "/start_weight_update /start_draft_weight_update /update_weights", _ENGINE),
    *_all(Via.OPERATOR, "/finish_weight_update /update_weight_version /weight_checker /fault_tolerance/apply", _ENGINE),
    *_all(Via.OPERATOR, "/is_sleeping /is_paused /server_info /weight_info /get_world_size", _ENGINE, "GET"),
    *_all(Via.OPERATOR, "/fault_tolerance/status", _ENGINE, "GET"),
    *_all(Via.OPERATOR, "/v1/load_lora_adapter /v1/unload_lora_adapter /adapters", _ADAPTERS),
    *_all(Via.OPERATOR, "/adapters/{adapter_name}", _ADAPTERS, "DELETE"),
    # One server's own description.
    *_all(Via.NOT_SERVED, "/metrics /load /version /kv_event_sources /tokenizer_info", _SERVER, "GET"),
    *_all(Via.NOT_SERVED, "/ping", "SageMaker's health check: atomr's is GET /health", "GET"),
    *_all(Via.NOT_SERVED, "/ping", "SageMaker's health check: atomr's is GET /health"),
    *_all(Via.NOT_SERVED, "/openapi.json /docs /docs/oauth2-redirect /redoc", "vLLM's API docs pages", "GET"),
)
BY_KEY = {route.key: route for route in ROUTES}


def paths(via: Via) -> list[str]:
    return [route.path for route in ROUTES if route.via is via]


def refused(via: Via) -> list[ApiRoute]:
    return [route for route in ROUTES if route.via is via]


def served_paths(replica_routes: tuple[str, ...]) -> list[str]:
    """Of a replica's routes ("METHOD /path", engine/backend.py ``EngineFacts.routes``), the
    model-facing paths atomr routes to it."""
    routed = {Via.BODY, Via.FORM, Via.RESPONSE}
    return sorted({r.path for key in replica_routes if (r := BY_KEY.get(key)) is not None and r.via in routed})
