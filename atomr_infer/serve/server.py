"""Start and stop the OpenAI-compatible HTTP API on a Ray cluster.

``run_server`` connects to Ray (starting a local head if none runs), makes sure the manager
exists, starts Serve without its HTTP proxy unless Serve already runs, and deploys the
ingress as the Serve application ``atomr-openai``: its replicas, pinned to this node, serve
``host:port`` themselves (serve/listener.py). The address is kept in Ray's internal KV, so
``running_server`` finds it from any process. ``stop_server`` deletes the application and,
if ``run_server`` started Serve and nothing else runs on it, shuts Serve down too. A foreground
``atomr serve`` watches for a stop it did not make (``cluster_gone``, ``stopped_elsewhere``) and
says it holds the API (``hold_foreground``), so that ``stop_server`` elsewhere waits for it to go.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from atomr_infer.errors import AtomrError
from atomr_infer.log import get_logger
from atomr_infer.serve.cors import Cors

log = get_logger(__name__)
APP_NAME = "atomr-openai"


@dataclass(frozen=True)
class Server:
    host: str
    port: int
    # Whether atomr started Serve for this API (so stop_server may shut it down): recorded with it,
    # so that an update in place (which finds Serve running) keeps it.
    started_serve: bool
    # What it runs with, as run_server recorded it: api_keys_path, max_body_bytes, cors (a dict), request_id_headers.
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What to give ``openai.OpenAI(base_url=...)``."""
        return f"{self.url}/v1"


def api_settings(
    running: Server | None, host: str, port: int, api_keys_path: str | None, max_body_bytes: int | None,
    cors: Cors | None, request_id_headers: bool | None = None,
) -> dict[str, Any]:
    """run_server's settings from the CLI's flags: each given, else, for the API ``running`` at
    ``host:port`` (updated in place), the one it runs with (adding CORS to an API with keys must
    not drop its keys)."""
    was = running.settings if running is not None and (running.host, running.port) == (host, port) else {}
    recorded_cors = was.get("cors")
    return {
        "api_keys_path": api_keys_path if api_keys_path is not None else was.get("api_keys_path"),
        "max_body_bytes": max_body_bytes if max_body_bytes is not None else was.get("max_body_bytes"),
        "cors": cors if cors is not None or not recorded_cors else Cors(**{
            k: tuple(v) if isinstance(v, list) else v for k, v in recorded_cors.items()}),
        "request_id_headers": bool(was.get("request_id_headers")) if request_id_headers is None else request_id_headers,
    }


def _serve_running() -> bool:
    from ray.serve.context import _get_global_client

    return _get_global_client(raise_if_no_controller_running=False) is not None


def _start_serve() -> bool:
    """Start Serve with no HTTP proxy of its own; False if Serve already runs (its proxy, if any,
    is left alone: the API listens on an address of its own)."""
    from ray import serve
    from ray.serve.config import ProxyLocation

    if _serve_running():
        return False
    serve.start(proxy_location=ProxyLocation.Disabled)
    return True


def _record(server: Server | None) -> None:
    """Where the API listens and with what, for ``running_server`` in any process (None: it stopped)."""
    from ray.experimental import internal_kv

    from atomr_infer.cluster import NAMESPACE

    if server is None:
        internal_kv._internal_kv_del(APP_NAME, namespace=NAMESPACE)
    else:
        value = json.dumps({"host": server.host, "port": server.port, "started_serve": server.started_serve,
                            "settings": server.settings})
        internal_kv._internal_kv_put(APP_NAME, value, overwrite=True, namespace=NAMESPACE)


def _recorded() -> tuple[str, int] | None:
    value = _recorded_value()
    return None if value is None else (value["host"], int(value["port"]))


def _recorded_value() -> dict[str, Any] | None:
    from ray.experimental import internal_kv

    from atomr_infer.cluster import NAMESPACE

    raw = internal_kv._internal_kv_get(APP_NAME, namespace=NAMESPACE)
    return None if raw is None else json.loads(raw)


# `atomr serve` processes that run the API in the foreground: one key each (host:pid), whose
# value is when it last said so (each check renews it), so a process that died without letting
# go stops counting after FOREGROUND_STALE_S.
_FOREGROUND_PREFIX = f"{APP_NAME}:foreground:"
FOREGROUND_EXIT_S = 5.0  # how long a stop from elsewhere waits for those processes to leave
FOREGROUND_STALE_S = 10.0


def hold_foreground(held: bool) -> None:
    """Record that this process runs the API in the foreground (renewed by each call), or no
    longer does, so that ``stop_server`` in another process (``atomr down``) lets it see the stop
    and exit before the cluster goes away (it would then say the cluster failed)."""
    from ray.experimental import internal_kv

    from atomr_infer.cluster import NAMESPACE

    key = _foreground_key()
    if held:
        internal_kv._internal_kv_put(key, str(time.time()), overwrite=True, namespace=NAMESPACE)
    else:
        internal_kv._internal_kv_del(key, namespace=NAMESPACE)


def _foreground_key() -> str:
    return f"{_FOREGROUND_PREFIX}{socket.gethostname()}:{os.getpid()}"


def foreground_holders() -> list[str]:
    """The holds of foreground servers that renewed theirs within ``FOREGROUND_STALE_S``."""
    from ray.experimental import internal_kv

    from atomr_infer.cluster import NAMESPACE

    fresh = []
    for key in internal_kv._internal_kv_list(_FOREGROUND_PREFIX, namespace=NAMESPACE):
        said = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        if said is not None and time.time() - float(said) < FOREGROUND_STALE_S:
            fresh.append(key.decode())
    return fresh


def _wait_foreground_left(timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while foreground_holders() and time.monotonic() < deadline:
        time.sleep(0.1)


def _this_node() -> dict[str, float]:
    """Ray resources that pin an actor to this process's node (where ``host`` is an address)."""
    import ray

    return {f"node:{ray.util.get_node_ip_address()}": 0.001}


def run_server(
    host: str = "127.0.0.1",
    port: int = 8000,
    address: str | None = None,
    blocking: bool = True,
    *,
    replica_wait_s: float = 30.0,
    num_replicas: int = 1,
    api_keys_path: str | None = None,
    max_body_bytes: int | None = None,
    cors: Cors | None = None,
    request_id_headers: bool = False,
) -> Server:
    """Deploy the API and return once it is running (``blocking``) or once it is submitted.

    ``replica_wait_s``: how long a request waits for a ready replica before 503.
    ``num_replicas``: ingress replicas (each holds its own routing-table cache).
    ``max_body_bytes``: larger request bodies get 413 before routing (default 16 MiB).
    ``cors``: which web pages may call it (serve/cors.py; default: none, as ``vllm serve`` 0.32).
    ``request_id_headers``: every answer carries ``X-Request-Id`` (serve/request_ids.py; default off, as vLLM).
    ``api_keys_path``: an API keys file (serve/api_keys.py), checked here first; the ingress
    replicas read it, and re-read it when it changes, from this path (on their node).
    """
    from ray import serve

    from atomr_infer.cluster import connect
    from atomr_infer.control.client import manager_handle
    from atomr_infer.serve.api_keys import load_key_file
    from atomr_infer.serve.app import OpenAIIngress
    from atomr_infer.serve.listener import check_free, keep_alive_s

    if api_keys_path is not None:
        api_keys_path = os.path.abspath(api_keys_path)
        load_key_file(api_keys_path)  # a bad file fails here, in one line, before anything starts
    # This process's, as `vllm serve` reads it (the ingress replicas' environment is the cluster's)
    keep_alive = keep_alive_s()
    connect(address)
    current = running_server()
    if current is not None and (current.host, current.port) != (host, port):
        raise AtomrError(
            f"the OpenAI API already runs on this cluster at {current.host}:{current.port}, not {host}:{port} "
            f"(hint: use --host {current.host} --port {current.port}, or stop it first: `atomr down`)"
        )
    if current is None:
        check_free(host, port)  # else the ingress replicas would fail to start, and Serve retry them
    manager_handle(address)  # created if it is not running yet: after the checks, not left behind by them
    started_now = _start_serve()
    # An API updated in place keeps what its first start recorded: `atomr serve` over the API
    # `atomr up --serve` started finds Serve running, yet its stop must still shut Serve down.
    started = started_now or (current is not None and current.started_serve)
    limits: dict[str, object] = {"max_body_bytes": max_body_bytes} if max_body_bytes is not None else {}
    if cors is not None:
        limits["cors"] = cors
    app = OpenAIIngress.options(
        num_replicas=num_replicas, ray_actor_options={"num_cpus": 0, "resources": _this_node()}, **_surge(serve)
    ).bind(replica_wait_s=replica_wait_s, api_keys_path=api_keys_path, listen_on=(host, port),
           keep_alive_s=keep_alive, request_id_headers=request_id_headers, **limits)
    try:
        serve._run(app, name=APP_NAME, route_prefix=None, _blocking=blocking)
    except BaseException:
        if started_now:  # (not Serve the API running before runs on)
            _shutdown_serve()
        raise
    settings = {"api_keys_path": api_keys_path, "max_body_bytes": max_body_bytes,
                "cors": dataclasses.asdict(cors) if cors is not None else None,
                "request_id_headers": request_id_headers}
    server = Server(host, port, started, settings)
    _record(server)
    log.info("openai_api_running", url=server.base_url)
    return server


def _surge(serve: Any) -> dict[str, int]:
    """Serve's option that starts an update's new ingress replicas before it stops the old ones
    (Ray 2.60 and later). Every deploy restarts them, and Serve's default stops first: with one
    replica, nothing would listen on the port until its replacement bound it (connections refused
    for seconds; no retrying proxy is in front). Both bind it meanwhile (``SO_REUSEPORT``)."""
    return {"max_surge_percent": 100} if "max_surge_percent" in inspect.signature(serve.deployment).parameters else {}


def running_server() -> Server | None:
    """The API this cluster serves now (where it listens), or None."""
    from ray import serve

    value = _recorded_value()
    if value is None or not _serve_running() or APP_NAME not in serve.status().applications:
        return None
    return Server(value["host"], int(value["port"]), started_serve=bool(value.get("started_serve")),
                  settings=value.get("settings") or {})


@dataclass(frozen=True)
class Gone:
    """Why an API this process started is no longer served."""

    reason: str
    cluster_lost: bool  # the Ray cluster went away (a failure), not a stop asked for elsewhere


def cluster_gone() -> Gone | None:
    """Whether the Ray cluster this process joined is gone, by a TCP connect to its GCS: a Ray
    call to a GCS that is gone retries for a minute or more before it fails."""
    import ray

    from atomr_infer.local_ray import port_open

    try:
        gcs = ray.get_runtime_context().gcs_address
        host, port = gcs.rsplit(":", 1)
        target = host.strip("[]"), int(port)
    except Exception:  # noqa: BLE001 - no GCS address here (Ray Client): the API's record still tells
        return None
    if port_open(*target, timeout_s=2.0):
        return None
    return Gone(f"the Ray cluster at {gcs} is gone, and the API with it", cluster_lost=True)


def stopped_elsewhere(server: Server) -> Gone | None:
    """Whether the API ``server`` was stopped from another process (``atomr down``) or moved to
    another address. A Ray call: it can hang while the cluster goes away (``cluster_gone``)."""
    if _recorded() != (server.host, server.port):
        return Gone(f"the API at {server.url} was stopped from another process (`atomr down`)", cluster_lost=False)
    return None


def _stop_rate_limiter() -> None:
    """The API's shared rate-limit actor (serve/rate_limit.py) goes with it, if it was started."""
    import ray

    from atomr_infer.cluster import NAMESPACE
    from atomr_infer.serve.rate_limit import LIMITER_NAME

    with contextlib.suppress(ValueError):  # never started: no key had a limit
        ray.kill(ray.get_actor(LIMITER_NAME, namespace=NAMESPACE), no_restart=True)


def stop_server(server: Server | None = None, *, shutdown_serve: bool | None = None) -> None:
    """Delete the API application, then shut Serve down if it is now empty and ``shutdown_serve``
    (default: if ``server`` says ``run_server`` started Serve)."""
    from ray import serve

    if shutdown_serve is None:
        shutdown_serve = server is not None and server.started_serve
    serve.delete(APP_NAME)
    _record(None)
    _wait_foreground_left(FOREGROUND_EXIT_S)
    _stop_rate_limiter()
    if shutdown_serve and not serve.status().applications:
        _shutdown_serve()
    log.info("openai_api_stopped")


def _shutdown_serve() -> None:
    """``serve.shutdown()`` without the warning it leaves on the caller's stdout. Serve's
    controller answers its shutdown call by dying, and Serve's actor options retry the call, so
    Ray printed "(raylet) Task ServeController.graceful_shutdown failed. There are infinite
    retries remaining" on every Ctrl-C of `atomr serve`. The same call, not retried; then
    ``serve.shutdown()`` finds the controller gone and forgets it."""
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is not None:
        client.shutdown_cached_handles()
        with contextlib.suppress(ray.exceptions.RayActorError):
            ray.get(client._controller.graceful_shutdown.options(max_task_retries=0).remote(), timeout=30)
    serve.shutdown()
