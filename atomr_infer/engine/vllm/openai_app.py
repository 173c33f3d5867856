"""vLLM's own OpenAI server, in the replica: the app ``vllm serve`` runs, called in process.

The replica builds vLLM's FastAPI app (``build_app``) and its serving state
(``init_app_state``) over ``StepLoopEngineClient``, with the arguments ``vllm serve`` would
parse for this deployment (so every default is vLLM's). Each HTTP request that the ingress
(or a ``Client``) forwards is run through that app as an ASGI call: the caller gets vLLM's
status, headers and body bytes unchanged, streamed as the app sends them. Our ingress only
routes by ``model``. A plain chat or completions request skips the framework and calls the
serving object as the route would, with the same answer at half the cost (direct_routes.py).

A consumer that leaves (the ingress cancelled the Ray generator) is told to the app as the
client's disconnect, which is how vLLM's handlers stop; a direct call is cancelled. Either
closes the engine client's stream, which aborts the request in the engine within one step.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from argparse import Namespace
from collections.abc import Callable
from typing import Any

from atomr_infer.engine.vllm.direct_routes import DirectRoutes
from atomr_infer.engine.vllm.response_store import configure_response_store
from atomr_infer.errors import SpecError, SpecProblem
from atomr_infer.spec import Deployment
from atomr_infer.wire import HttpHead, HttpRequest


def serve_args(deployment: Deployment, model_path: str) -> Namespace:
    """``vllm serve``'s parsed arguments for this deployment (its name is the served model name)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = ["--model", model_path, *server_flags(deployment)]
    said = io.StringIO()
    try:  # argparse says what it refused on stderr, then exits
        with contextlib.redirect_stderr(said):
            args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        validate_parsed_serve_args(args)
    except (SystemExit, ValueError, TypeError) as exc:
        lines = said.getvalue().strip().splitlines() or [str(exc)]
        reason = lines[-1].split("error: ", 1)[-1]  # argparse's "prog: error: ..."
        raise SpecError([SpecProblem(deployment.name, "serving.openai.server_args",
                                     f"vLLM's server refuses them: {reason}")]) from None
    return args


def server_flags(deployment: Deployment) -> list[str]:
    """``vllm serve``'s server flags for the deployment's ``serving.openai`` (engine settings,
    the generation config and the reasoning parser among them, go to the engine itself)."""
    o = deployment.serving.openai
    flags = ["--served-model-name", deployment.name, *o.served_model_name]
    if o.chat_template is not None:
        flags += ["--chat-template", o.chat_template]
    if o.tool_call_parser is not None:
        flags += ["--tool-call-parser", o.tool_call_parser]
    if o.enable_auto_tool_choice:
        flags.append("--enable-auto-tool-choice")
    if o.reasoning_parser is not None:
        flags += ["--reasoning-parser", o.reasoning_parser]
    for key, value in o.server_args.items():  # as `vllm serve` takes them on its command line
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, list):
            flags += [flag, *(json.dumps(v) if isinstance(v, dict | list) else str(v) for v in value)]
        else:  # one argument, as --flag=value: a value starting with "-" is no flag
            flags.append(f"{flag}={json.dumps(value) if isinstance(value, dict) else value}")
    return flags


APP_WIND_DOWN_S = 30.0
Put = Callable[["HttpHead | bytes"], None]


class OpenAIApp:
    def __init__(self, app: Any) -> None:
        self._app = app
        # "METHOD /path" of each route the app has: which of vLLM's endpoints this model serves.
        self.models = getattr(app.state, "openai_serving_models", None)  # names LoRA adapters for requests
        self.routes = tuple(sorted(
            f"{method} {route.path}" for route in app.routes for method in getattr(route, "methods", None) or ()
        ))
        self._direct = DirectRoutes(app, HttpHead)
        self._responses = getattr(app.state, "openai_serving_responses", None)

    @property
    def background(self) -> int:
        """Background responses generating (answered ``queued``; a streamed one's request may
        still be open, streaming its events: the replica's channels count it once)."""
        return len(getattr(self._responses, "background_tasks", None) or ())

    @classmethod
    async def build(cls, client: Any, deployment: Deployment, model_path: str) -> OpenAIApp:
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app

        args = serve_args(deployment, model_path)
        tasks = await client.get_supported_tasks()
        app = build_app(args, tasks, client.model_config)
        await init_app_state(client, app.state, args, tasks)
        configure_response_store(app.state, deployment.serving.openai.response_store)
        return cls(app)

    async def run(self, request: HttpRequest, put: Put) -> None:
        """Run one request through the app, handing ``put`` its head, then each body piece as
        the app sends it (no queue in between: the caller batches). Returns when the response
        is complete. Cancelled, it tells the app the client left and lets it wind down."""
        route = self._direct.route_of(request.method, request.path, request.headers)
        if route is not None:
            scope = {**_scope(request), "app": self._app}
            if await self._direct.run(route, request.body, scope, put):
                return
        loop = asyncio.get_running_loop()
        gone = asyncio.Event()  # the consumer left: the app hears it as a client disconnect
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if gone.is_set():
                return
            if message["type"] == "http.response.start":
                heads = tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", ()))
                put(HttpHead(message["status"], heads))
            elif message["type"] == "http.response.body" and message.get("body"):
                put(message["body"])

        task = loop.create_task(self._app(_scope(request), receive, send))
        try:
            await asyncio.shield(task)
        finally:
            if not task.done():
                # vLLM's handlers run in a task of their own and stop on a disconnect message
                # (its with_cancellation, Starlette's StreamingResponse), not on cancellation of
                # the caller: say the client left, and let the app wind down (which aborts the
                # request in the engine). A last resort if it does not.
                gone.set()
                loop.call_later(APP_WIND_DOWN_S, task.cancel)


def _scope(request: HttpRequest) -> dict[str, Any]:
    raw_path, _, query = request.path.partition("?")
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": request.method,
        "scheme": "http",
        "path": raw_path,
        "raw_path": raw_path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
        "state": {},
    }
