"""The OpenAI-compatible HTTP API: a Ray Serve ingress that routes by ``model`` = deployment name.

Each ingress replica holds its own ``Router`` over a ``TableCache`` (the manager's routing
table, pushed by long poll), so a request costs no manager round trip. The ingress reads only
the body's routing facts (wire.py ``RoutingFacts``: ``model`` and what routing needs), parsing
the body once; the replica runs the request through vLLM's own OpenAI server
(engine/vllm/openai_app.py), whose status, headers and body come back unchanged, streamed as
sent. Each ingress replica serves HTTP itself (serve/listener.py). Client disconnect cancels
the handler's task (the listener does this, streaming or not); the cancellation runs through
the router's ``finally``, which cancels the replica's generator and so aborts the request in
the engine within one step.

Every model-facing route of vLLM's server is routed (serve/routes.py lists them all and says
what happens to the rest): by the JSON body's ``model`` (chat, completions, Responses,
Anthropic Messages, embeddings, pooling, score, rerank, ...), by a multipart form's ``model``
(audio), or by a stored response's id (``GET /v1/responses/{id}``, ``.../cancel``). The
ingress itself answers ``GET /v1/models``, ``/v1/models/{name}`` and ``/health``.

With an API keys file (``atomr serve --api-keys FILE``, serve/api_keys.py) every routed route
needs ``Authorization: Bearer KEY`` or ``x-api-key: KEY``: 401 without a valid key, 403 for a
deployment the key may not use (in Anthropic's error shape on ``/v1/messages``); ``/health``
(and, as with ``vllm serve --api-key``, ``/tokenize`` and ``/detokenize``) stay open, naming
no deployment to a caller without a valid key. The key is never forwarded to the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve

from atomr_infer import heavy_imports
from atomr_infer.errors import AtomrError, DeploymentNotFound, NoReadyReplica, one_line, unwrap
from atomr_infer.log import get_logger
from atomr_infer.routing import response_ids
from atomr_infer.routing.router import Router
from atomr_infer.serve.access_log import AccessLog
from atomr_infer.serve.answers import (
    SSEResponse,
    error_response,
    form_model,
    model_card,
    only_deployment,
    relay,
    response_not_found,
)
from atomr_infer.serve.api_keys import ApiKey, ApiKeyError, KeyFile, may_use_as_asked
from atomr_infer.serve.body import MAX_BODY_BYTES, as_utf8, parse_json, read_body
from atomr_infer.serve.catalog import adapter_card, answering, health_report, model_list
from atomr_infer.serve.cors import Cors
from atomr_infer.serve.errors import ManagerRecovering, ManagerUnreachable
from atomr_infer.serve.listener import HttpListener, direct_posts, listen
from atomr_infer.serve.rate_limit import Budget, IngressLimits
from atomr_infer.serve.request_ids import with_request_ids
from atomr_infer.serve.routes import BY_KEY, Via, paths
from atomr_infer.serve.table_cache import TableCache
from atomr_infer.serve.usage import body_tokens, prompt_estimate, refuse_uncounted, without_usage
from atomr_infer.serving_process import tune_serving_process
from atomr_infer.status import DeploymentStatus
from atomr_infer.wire import HttpRequest, RequestKind, RoutingFacts

log = get_logger(__name__)
MAX_ONGOING_REQUESTS = 1024  # Serve's, for handle calls; HTTP comes through the listener, uncapped
MANAGER_CALL_TIMEOUT_S = 5.0
GRACEFUL_STOP_S = 10.0  # within Serve's graceful_shutdown_timeout_s (20 s by default)
# Routes anyone may call when the API has keys (as with `vllm serve --api-key`): no model runs.
OPEN_PATHS = frozenset({"/health", "/tokenize", "/detokenize"})

api = FastAPI(title="atomr-infer OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)

# Set per connection by each server; never forwarded.
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "host", "keep-alive"})
_NOT_FORWARDED = _HOP_HEADERS | {"authorization", "x-api-key"}  # the API key stays at the ingress
# (the body, the request) -> the request's routing facts and its parsed JSON body (None if not JSON)
FactsReader = Callable[[bytes, Request], Awaitable[tuple[RoutingFacts, Any]]]


async def not_served(request: Request) -> Response:
    """A route of vLLM's server that atomr's API does not route (serve/routes.py): 404 saying why."""
    route = BY_KEY[f"{request.method} {request.scope['route'].path}"]
    message = f"{route.key} is not served by atomr's API: {route.why}"
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "route_not_served"}}
    return JSONResponse(body, status_code=404)


for _route in (r for r in BY_KEY.values() if r.via in (Via.OPERATOR, Via.NOT_SERVED)):
    api.add_api_route(_route.path, not_served, methods=[_route.method], include_in_schema=False)


def _aliases(table: Any, name: str) -> tuple[str, ...]:
    """The aliases (``serving.openai.served_model_name``) of deployment ``name`` in ``table``."""
    route = table.deployments.get(name)
    return route.aliases if route is not None else ()


# Serve pickles the route handlers when the decorators run: everything they use is defined above.
@serve.deployment(
    name="openai-ingress",
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=MAX_ONGOING_REQUESTS,
)
@serve.ingress(api)
class OpenAIIngress:
    def __init__(
        self, replica_wait_s: float = 30.0, max_body_bytes: int = MAX_BODY_BYTES, api_keys_path: str | None = None,
        listen_on: tuple[str, int] | None = None, cors: Cors | None = None, keep_alive_s: int = 5,
        request_id_headers: bool = False,
    ) -> None:
        """``listen_on``: the API's ``(host, port)``, served by this replica itself (serve/listener.py),
        with ``cors`` (serve/cors.py; vLLM's defaults when None) around every route, an idle
        connection kept open ``keep_alive_s``, and ``X-Request-Id`` on every answer if ``request_id_headers``."""
        heavy_imports.watch("ingress")  # it must load neither torch nor vLLM (heavy_imports.py)
        self._max_body_bytes = max_body_bytes
        self._keys = KeyFile(api_keys_path, watch=True) if api_keys_path else None
        self._limits = IngressLimits()
        self._access = AccessLog(lambda name: self._router.table.knows(name))
        self._tables = TableCache()
        self._router = Router(
            self._tables.get, wait_for_replica_s=replica_wait_s, refresh_s=0.0,
            demand=lambda *report: self._tables.cached_manager().report_demand.remote(*report),
            fresh_source=self._tables.fetch, peek=self._tables.peek,
        )
        self._listener = None
        if listen_on is not None:  # bound here, so that a taken port fails the replica at once
            # Model requests skip the app's routing: they are most of what it would route.
            app = direct_posts(api, paths(Via.BODY), self.routed_by_body, error_response)
            app = with_request_ids((cors or Cors()).wrap(app), request_id_headers)  # outside CORS, as vLLM's
            self._listener = HttpListener(app, listen(*listen_on), keep_alive_s)
            # The routes find this instance through Serve's replica context, set after __init__.
            self._listener.start(ready=lambda: serve.get_replica_context().servable_object is not None)
        tune_serving_process()  # this process streams every response (serving_process.py)

    async def __del__(self) -> None:
        """Serve's graceful stop: stop accepting, let open requests finish (those still open at
        the grace are cancelled, which aborts them in the replicas), then close the router's
        channels to the replicas and stop."""
        if self._keys is not None:
            self._keys.stop()
        if self._listener is not None:
            await self._listener.stop(GRACEFUL_STOP_S)
        await self._router.aclose()
        with contextlib.suppress(RuntimeError):  # the loop may be closed already
            self._tables.stop()

    # -- model requests: routed by `model`, answered by vLLM's server in the replica ----------

    async def routed_by_body(self, request: Request) -> Response:
        return await self._forward(request, self._body_facts)

    async def routed_by_form(self, request: Request) -> Response:
        return await self._forward(request, self._form_facts)

    async def stored_response(self, response_id: str, request: Request) -> Response:
        """Retrieve or cancel a stored response, on the replica that holds it."""
        try:
            self._authenticate(request)  # 401 before anything is said about the id
        except AtomrError as exc:
            return self._logged(error_response(exc, request.url.path), None, "-", time.perf_counter())
        where = response_ids.home(response_id)
        if where is None or not await self._deployed(where.deployment):  # no replica can hold it
            return response_not_found(response_id)

        async def facts(raw: bytes, request: Request) -> tuple[RoutingFacts, Any]:
            # STORED: no engine step (no limit, no tokens charged); a retrieved stream's error
            # comes as the Responses API's error event
            return RoutingFacts(where.deployment, RequestKind.STORED, response_id=response_id), None

        return await self._forward(request, facts)

    # One handler per way of routing, on every path routed that way (serve/routes.py).
    for _path in paths(Via.BODY):
        api.post(_path)(routed_by_body)
    for _path in paths(Via.FORM):
        api.post(_path)(routed_by_form)
    api.get("/v1/responses/{response_id}")(stored_response)
    api.post("/v1/responses/{response_id}/cancel")(stored_response)
    del _path

    async def _deployed(self, name: str) -> bool:
        """Whether ``name`` is deployed, as far as the routing table (refreshed) says; True when
        the table cannot be had (routing then says why)."""
        try:
            table = await self._router.refresh(force=self._router.table.find(name) is None)
        except Exception:  # noqa: BLE001 - no table: let the routing that follows report it
            return True
        return table.find(name) is not None

    async def _body_facts(self, raw: bytes, request: Request) -> tuple[RoutingFacts, Any]:
        data = parse_json(raw)  # the one parse of the body on this side of the replica
        unnamed = isinstance(data, dict) and data.get("model") in (None, "")  # vLLM's server takes its one model
        return RoutingFacts.of(request.url.path, data, await self._only_deployment(request) if unnamed else None), data

    async def _form_facts(self, raw: bytes, request: Request) -> tuple[RoutingFacts, Any]:
        model = await form_model(raw, request.headers.get("content-type", ""))
        return RoutingFacts(model or await self._only_deployment(request), RequestKind.OTHER), None

    async def _only_deployment(self, request: Request) -> str:  # (the key: authenticated already)
        return only_deployment(await self._fresh_table(), self._authenticate(request))

    async def _forward(self, request: Request, read_facts: FactsReader) -> Response:
        """Route by the request's deployment and return the replica's answer (vLLM's) unchanged.

        Only ``model`` (and what routing needs) is read here; vLLM validates the rest, once, in
        the replica. Errors of our own (the body, routing, capacity) keep the API's error shape."""
        started, key, model, path = time.perf_counter(), None, "-", request.url.path
        try:
            key = self._authenticate(request)
            raw = await read_body(request.stream(), request.headers.get("content-length"), self._max_body_bytes)
            facts, data = await read_facts(raw, request)
            facts.wakes = key is not None or self._has_valid_key(request)  # no key: an open path's caller starts no GPU
            raw = raw if data is None else as_utf8(raw)
            # Keys are checked against the names routing goes by: the newest table this ingress
            # has (an adapter or alias just applied; one moved between deployments), else the manager's.
            table = await self._fresh_table()
            if not table.knows(facts.deployment) and key is not None and key.deployments is not None:
                table = await self._fresh_table(force=True)  # (a key that may use any name needs none)
            model = self._canonical(facts.deployment, table)
            if facts.kind is not RequestKind.STORED or not self._by_any_name(key, model):
                self._authorize(key, model, facts.deployment)
            # What runs no engine step spends no budget: a caller with no key (tokenizing is open)
            # would spend the deployment's requests_per_minute, and a poll of a background response one.
            runs = facts.kind.runs_engine  # else it uses no tokens: a stored response's are its creator's
            limit_headers, token_budgets = await self._admit(key, table.find(model)) if runs else ({}, [])
            if token_budgets:
                refuse_uncounted(data, facts)
        except AtomrError as exc:
            return self._refused(exc, path, key, model, started)
        name = key.name if key is not None else None
        # A token budget is charged the usage the response reports: ask a stream for it, and
        # take it out again if the client did not ask.
        hide_usage = bool(token_budgets) and not facts.usage_wanted and isinstance(data, dict)
        if hide_usage:  # (continuous usage, which vLLM gives only with include_usage, stays off)
            options = {**(data.get("stream_options") or {}), "include_usage": True, "continuous_usage_stats": False}
            raw = json.dumps({**data, "stream_options": options}).encode()
        target = path + (f"?{request.url.query}" if request.url.query else "")
        headers = tuple((k, v) for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED)
        items = self._router.stream(facts, HttpRequest(request.method, target, headers, raw))
        try:
            head = await anext(items)  # after routing and vLLM's validation: its status is known
        except Exception as exc:  # noqa: BLE001 - routing and replica errors become the API's errors
            await items.aclose()
            return self._refused(exc, path, key, model, started)
        except BaseException:
            await items.aclose()
            raise
        out_headers = {k: v for k, v in head.headers if k.lower() not in _HOP_HEADERS} | limit_headers
        if out_headers.get("content-type", "").startswith("text/event-stream"):
            relayed = self._access.stream(
                relay(items, facts.kind), name, model, head.status, started,
                lambda n: self._limits.charge(token_budgets, n), runs, lambda: prompt_estimate(raw),
                bool(token_budgets),
            )
            return SSEResponse(
                without_usage(relayed) if hide_usage else relayed, status_code=head.status, headers=out_headers
            )
        try:
            async with contextlib.aclosing(items):  # a cancelled task closes it: abort in the engine
                body = b"".join([chunk async for chunk in items])
        except Exception as exc:  # noqa: BLE001 - every failure becomes an error body
            return self._refused(exc, path, key, model, started)
        tokens = body_tokens(body, out_headers, head.status) if runs else None
        self._limits.charge(token_budgets, tokens)
        self._access.done(name, model, head.status, tokens, started)
        return Response(body, status_code=head.status, headers=out_headers)

    def _refused(self, exc: BaseException, path: str, key: ApiKey | None, model: str, started: float) -> Response:
        """``exc`` as the API's error, logged. An unknown name lists neither the deployments nor a
        deployment's adapters, nor says why an adapter failed (the server's paths), to a caller
        without a key where the API has keys (tokenizing is open to them)."""
        if isinstance(exc, DeploymentNotFound) and self._keys is not None and key is None:
            exc = exc.unlisted()
        return self._logged(error_response(exc, path), key, model, started)

    def _logged(self, response: Response, key: ApiKey | None, model: str, started: float) -> Response:
        self._access.done(key.name if key is not None else None, model, response.status_code, None, started)
        return response

    def _authenticate(self, request: Request) -> ApiKey | None:
        """The request's API key (None when the API has no keys); ``ApiKeyError`` (401) if it has none valid."""
        if self._keys is None or request.url.path in OPEN_PATHS:
            return None
        return self._keys.ring().authenticate(request.headers.get("authorization"), request.headers.get("x-api-key"))

    async def _admit(self, key: ApiKey | None, route: Any) -> tuple[dict[str, str], list[Budget]]:
        """Under the key's and the deployment's (``route``'s) rate limits (budgets shared by every
        ingress replica): the rate-limit headers and the token budgets to charge, or ``RateLimited``."""
        return await self._limits.admit(
            key.name if key is not None else None,
            (key.requests_per_minute, key.tokens_per_minute) if key is not None else (None, None),
            route.name if route is not None else None,
            (route.requests_per_minute, route.tokens_per_minute) if route is not None else (None, None),
        )

    def _canonical(self, model: str, table: Any = None) -> str:
        """``model`` as keys and logs name it: an alias (``served_model_name``) becomes its
        deployment's name, an adapter ``"<deployment>:<adapter>"`` (also named by its bare name)."""
        dep, adapter = (table or self._router.table).resolve(model)
        if dep is None:
            return model
        return dep.name if adapter is None else f"{dep.name}:{adapter}"

    @staticmethod
    def _authorize(key: ApiKey | None, model: str, asked: str | None = None) -> None:
        """403 unless the key may use ``model`` (canonical) or the name the request gave (``asked``)."""
        if key is not None and not key.may_use(model) and not (asked and may_use_as_asked(key, asked, model)):
            log.info("api_key_refused", key=key.name, deployment=model)
            raise ApiKeyError(403, f"the API key {key.name!r} may not use deployment {model!r}", "model_not_allowed")

    def _by_any_name(self, key: ApiKey | None, deployment: str) -> bool:
        """Whether ``key`` may use ``deployment`` by any of its names (an alias, an adapter): a
        stored response's id names only the deployment, and a key that made it through an alias
        may retrieve and cancel it (its uuid is the secret, as on ``vllm serve``)."""
        names = {deployment, *_aliases(self._router.table, deployment)}
        return key is None or key.deployments is None or any(
            e in names or e.partition(":")[0] in names for e in key.deployments)

    # -- models and health -------------------------------------------------------------------

    async def _list(self) -> list[DeploymentStatus]:
        return await (await self._tables.manager()).list.remote()

    async def _deployments(self) -> list[DeploymentStatus]:
        try:
            statuses = await asyncio.wait_for(self._list(), MANAGER_CALL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - not started, restarting, recovering, or timed out
            if isinstance(cause := unwrap(exc), AtomrError) and cause.retryable:  # NotRecoveredYet: it answers
                raise ManagerRecovering(one_line(cause)) from None
            self._tables.forget_manager()
            raise ManagerUnreachable(f"{type(exc).__name__}: {exc}") from None
        return [s for s in statuses if not s.removing]

    @api.get("/v1/models")
    async def list_models(self, request: Request) -> Response:
        try:
            key = self._authenticate(request)
            deployments = await self._deployments()
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        table = await self._fresh_table()
        return JSONResponse(model_list(deployments, lambda name: _aliases(table, name), key))

    @api.get("/v1/models/{name:path}")
    async def get_model(self, name: str, request: Request) -> Response:
        """The card of a deployment, one of its aliases or one of its loaded adapters."""
        try:
            key = self._authenticate(request)
            table = await self._fresh_table()
            self._authorize(key, self._canonical(name, table), name)
            deployments = {d.name: d for d in await self._deployments()}
            dep, adapter = table.resolve(name)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        status = deployments.get(dep.name if dep is not None else name)
        if status is None:
            return error_response(DeploymentNotFound(name, sorted(deployments), table.adapter_of(name)))
        if not answering(status):  # one scaled to zero answers: a request starts a replica
            return error_response(NoReadyReplica(status.name))
        if adapter is None:
            return JSONResponse(model_card(status, name))
        card = adapter_card(status, adapter, name)
        if card is None:
            return error_response(DeploymentNotFound(name, sorted(deployments)))
        return JSONResponse(card)

    async def _fresh_table(self, force: bool = False) -> Any:
        """The routing table, refreshed if the manager answers (else the one this ingress has:
        the routing that follows says why there is none)."""
        try:
            return await self._router.refresh(force)
        except Exception:  # noqa: BLE001
            return self._router.table

    @api.get("/health")
    async def health(self, request: Request) -> Response:
        """200 when the manager answers and every deployment answers requests, else 503 saying
        which; where the API has keys, which only to a caller with a valid key: the route is open,
        and a caller without one is told no deployment's name (as by ``_refused``), only the status."""
        try:
            body, status = health_report(await self._deployments())
        except Exception as exc:  # noqa: BLE001
            body, status = {"status": "unavailable", "manager": str(exc), "deployments": {}}, 503
        return JSONResponse(body if self._has_valid_key(request) else {"status": body["status"]}, status_code=status)

    def _has_valid_key(self, request: Request) -> bool:
        """Whether the caller of an open route has a valid key, or the API has none."""
        if self._keys is None:
            return True
        try:
            self._keys.ring().authenticate(request.headers.get("authorization"), request.headers.get("x-api-key"))
        except ApiKeyError:
            return False
        return True
