"""Start and stop the OpenAI-compatible HTTP API on a Ray cluster.

``run_server`` connects to Ray (starting a local head if none runs), makes sure the manager
exists, starts Serve's HTTP proxy on ``host:port`` unless Serve already runs there, and deploys
the ingress as the Serve application ``atomr-openai``. ``stop_server`` deletes the application
and, if ``run_server`` started Serve and nothing else runs on it, shuts Serve down too.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from atomr_infer.errors import AtomrError
from atomr_infer.log import get_logger

log = get_logger(__name__)
APP_NAME = "atomr-openai"


@dataclass(frozen=True)
class Server:
    host: str
    port: int
    started_serve: bool  # whether run_server started Serve (and so stop_server may shut it down)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """What to give ``openai.OpenAI(base_url=...)``."""
        return f"{self.url}/v1"


def _serve_address() -> tuple[str, int] | None:
    """Where this cluster's Serve proxy listens, or None when Serve is not running."""
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return None
    return client.http_config.host, client.http_config.port


def _start_serve(host: str, port: int) -> bool:
    """Start Serve's proxy on ``host:port``; False if Serve already runs there (an error elsewhere)."""
    from ray import serve

    running = _serve_address()
    if running is None:
        serve.start(http_options={"host": host, "port": port})
        return True
    if running != (host, port):
        at_host, at_port = running
        raise AtomrError(
            f"Ray Serve already runs on this cluster with its HTTP proxy on {at_host}:{at_port}, "
            f"not {host}:{port} (hint: use --host {at_host} --port {at_port}, "
            "or stop Serve with `serve shutdown`)"
        )
    return False


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
) -> Server:
    """Deploy the API and return once it is running (``blocking``) or once it is submitted.

    ``replica_wait_s``: how long a request waits for a ready replica before 503.
    ``num_replicas``: ingress replicas (each holds its own routing-table cache).
    ``max_body_bytes``: larger request bodies get 413 before routing (default 16 MiB).
    ``api_keys_path``: an API keys file (serve/api_keys.py), checked here first; the ingress
    replicas read it, and re-read it when it changes, from this path (on their node).
    """
    from ray import serve

    from atomr_infer.control.client import manager_handle
    from atomr_infer.serve.api_keys import load_key_file
    from atomr_infer.serve.app import OpenAIIngress

    if api_keys_path is not None:
        api_keys_path = os.path.abspath(api_keys_path)
        load_key_file(api_keys_path)  # a bad file fails here, in one line, before anything starts
    manager_handle(address)  # connect, and create the manager if it is not running yet
    started = _start_serve(host, port)
    limits = {"max_body_bytes": max_body_bytes} if max_body_bytes is not None else {}
    app = OpenAIIngress.options(num_replicas=num_replicas).bind(
        replica_wait_s=replica_wait_s, api_keys_path=api_keys_path, **limits
    )
    try:
        serve._run(app, name=APP_NAME, route_prefix="/", _blocking=blocking)
    except BaseException:
        if started:
            serve.shutdown()
        raise
    server = Server(host, port, started)
    log.info("openai_api_running", url=server.base_url)
    return server


def running_server() -> Server | None:
    """The API this cluster serves now (its Serve proxy's address), or None."""
    from ray import serve

    address = _serve_address()
    if address is None or APP_NAME not in serve.status().applications:
        return None
    return Server(*address, started_serve=False)


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
    _stop_rate_limiter()
    if shutdown_serve and not serve.status().applications:
        serve.shutdown()
    log.info("openai_api_stopped")
