"""What the cluster commands share: ``--address``, connecting, calling the manager, stats.

Every failure here becomes an ``AtomrError`` with one line of text, so ``fail()`` prints
``error: …`` and the exit code its type calls for.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import typer

from atomr_infer.cli.app import _state, err
from atomr_infer.cluster import NAMESPACE
from atomr_infer.errors import AtomrError, one_line
from atomr_infer.status import ReplicaState, ReplicaStatus

if TYPE_CHECKING:
    from atomr_infer.control.client import ControlPlane
    from atomr_infer.serve.cors import Cors

# Library logs (structlog) stay at WARNING in the CLI process: a command prints its own lines.
# Only this process is affected, not the Ray head and replicas the CLI starts.
if not os.environ.get("ATOMR_LOG_LEVEL"):
    from atomr_infer.log import configure_logging

    configure_logging("WARNING", force=True)

MAX_BODY_MB = 65_536.0  # --max-body-mb's bound (64 GiB): `inf` passed typer's min and failed after Ray started
ADDRESS_HELP = "Ray cluster address, host:port (default: RAY_ADDRESS, else the local head atomr starts)."


def address_option() -> Any:
    return typer.Option(None, "--address", help=ADDRESS_HELP, show_default=False)


CORS_LISTS = {  # flag -> what it lists (serve/cors.py)
    "--allowed-origins": "web pages' origins that may call the API (default none)",
    "--allowed-methods": "HTTP methods they may use (default any)",
    "--allowed-headers": "request headers they may send (default any)",
}


def cors_list_option(flag: str, prefix: str = "") -> Any:
    """``--allowed-origins``/``-methods``/``-headers`` (serve/cors.py), checked before anything starts."""

    def parse(value: str | None) -> tuple[str, ...] | None:
        from atomr_infer.serve.cors import cors_list

        try:
            return None if value is None else cors_list(flag, value)
        except AtomrError as exc:
            raise typer.BadParameter(str(exc).removeprefix(f"{flag}: ")) from None

    what = f"{prefix}{CORS_LISTS[flag]}" if prefix else CORS_LISTS[flag][0].upper() + CORS_LISTS[flag][1:]
    return typer.Option(None, flag, callback=parse, show_default=False,
                        help=f"{what} (CORS): a JSON list as vLLM takes it, or comma-separated; '*' for any.")


def allow_credentials_option(prefix: str = "") -> Any:
    what = "let cross-origin pages send cookies (CORS)."
    return typer.Option(False, "--allow-credentials", help=f"{prefix}{what}" if prefix else "L" + what[1:])


def request_id_headers_option(prefix: str = "") -> Any:
    """vLLM's flag, with its ``--no-`` form: None when neither is given (an API running keeps its setting)."""
    what = "every answer carries X-Request-Id: the request's own, else a fresh uuid4 hex (default off, as vLLM)."
    return typer.Option(None, "--enable-request-id-headers/--no-enable-request-id-headers", show_default=False,
                        help=f"{prefix}{what}" if prefix else "E" + what[1:])


def cors_of(origins: Any, methods: Any, headers: Any, credentials: bool) -> Cors | None:
    """The API's CORS from the flags (each parsed by its option); None when none was given."""
    from atomr_infer.serve.cors import Cors

    given = {name: value for name, value in (("allowed_origins", origins), ("allowed_methods", methods),
                                             ("allowed_headers", headers)) if value is not None}
    return Cors(**given, allow_credentials=credentials) if given or credentials else None


def check_key_file(path: str | None) -> None:
    """``--api-keys``: a file that cannot be read or is wrong is a usage error (exit 2), said before
    anything starts (a head and the manager left running after a typo)."""
    from atomr_infer.cli.app import usage_error
    from atomr_infer.serve.api_keys import load_key_file

    if path is not None:
        try:
            load_key_file(path)
        except AtomrError as exc:
            usage_error(f"--api-keys: {exc}")


def check_listen_host(host: str) -> None:
    """``--host``: a name that does not resolve is a usage error (exit 2), said before anything
    starts (it failed only once Ray had started, leaving a head running)."""
    import socket

    from atomr_infer.cli.app import usage_error

    try:
        socket.getaddrinfo(host, None)
    except OSError as exc:
        usage_error(f"--host {host!r}: not an address this machine can listen on ({exc.strerror or exc})")


def check_api_before_start(host: str, port: int, address: str | None) -> None:
    """What the API needs that can be checked before anything starts: found only after, a local
    head and the manager started for it stayed running. ``$VLLM_HTTP_TIMEOUT_KEEP_ALIVE``; and,
    with no cluster to join, ``host:port`` free here (with a cluster, ``run_server`` checks it:
    the API running there may hold the port, to be updated in place)."""
    from atomr_infer import cluster
    from atomr_infer.serve.listener import check_free, keep_alive_s

    keep_alive_s()
    if not cluster.target_address(address):
        check_free(host, port)


def quiet_logs() -> None:
    """With ``--debug``, loggers bound from now on log at DEBUG."""
    from atomr_infer.log import configure_logging

    if _state["debug"] and not os.environ.get("ATOMR_LOG_LEVEL"):
        configure_logging("DEBUG", force=True)


def quiet_serve_logs() -> None:
    """Ray Serve logs INFO lines to the driver's stderr; the CLI prints its own (``--debug`` keeps them)."""
    import logging

    from ray import serve  # noqa: F401 - its import sets the logger up; set the level after

    if not _state["debug"]:
        logging.getLogger("ray.serve").setLevel(logging.WARNING)


def cannot_import(what: str, exc: BaseException) -> str:
    """One form for every part of the install this host cannot load: what, and why."""
    return f"{what} cannot be imported here: {type(exc).__name__}: {one_line(exc)}"


def import_serve() -> None:
    """Ray Serve and atomr's ingress, imported (Serve's logs quieted), or ``AtomrError`` in one
    line saying why not: a host whose Ray lacks Serve, or whose Serve fails at import (a
    missing dependency, say), gets that, not a traceback."""
    try:
        quiet_serve_logs()
        import atomr_infer.serve  # noqa: F401 - the ingress imports ray.serve at its top
    except Exception as exc:  # noqa: BLE001 - ImportError, or anything a broken install raises
        raise AtomrError(
            f"{cannot_import('Ray Serve', exc)} (hint: `make setup`, or pip install 'ray[serve]')"
        ) from None


def connect(address: str | None, start: bool, announce: bool = True) -> None:
    """Join the cluster; with ``start``, start the local head if none runs (saying so)."""
    from atomr_infer import cluster

    quiet_logs()
    cluster.use_local_auth_token()
    if start and announce and not cluster.target_address(address):
        err.print(f"starting a local Ray head at {cluster.local_address()} (`atomr down` stops it)", markup=False)
    try:
        cluster.connect(address, start=start)
    except AtomrError:
        raise
    except ImportError as exc:
        raise AtomrError(
            f"{cannot_import('Ray', exc)} (hint: `atomr probe` checks this host; `make setup` or pip install "
            "'ray[serve]' repairs it)"
        ) from exc
    except Exception as exc:  # ConnectionError, RuntimeError from ray.init: one line
        raise AtomrError(f"could not connect to Ray: {one_line(exc)}") from exc


def control_plane(address: str | None, start: bool = True, announce: bool = True) -> ControlPlane:
    """The manager's typed client; with ``start=False`` nothing is started (error if absent)."""
    from atomr_infer.control.client import ControlPlane

    connect(address, start, announce)
    try:
        return ControlPlane.connect(address, start=start)
    except AtomrError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise AtomrError(f"could not reach the atomr manager: {one_line(exc)}") from exc


def dashboard_url() -> str | None:
    """The Ray dashboard of the connected cluster, as a URL, if it runs."""
    try:
        import ray

        node = ray._private.worker._global_node  # the address info ray.init() returned
        url = node.address_info.get("webui_url") if node is not None else None
    except Exception:  # noqa: BLE001 - private API; the URL is a nicety
        return None
    if not url:
        return None
    return url if url.startswith("http") else f"http://{url}"


def replica_stats(replicas: list[ReplicaStatus], timeout_s: float = 2.0) -> dict[str, Any]:
    """``ReplicaStats`` by actor name, for the replicas that answer within ``timeout_s``."""
    import ray

    refs: dict[Any, str] = {}
    for r in replicas:
        if r.state not in (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DRAINING):
            continue
        try:
            actor = ray.get_actor(r.actor_name, namespace=NAMESPACE)
            refs[actor.stats.remote()] = r.actor_name
        except Exception:  # noqa: BLE001 - gone or not yet created
            continue
    if not refs:
        return {}
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    stats = {}
    for ref in done:
        try:
            stats[refs[ref]] = ray.get(ref)
        except Exception:  # noqa: BLE001 - a replica that fails to answer shows no stats
            continue
    return stats


def waiting_reasons(replicas: list[ReplicaStatus], stats: dict[str, Any]) -> dict[str, str]:
    """Why a starting replica that does not answer has not started: Ray has not placed its
    actor yet (no node has the CPUs or GPUs it reserves). By actor name; best effort."""
    pending = [r for r in replicas if r.state == ReplicaState.STARTING and r.actor_name not in stats]
    if not pending:
        return {}
    try:
        import ray
        from ray.util.state import get_actor

        gcs = ray.get_runtime_context().gcs_address  # else the state API guesses among local clusters
        reasons = {}
        for r in pending:
            actor = get_actor(r.actor_id, address=gcs, timeout=5) if r.actor_id else None
            if actor is not None and actor.state == "PENDING_CREATION":
                need = ", ".join(f"{v:g} {k}" for k, v in sorted((actor.required_resources or {}).items()))
                reasons[r.actor_name] = f"waiting for a node with {need} free" if need else "waiting to be placed"
        return reasons
    except Exception:  # noqa: BLE001 - informational: without it the state just reads "starting"
        return {}


def node_ips() -> dict[str, str]:
    """Node id → IP address, for the NODE column."""
    try:
        import ray

        return {n["NodeID"]: n.get("NodeManagerAddress", "") for n in ray.nodes()}
    except Exception:  # noqa: BLE001
        return {}


def check_engine_settings(deployments: list[Any], models_here: bool = False) -> None:
    """Each spec's vLLM settings (extra_engine_args keys and types, names, adapters found here) against
    the vLLM installed here, as the manager checks them at apply (engine/vllm/spec_check.py: its
    source read, nothing imported); ``SpecError`` with every problem at once. ``models_here``: the
    replicas run on this machine (a local head), so a ``model`` given as a local path must be a
    model directory here, or every replica would fail to find it."""
    from atomr_infer.engine.backend import backend_class
    from atomr_infer.errors import SpecError, SpecProblem

    problems = []
    for d in deployments:
        try:
            backend_class(d).validate(d)
        except SpecError as exc:
            problems += exc.problems
    if models_here:
        problems += [SpecProblem(d.name, "model", f"{d.model!r}: {exc.message} on this machine, where a local Ray "
                                 f"head would run the replicas (hint: {exc.hint})")
                     for d, exc in missing_local_models(deployments)]
    if problems:
        raise SpecError(problems)


def missing_local_models(deployments: list[Any]) -> list[tuple[Any, Any]]:
    """The deployments whose ``model`` is a local path that is no model directory on this machine,
    each with the ``ModelError`` a replica here would fail with (models/resolve.py)."""
    from atomr_infer.errors import ModelError
    from atomr_infer.models.registry import is_local_path
    from atomr_infer.models.resolve import checked_local_dir

    missing = []
    for d in deployments:
        if is_local_path(d.model):
            try:
                checked_local_dir(d.model)
            except ModelError as exc:
                missing.append((d, exc))
    return missing


def load_specs(paths: list[Any]) -> list[Any]:
    """``load_deployments(*paths)``, printing each deprecation (an old field name) as a
    ``warning: …`` line; raises ``SpecError`` as the loader does."""
    import warnings

    from atomr_infer.spec import load_deployments

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FutureWarning)
        deployments = load_deployments(*paths)
    for w in caught:
        if issubclass(w.category, FutureWarning):
            err.print(f"warning: {w.message}", markup=False)
    return deployments

