"""``atomr up`` and ``atomr down``: the local cluster's lifecycle.

``up`` joins ``--address`` / ``RAY_ADDRESS`` or the local head (starting one, dashboard on,
if none is running), starts the manager, prints the dashboard URL, provisions Gemma when
this host can run it, and with ``--serve`` starts the OpenAI-compatible API on the cluster
(it runs there, like the manager, after ``up`` returns). ``down`` deletes the API, removes
every deployment, waits for the replicas to stop, stops the manager, and stops Ray only if
``atomr`` started it (the marker file says so, and the head on that port is older than the
marker) — by its own processes, never ``ray stop``, which would take every other Ray on the
machine with it. A manager that restarts, or has not read its stored state back yet, is waited
for (up to ``--timeout``); one that still cannot list its deployments then stops nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from atomr_infer.cli import common
from atomr_infer.cli.app import EXIT_OK, app, err, fail, out, usage_error
from atomr_infer.errors import AtomrError, NoCluster, SettingError, one_line

if TYPE_CHECKING:
    from atomr_infer.control.client import ControlPlane
    from atomr_infer.serve.cors import Cors

# The flags of `up` that only the HTTP API (--serve) reads.
API_PARAMETERS = ("host", "port", "api_keys", "max_body_mb", "allowed_origins", "allowed_methods", "allowed_headers",
                  "allow_credentials", "enable_request_id_headers")
RETRY_S = 1.0  # how often `down` asks again a manager that restarts or recovers its state
UP_LIST_WAIT_S = 10.0  # how long `up` waits for a restarted manager to list its deployments
T = TypeVar("T")


def _line(label: str, text: str) -> None:
    out.print(f"{label:<10} {text}", markup=False, emoji=False, highlight=False)


@app.command("up")
def up_command(
    ctx: typer.Context,
    address: str | None = common.address_option(),
    no_gemma: bool = typer.Option(False, "--no-gemma", help="Do not provision Gemma, even on a host that can run it."),
    serve: bool = typer.Option(False, "--serve", help="Also start the OpenAI HTTP API (`atomr down` stops it)."),
    host: str = typer.Option("127.0.0.1", "--host", help="With --serve: address the API listens on."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="With --serve: port the API listens on."),
    api_keys: str | None = typer.Option(
        None, "--api-keys", help="With --serve: YAML file of API keys every /v1/* request then needs."
    ),
    max_body_mb: float | None = typer.Option(
        None, "--max-body-mb", min=0.001, max=common.MAX_BODY_MB,
        help="With --serve: larger request bodies get 413 (default 16)."
    ),
    allowed_origins: str | None = common.cors_list_option("--allowed-origins", "With --serve: "),
    allowed_methods: str | None = common.cors_list_option("--allowed-methods", "With --serve: "),
    allowed_headers: str | None = common.cors_list_option("--allowed-headers", "With --serve: "),
    allow_credentials: bool = common.allow_credentials_option("With --serve: "),
    enable_request_id_headers: bool | None = common.request_id_headers_option("With --serve: "),
) -> None:
    """Start (or join) Ray and the atomr manager; print the dashboard URL."""
    # (by the source's name: typer runs a copy of click of its own)
    api_flags = [f"--{name.replace('_', '-')}" for name in API_PARAMETERS
                 if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"]
    if api_flags and not serve:  # said, not ignored
        usage_error(f"{', '.join(api_flags)}: for the HTTP API, which only --serve starts (or use `atomr serve`)")
    from atomr_infer import cluster

    if serve:
        common.check_key_file(api_keys)
        common.check_listen_host(host)
        try:
            common.check_api_before_start(host, port, address)
        except AtomrError as exc:
            fail(exc)
    common.quiet_logs()
    cluster.use_local_auth_token()
    joining = cluster.target_address(address)
    if not joining:
        _line("Ray", f"starting a local head at {cluster.local_address()} …")
    try:
        control = common.control_plane(address, start=True, announce=False)
    except AtomrError as exc:
        fail(exc)
    deployments, recovering = _listing_if_recovered(control)
    if joining:
        _line("Ray", f"joined the cluster at {joining}")
    else:
        _line("Ray", f"started a local head at {cluster.local_address()} (`atomr down` stops it)")
    if deployments is None:
        _line("manager", f"atomr-manager running, recovering its deployments ({recovering})")
    else:
        count = len(deployments)
        _line("manager", f"atomr-manager running, {count} deployment{'s' if count != 1 else ''}")
    _line("dashboard", common.dashboard_url() or "not running")
    if serve:
        cors = common.cors_of(allowed_origins, allowed_methods, allowed_headers, allow_credentials)
        _start_api(host, port, api_keys, int(max_body_mb * 1024 * 1024) if max_body_mb else None, cors,
                   enable_request_id_headers)
    if deployments is None and not no_gemma:
        _line("gemma", "skipped: the manager is recovering its deployments (`atomr up` again to provision it)")
    code = EXIT_OK if no_gemma or deployments is None else _provision_gemma(control)
    if deployments == []:
        _line("next", "atomr deploy deployments/smollm2.yaml")
    raise typer.Exit(code)


def _listing_if_recovered(control: ControlPlane) -> tuple[list[Any] | None, str]:
    """The manager's deployments, asked again for a while; (None, why) where a restarted manager
    still reads its stored state: ``up`` goes on (the API serves the deployments it knows)."""
    try:
        return _retrying(control.list, time.monotonic() + UP_LIST_WAIT_S), ""
    except AtomrError as exc:
        if not exc.retryable:
            fail(exc)
        return None, one_line(exc)


def _start_api(
    host: str, port: int, api_keys: str | None = None, max_body_bytes: int | None = None, cors: Cors | None = None,
    request_id_headers: bool | None = None,
) -> None:
    """The API on ``host:port``: started, or reported when it already runs there (updated in
    place when ``api_keys``, ``max_body_bytes``, ``cors`` or ``request_id_headers`` is given, so
    that they take effect; what is not given stays as it runs)."""
    try:
        common.import_serve()
    except AtomrError as exc:
        fail(exc)
    from atomr_infer.serve import run_server, running_server
    from atomr_infer.serve.server import api_settings

    try:
        current = running_server()
        given = (api_keys, max_body_bytes, cors, request_id_headers)
        reconfigure = any(value is not None for value in given)
        if current is not None and (current.host, current.port) == (host, port) and not reconfigure:
            _line("api", f"{current.base_url} (OpenAI-compatible, already running)")
            return
        settings = api_settings(current, host, port, *given)
        _line("api", f"starting the OpenAI-compatible API on {host}:{port} …")
        server = run_server(host, port, blocking=True, **settings)
    except AtomrError as exc:  # the port is taken: the error says which
        fail(exc)
    except Exception as exc:  # noqa: BLE001 - Serve's own errors, in one line
        fail(AtomrError(f"could not start the API on {host}:{port}: {one_line(exc)}"))
    _line("api", f"{server.base_url} (OpenAI-compatible, model = deployment name; `atomr down` stops it)")


def _provision_gemma(control: ControlPlane) -> int:
    from atomr_infer.cli.deploy import report
    from atomr_infer.provision import GemmaDefaults, Ready, provision_if_ready

    try:
        defaults = GemmaDefaults.from_env()
        result = provision_if_ready(control, defaults)
    except Exception as exc:  # noqa: BLE001 - SpecError (exit 2), budget (3), …
        return report(exc)
    if isinstance(result, Ready):
        what = f"{result.deployment_name} ({result.model})"
        _line("gemma", f"deployed {what}, generation {result.generation}" if result.changed else f"{what} deployed")
        if result.note:
            _line("", result.note)
        _line("", f"`atomr status {result.deployment_name}` follows its start")
    elif not result.quiet:
        _line("gemma", f"skipped: {result.reason}")
        if result.hint:
            _line("", f"hint: {result.hint}")
    return EXIT_OK


@app.command("down")
def down_command(
    address: str | None = common.address_option(),
    timeout: float = typer.Option(120.0, "--timeout", min=1.0, help="Seconds to wait for replicas to stop."),
) -> None:
    """Remove every deployment, stop the manager, and stop the Ray that `atomr up` started."""
    from atomr_infer import cluster

    target = address or os.environ.get("RAY_ADDRESS", "").strip()  # the cluster named, if one is
    try:
        import ray
    except ImportError as exc:  # nothing can be asked of the cluster: stop atomr's head outright
        _line("Ray", f"cannot be imported here: {type(exc).__name__}: {one_line(exc)}")
        if target and target.rsplit(":", 1)[0] not in ("127.0.0.1", "localhost"):
            fail(AtomrError(f"the cluster at {target} cannot be reached without Ray; nothing was stopped"))
        stopped = _stop_stale_head()
        _line("Ray", f"stopped the local head atomr started ({stopped} processes; its replicas were not "
                     "drained)" if stopped else "no local head atomr started is running here; nothing to stop")
        raise typer.Exit(EXIT_OK) from None
    try:
        cluster.local_address()  # a bad ATOMR_RAY_PORT is an error, not "no cluster answers"
    except AtomrError as exc:
        fail(exc)
    try:
        common.connect(address, start=False)
    except AtomrError as exc:
        # Another machine's cluster that does not answer, or a cluster that answers but cannot be
        # joined (a timeout, no auth token): stopping the head here would be undrained, on a guess.
        if isinstance(exc, SettingError):  # a malformed address: invalid input (exit 2)
            fail(exc)
        if not isinstance(exc, NoCluster) or (target and not _on_this_machine(target)):
            fail(AtomrError(f"nothing was stopped: {one_line(exc)}"))
        if not target or _atomrs_head(target):  # (not the head atomr started here when another is named)
            _stop_stale_head()
        _line("Ray", f"no cluster is running{f' at {target}' if target else ''}; nothing to stop")
        raise typer.Exit(EXIT_OK) from None
    deadline = time.monotonic() + timeout
    try:
        control = _manager_listing(deadline)  # before anything stops: one that cannot list stops nothing
        _stop_api()
        if control is not None:
            _remove_everything(control, deadline, timeout)
    except AtomrError as exc:
        fail(exc)
    gcs = ray.get_runtime_context().gcs_address
    port = int(gcs.rsplit(":", 1)[1])
    ours = _atomrs_head(gcs) and _started_by_atomr(port)
    ray.shutdown()
    if ours:
        from atomr_infer.local_ray import stop_head

        count = stop_head(port)
        with contextlib.suppress(OSError):
            cluster.started_marker().unlink()
        _line("Ray", f"stopped the local head at 127.0.0.1:{port} ({count} processes)")
    else:
        _line("Ray", f"left running at {gcs} (atomr did not start it)")
    raise typer.Exit(EXIT_OK)


def _stop_api() -> None:
    """Delete the API first, so no request reaches a replica that is stopping. Where Serve
    cannot be imported, this process cannot reach the API to stop it: say so and go on, so that
    ``atomr down`` still removes the deployments and stops Ray."""
    try:
        common.import_serve()
    except AtomrError as exc:
        _line("api", f"not checked: {exc}")
        return
    from atomr_infer.serve import running_server, stop_server

    try:
        current = running_server()
        if current is None:
            return
        stop_server(current, shutdown_serve=True)  # unless other applications still run on it
    except Exception as exc:  # noqa: BLE001
        raise AtomrError(f"could not stop the API: {one_line(exc)}") from exc
    _line("api", f"stopped ({current.base_url})")


def _retrying(call: Callable[[], T], deadline: float) -> T:
    """``call()``, asked again while the manager restarts or recovers its stored state (a
    retryable error: it does not know its deployments yet), until ``deadline``."""
    said = False
    while True:
        try:
            return call()
        except AtomrError as exc:
            if not exc.retryable or time.monotonic() >= deadline:
                raise
            if not said:
                _line("manager", f"not ready: {one_line(exc)}; waiting for it")
                said = True
        time.sleep(RETRY_S)


def _manager_listing(deadline: float) -> ControlPlane | None:
    """The manager, once it can list its deployments (None: not running). One that cannot by
    ``deadline`` is an error, and nothing is stopped: killing it would leave its replicas running."""
    from atomr_infer.control.client import ControlPlane

    try:
        control = ControlPlane.connect(None, start=False)  # connect() above chose the cluster
    except AtomrError:
        _line("manager", "not running")
        return None
    try:
        _retrying(control.list, deadline)
    except AtomrError as exc:
        if not exc.retryable:
            raise
        why = one_line(exc)
        raise AtomrError(f"nothing was stopped, as the manager cannot list its deployments yet: {why}") from None
    return control


def _remove_everything(control: ControlPlane, deadline: float, timeout: float) -> None:
    import ray

    from atomr_infer import cluster

    statuses = _retrying(control.list, deadline)
    actors = {r.actor_name for s in statuses for r in s.replicas}
    for s in statuses:
        if not s.removing:
            result = _retrying(lambda name=s.name: control.remove(name), deadline)
            _line(s.name, "; ".join(result.actions))
    listed = _retrying(control.list, deadline)
    while listed and time.monotonic() < deadline:
        actors |= {r.actor_name for s in listed for r in s.replicas}  # (one recovering was listed without them)
        time.sleep(0.5)
        listed = _retrying(control.list, deadline)
    # The manager's reaper kills stopped replicas after their engine shut down; wait for that
    # too, or a killed manager could leave detached replica actors behind.
    while _alive(actors) and time.monotonic() < deadline:
        time.sleep(0.5)
    for name in _alive(actors):
        err.print(f"warning: {name} did not stop within {timeout:g}s; killing it", markup=False)
        with contextlib.suppress(Exception):
            ray.kill(ray.get_actor(name, namespace=cluster.NAMESPACE), no_restart=True)
    if statuses:
        _line("replicas", f"stopped ({len(actors)})")
    ray.kill(control.handle, no_restart=True)
    _line("manager", "stopped")


def _alive(names: set[str]) -> set[str]:
    import ray

    from atomr_infer import cluster

    alive = set()
    for name in names:
        try:
            ray.get_actor(name, namespace=cluster.NAMESPACE)
        except ValueError:
            continue
        alive.add(name)
    return alive


def _started_by_atomr(port: int) -> bool:
    """The marker names this port and the head there is the one atomr started."""
    from atomr_infer import cluster
    from atomr_infer.local_ray import started_before

    marker = cluster.started_marker()
    try:
        recorded = marker.read_text().strip()
        written = marker.stat().st_mtime
    except OSError:
        return False
    return recorded.endswith(f":{port}") and started_before(port, written)


def _on_this_machine(address: str) -> bool:
    """Whether ``address`` (host:port, a name or an IP, or ``ray://`` one) is one of this machine's."""
    import socket

    import psutil

    host = address.removeprefix("ray://").rpartition(":")[0].strip("[]")
    here = {a.address for nic in psutil.net_if_addrs().values() for a in nic} | {"localhost", "0.0.0.0"}
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None)} if host not in here else {host}
    except OSError:  # a name that does not resolve is no address of this machine
        return False
    return bool(resolved & here)


def _atomrs_head(address: str) -> bool:
    """Whether ``address`` (host:port) is where the head atomr started here listens: this
    machine, the port its marker names (a cluster elsewhere on the same port is not it)."""
    from atomr_infer import cluster

    try:
        recorded = cluster.started_marker().read_text().strip()
    except OSError:
        return False
    return _on_this_machine(address) and recorded.rpartition(":")[2] == address.rpartition(":")[2]


def _stop_stale_head() -> int | None:
    """No cluster answers (or Ray cannot be imported here), but atomr's head may have left
    processes behind: stop them. How many were stopped; None where atomr started no head."""
    from atomr_infer import cluster
    from atomr_infer.local_ray import head_processes, stop_head

    marker = cluster.started_marker()
    try:
        port = int(marker.read_text().strip().rsplit(":", 1)[1])
    except (OSError, ValueError, IndexError):
        return None
    stopped = stop_head(port) if head_processes(port) and _started_by_atomr(port) else None
    with contextlib.suppress(OSError):
        marker.unlink()
    return stopped
