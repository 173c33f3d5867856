"""``atomr serve``: the OpenAI-compatible HTTP API, in the foreground until Ctrl-C."""

from __future__ import annotations

import signal
import threading

import typer

from atomr_infer.cli import common
from atomr_infer.cli.app import EXIT_OK, app, fail, out


@app.command("serve")
def serve_command(
    host: str = typer.Option("127.0.0.1", "--host", help="Address the API listens on."),
    port: int = typer.Option(8000, "--port", help="Port the API listens on."),
    address: str | None = typer.Option(None, "--address", help="Ray cluster address (default: RAY_ADDRESS or local)."),
    replica_wait: float = typer.Option(
        30.0, "--replica-wait", min=0.0, help="Seconds a request waits for a ready replica before 503."
    ),
    api_keys: str | None = typer.Option(
        None, "--api-keys", help="YAML file of API keys: every /v1/* request then needs one (re-read when it changes)."
    ),
    max_body_mb: float | None = typer.Option(
        None, "--max-body-mb", min=0.001, help="Larger request bodies get 413 before they are routed (default 16)."
    ),
) -> None:
    """Serve every deployment over an OpenAI-compatible HTTP API (model = deployment name)."""
    from atomr_infer.serve import run_server, stop_server

    common.quiet_serve_logs()
    try:
        server = run_server(
            host, port, address, blocking=True, replica_wait_s=replica_wait, api_keys_path=api_keys,
            max_body_bytes=int(max_body_mb * 1024 * 1024) if max_body_mb else None,
        )
    except Exception as exc:  # noqa: BLE001 - one line, the CLI's exit codes
        fail(exc)
    routes = "/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models, /tokenize, /detokenize"
    out.print(f"OpenAI-compatible API at {server.url} (routes {routes})")
    key_hint = '"<a key from the file>"' if api_keys else '"unused"'
    out.print(f'openai client: OpenAI(base_url="{server.base_url}", api_key={key_hint})')
    out.print("Ctrl-C to stop.")
    stop = threading.Event()
    # Handlers for both, as uvicorn has: Ctrl-C stops the API even when the shell that
    # started this process in the background left SIGINT ignored.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(3600):
        pass
    out.print("stopping…")
    try:
        stop_server(server)
    except Exception as exc:  # noqa: BLE001
        fail(exc)
    raise typer.Exit(EXIT_OK)
