"""``atomr status`` (deployments and their replicas, like ``kubectl get`` / ``ollama ps``) and
``atomr logs`` (recent log lines of a deployment's replicas, from Ray's log files)."""

from __future__ import annotations

import json
import time

import typer
from rich.text import Text

from atomr_infer.cli import common, render
from atomr_infer.cli.app import EXIT_OK, app, err, fail, out
from atomr_infer.errors import AtomrError, DeploymentNotFound, one_line
from atomr_infer.status import DeploymentStatus


def _statuses(address: str | None, name: str | None) -> list[DeploymentStatus] | None:
    """Deployment statuses; None when Ray runs but the manager does not (nothing deployed)."""
    from atomr_infer.control.client import ControlPlane

    common.connect(address, start=False)
    try:
        control = ControlPlane.connect(address, start=False)
    except AtomrError:
        if name:
            raise DeploymentNotFound(name) from None
        return None
    if name is None:
        return control.list()
    status = control.status(name)
    if status is None:
        known = [s.name for s in control.list()]
        raise DeploymentNotFound(name, known)
    return [status]


@app.command("status")
def status_command(
    name: str | None = typer.Argument(None, help="One deployment (default: all).", show_default=False),
    as_json: bool = typer.Option(False, "--json", help="Print JSON: deployments with their replicas."),
    address: str | None = common.address_option(),
) -> None:
    """Deployments and their replicas: generation, readiness, placement, load, speed, uptime."""
    try:
        statuses = _statuses(address, name)
    except AtomrError as exc:
        fail(exc)
    statuses = statuses or []
    replicas = [r for s in statuses for r in s.replicas]
    stats = common.replica_stats(replicas) if replicas else {}
    dashboard = common.dashboard_url()
    waiting = common.waiting_reasons(replicas, stats)
    rows = render.replica_rows(statuses, stats, common.node_ips(), dashboard, waiting=waiting)
    if as_json:
        data = [
            {
                **{k: v for k, v in s.to_dict().items() if k != "replicas"},
                "replicas": [r for r in rows if r["deployment"] == s.name],  # with their live stats
            }
            for s in statuses
        ]
        typer.echo(json.dumps(data[0] if name else data, indent=2, default=str))
        raise typer.Exit(EXIT_OK)
    if not statuses:
        out.print("No deployments. `atomr deploy deployments/smollm2.yaml` creates one.", markup=False)
        raise typer.Exit(EXIT_OK)
    for line in render.deployments_lines(statuses):
        out.print(line, soft_wrap=True)
    if rows:
        out.print()
        for line in render.replicas_lines(rows):
            out.print(line, soft_wrap=True)
        adapters = render.adapter_lines(rows)
        if adapters:
            out.print()
        for text in adapters:
            out.print(text, markup=False, soft_wrap=True)
    for s in statuses:
        if s.autoscaling:
            out.print(Text("\n" + render.scaling_line(s), style="dim"), soft_wrap=True)
        if s.last_failure and (s.failing or s.failed or s.recovering):  # not a failure long since mended
            out.print(Text("\n" + render.failure_line(s), style="red"), soft_wrap=True)
        for adapter, why in s.failed_adapters.items():  # the deployment is ready; this adapter is not
            out.print(Text(f"\n{s.name}: adapter {adapter!r} failed to load: {why}", style="red"), soft_wrap=True)
    if dashboard:
        out.print(Text(f"\ndashboard: {dashboard}", style="dim"), soft_wrap=True)


@app.command("logs")
def logs_command(
    name: str = typer.Argument(..., help="Deployment name.", show_default=False),
    replica: str | None = typer.Option(None, "--replica", "-r", help="One replica id, e.g. r0 (default: all)."),
    lines: int = typer.Option(50, "--lines", "-n", min=1, help="Lines per replica, from the end."),
    raw: bool = typer.Option(False, "--raw", help="Print the lines as written (JSON log records, Ray's markers)."),
    address: str | None = common.address_option(),
) -> None:
    """Recent log lines of a deployment's replicas (the replica actors' stderr: atomr and vLLM logs)."""
    try:
        statuses = _statuses(address, name) or []
    except AtomrError as exc:
        fail(exc)
    targets = [r for r in statuses[0].replicas if replica in (None, r.replica_id)]
    if not targets and replica is None:  # scaled to zero, or replicas: 0
        fail(AtomrError(f"deployment {name!r} has no replicas (hint: `atomr status {name}`)"))
    if not targets:
        ids = ", ".join(r.replica_id for r in statuses[0].replicas) or "none"
        fail(AtomrError(f"deployment {name!r} has no replica {replica!r} (replicas: {ids})"))
    shown = 0
    for r in targets:
        header = f"==> {name}/{r.replica_id} ({r.state}, {r.actor_name}) <=="
        out.print(Text(header, style="bold"), soft_wrap=True)
        try:  # blank lines and Ray's marker lines are dropped, so read a few more than asked
            text = _tail(r.actor_id, lines if raw else lines + 20)
        except Exception as exc:  # noqa: BLE001 - one replica's logs failing leaves the others
            err.print(f"error: no logs for {name}/{r.replica_id}: {one_line(exc)}", markup=False)
            continue
        shown += 1
        readable = text.splitlines() if raw else [ln for ln in map(_readable, text.splitlines()) if ln]
        for line in readable[-lines:]:
            typer.echo(line)
    if not shown:
        fail(AtomrError("no replica logs could be read (hint: the Ray dashboard must run: `atomr up` starts it)"))


_RAY_MARKERS = (":job_id:", ":actor_name:", ":task_name:")
_KNOWN = ("timestamp", "level", "event", "logger", "deployment", "replica")


def _readable(line: str) -> str | None:
    """A JSON log record as ``HH:MM:SS level event key=value…``; Ray's marker lines dropped."""
    if not line.strip() or line.startswith(_RAY_MARKERS):
        return None
    if not line.startswith("{"):
        return line
    try:
        record = json.loads(line)
    except ValueError:
        return line
    if not isinstance(record, dict) or "event" not in record:
        return line
    when = str(record.get("timestamp", ""))[11:19]
    extra = " ".join(f"{k}={v}" if isinstance(v, (int, float)) else f"{k}={json.dumps(v)}"
                     for k, v in record.items() if k not in _KNOWN)
    return f"{when} {record.get('level', ''):<7} {record['event']}" + (f"  {extra}" if extra else "")


AGENT_TRIES, AGENT_PAUSE_S = 3, 2.0


def _tail(actor_id: str, lines: int) -> str:
    """The last ``lines`` lines the actor's worker wrote to stderr (where logging goes). The
    dashboard can answer for a moment that a live node's agent "doesn't exist" (its table of
    agents catching up; seen once in a full test run on a loaded machine): asked again then."""
    import ray
    from ray.util.state import get_log

    gcs = ray.get_runtime_context().gcs_address  # else the state API guesses among local clusters
    tries = 1
    while True:
        try:
            return "".join(get_log(address=gcs, actor_id=actor_id, suffix="err", tail=lines, timeout=20))
        except Exception as exc:
            if "Agent for node id" not in str(exc) or tries >= AGENT_TRIES:
                raise
        tries += 1
        time.sleep(AGENT_PAUSE_S)
