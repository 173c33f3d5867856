"""``atomr serve``: the OpenAI-compatible HTTP API, in the foreground until Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from typing import TYPE_CHECKING, NoReturn

import typer

from atomr_infer.cli import common
from atomr_infer.cli.app import EXIT_FAILED, EXIT_OK, _escape, app, err, fail, out
from atomr_infer.errors import AtomrError, one_line

if TYPE_CHECKING:
    from atomr_infer.serve.server import Gone, Server


@app.command("serve")
def serve_command(
    host: str = typer.Option("127.0.0.1", "--host", help="Address the API listens on."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port the API listens on."),
    address: str | None = typer.Option(None, "--address", help="Ray cluster address (default: RAY_ADDRESS or local)."),
    replica_wait: float = typer.Option(
        30.0, "--replica-wait", min=0.0, help="Seconds a request waits for a ready replica before 503."
    ),
    api_keys: str | None = typer.Option(
        None, "--api-keys", help="YAML file of API keys: every /v1/* request then needs one (re-read when it changes)."
    ),
    max_body_mb: float | None = typer.Option(
        None, "--max-body-mb", min=0.001, max=common.MAX_BODY_MB,
        help="Larger request bodies get 413 before they are routed (default 16)."
    ),
    allowed_origins: str | None = common.cors_list_option("--allowed-origins"),
    allowed_methods: str | None = common.cors_list_option("--allowed-methods"),
    allowed_headers: str | None = common.cors_list_option("--allowed-headers"),
    allow_credentials: bool = common.allow_credentials_option(),
    enable_request_id_headers: bool | None = common.request_id_headers_option(),
) -> None:
    """Serve every deployment over an OpenAI-compatible HTTP API (model = deployment name)."""
    try:
        common.import_serve()
    except AtomrError as exc:
        fail(exc)
    from atomr_infer.serve import run_server, running_server, stop_server
    from atomr_infer.serve.server import api_settings, hold_foreground

    common.check_key_file(api_keys)
    common.check_listen_host(host)
    try:
        common.check_api_before_start(host, port, address)
        common.connect(address, start=True)  # says so when it starts a local head, as other commands do
        max_body_bytes = int(max_body_mb * 1024 * 1024) if max_body_mb else None
        cors = common.cors_of(allowed_origins, allowed_methods, allowed_headers, allow_credentials)
        # An API running there (`atomr up --serve` started it): what is not given stays as it runs.
        settings = api_settings(running_server(), host, port, api_keys, max_body_bytes, cors, enable_request_id_headers)
        server = run_server(host, port, address, blocking=True, replica_wait_s=replica_wait, **settings)
    except Exception as exc:  # noqa: BLE001 - one line, the CLI's exit codes
        fail(exc)
    routes = "chat, completions, Responses, Anthropic Messages, embeddings, pooling, score, rerank, audio"
    out.print(f"OpenAI-compatible API at {server.url} ({routes}: docs/http-api.md)", markup=False)
    key_hint = '"<a key from the file>"' if settings["api_keys_path"] else '"unused"'
    out.print(f'openai client: OpenAI(base_url="{server.base_url}", api_key={key_hint})')
    out.print("Ctrl-C to stop.")
    gone = _wait(server, stop_on_signals())
    if gone is not None:
        _exit_at_once(gone)
    out.print("stopping…")
    with contextlib.suppress(Exception):  # a hold left behind only makes `atomr down` wait
        hold_foreground(False)
    try:
        stop_server(server)
    except Exception as exc:  # noqa: BLE001
        fail(AtomrError(f"could not stop the API: {one_line(exc)}"))
    out.print(f"stopped the API at {server.url}", markup=False)
    raise typer.Exit(EXIT_OK)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stop:
    """Whether a stop signal came, set by its handler, waited for by the main thread: a byte in a
    pipe. A ``threading.Event`` set by a handler deadlocks when the signal lands while the main
    thread, in that Event's ``wait``, holds its lock (a handler runs on the main thread)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._set = False

    def set(self) -> None:
        self._set = True
        with contextlib.suppress(BlockingIOError):  # the pipe is full: it was set already
            os.write(self._write, b"\0")

    def wait(self, timeout_s: float) -> bool:
        """Whether it is set, once it is or after ``timeout_s``."""
        if not self._set:
            select.select([self._read], [], [], timeout_s)
        return self._set


def stop_on_signals() -> Stop:
    """A ``Stop`` set on SIGINT and SIGTERM, as uvicorn does (Ctrl-C stops the API even when the
    shell that started this process in the background left SIGINT ignored), and on SIGHUP: a
    closed terminal or a dropped ssh session killed the process and left the API running
    (unless ``nohup`` ignores it)."""
    stop = Stop()

    def on_signal(sig: int, frame: object) -> None:
        if sig == signal.SIGHUP:  # the terminal is gone: a line printed to it would fail the stop (EIO)
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in (1, 2):
                os.dup2(devnull, fd)
            os.close(devnull)
        stop.set()

    for sig in STOP_SIGNALS:
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue  # started under nohup: it is to outlive the terminal
        signal.signal(sig, on_signal)
    return stop


WATCH_PERIOD_S = 1.0  # how soon a stop from elsewhere is noticed
LOST_AFTER = 3  # checks in a row that find the GCS gone: a blip (or a GCS restart) is not a loss


def _wait(server: Server, stop: Stop) -> Gone | None:
    """Wait for Ctrl-C (None), or for the API to stop without this process: ``atomr down`` run
    elsewhere, or the cluster gone. Then say why, rather than serve nothing until killed.

    The API's record is read (and this process's hold renewed) in a thread of its own: those
    Ray calls hang when the cluster goes away meanwhile, and the cluster check (a TCP connect
    to the GCS) must still run."""
    from atomr_infer.serve.server import cluster_gone, hold_foreground, stopped_elsewhere

    found: list[Gone | None] = [None]  # the last check's answer

    def check() -> None:
        with contextlib.suppress(Exception):  # a Ray call that failed: the TCP check decides
            found[0] = stopped_elsewhere(server)
            if found[0] is None:
                hold_foreground(True)

    checker: threading.Thread | None = None
    lost = 0
    while found[0] is None:
        if checker is None or not checker.is_alive():  # at most one: a hung call is not repeated
            checker = threading.Thread(target=check, name="atomr-serve-watch", daemon=True)
            checker.start()
        stopped = stop.wait(WATCH_PERIOD_S)
        gone = cluster_gone()
        lost = lost + 1 if gone is not None else 0
        if stopped or lost >= LOST_AFTER:
            return gone  # on Ctrl-C too: stopping the API on a cluster that is gone would hang
    return found[0]


def _exit_at_once(gone: Gone) -> NoReturn:
    """Exit at once, skipping Ray's own shutdown at exit: with its GCS gone, that waits on
    reconnecting for a minute or more."""
    if gone.cluster_lost:
        err.print(f"[red]error:[/] {_escape(gone.reason)}", markup=True, emoji=False)
    else:
        from atomr_infer.serve.server import hold_foreground

        out.print(f"stopped: {gone.reason}", markup=False)
        # The stopping process waits for this, up to a limit; a Ray call can hang, so bounded.
        release = threading.Thread(target=lambda: hold_foreground(False), daemon=True)
        release.start()
        release.join(1.0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_FAILED if gone.cluster_lost else EXIT_OK)
