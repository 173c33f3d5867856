"""``atomr deploy`` and ``atomr remove``.

``deploy`` validates every file first (exit 2, nothing touched), checks that each deployment's
device can be had (a ``device: cuda`` spec on a host and cluster without a GPU fails here,
before a Ray is started; with no cluster running, also the vLLM settings and a local-path
``model`` against this machine, where a local head would run the replicas), has the manager
check several together (names, vLLM settings, the
budget of all of them: a refusal applies none), then applies each one and, with ``--wait``,
follows them until ready.
Exit codes: 0 ready (or applied, with ``--no-wait``), 1 failed or timed out, 2 invalid,
3 rejected by a budget check.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from atomr_infer.cli import common, render
from atomr_infer.cli.app import (
    EXIT_BUDGET,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    app,
    err,
    fail,
    out,
    usage_error,
)
from atomr_infer.errors import AtomrError, one_line

if TYPE_CHECKING:
    from atomr_infer.control.client import ControlPlane


def report(exc: BaseException) -> int:
    """Print ``exc`` as ``fail`` does, but return its exit code instead of exiting."""
    try:
        fail(exc)
    except typer.Exit as done:
        return done.exit_code
    return EXIT_FAILED  # pragma: no cover - fail() always exits


def _say(text: str) -> None:
    out.print(text, markup=False, emoji=False, highlight=False)


@app.command("deploy")
def deploy_command(
    paths: list[Path] = typer.Argument(..., help="Deployment YAML files or directories of them.", show_default=False),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and the budget verdict; change nothing."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Follow the rollout until ready (default)."),
    timeout: float = typer.Option(600.0, "--timeout", min=1.0, help="Seconds --wait waits for readiness."),
    address: str | None = common.address_option(),
) -> None:
    """Apply deployment specs: validate, check budgets, create or update replicas, wait until ready."""
    try:
        deployments = common.load_specs(paths)
    except AtomrError as exc:
        fail(exc)
    common.quiet_logs()
    from atomr_infer.cluster import target_address, use_local_auth_token
    from atomr_infer.provision import require_device

    use_local_auth_token()
    target = target_address(address)  # the device probe looks at the cluster we deploy to
    if dry_run:
        raise typer.Exit(_dry_run(deployments, address, local_head=target is None))
    try:
        for d in deployments:
            require_device(d, address=target)  # before anything starts: gemma on a CPU host stops here
        if target is None:  # the local head's vLLM and files are this machine's: refused before a head starts
            common.check_engine_settings(deployments, models_here=True)
        control = common.control_plane(address, start=True)
    except Exception as exc:  # noqa: BLE001 - fail() prints one line
        fail(exc)
    if len(deployments) > 1 and (code := _check_together(control, deployments)):
        err.print("nothing was applied", markup=False)
        raise typer.Exit(code)

    code, applied, unchanged = EXIT_OK, [], []
    for d in deployments:
        try:
            result = control.apply(d)
        except AtomrError as exc:
            code = code or report(exc)
            continue
        generation = f" (generation {result.generation})" if result.changed else ""
        _say(f"{d.name}: {'; '.join(result.actions)}{generation}")
        for warning in result.warnings:
            err.print(f"warning: {warning}", markup=False)
        (applied if result.changed else unchanged).append(d.name)
    names = applied + unchanged
    if wait and names:
        code = _wait(control, names, timeout) or code
    elif names:
        _say("not waiting; follow with `atomr status`")
    raise typer.Exit(code)


def _check_together(control: ControlPlane, deployments: list) -> int:  # type: ignore[type-arg]
    """The manager's checks of every spec (names, vLLM settings, budget), each with those before
    it counted as applied: a refusal of one stops the deploy before any is applied."""
    code = EXIT_OK
    for i, d in enumerate(deployments):
        try:
            plan = control.plan(d, alongside=tuple(deployments[:i]))
        except AtomrError as exc:
            code = code or report(exc)
            continue
        if plan.error:  # what apply would raise (a budget with on_exceeded: warn only warns)
            err.print(f"error: {plan.error}", markup=False)
            code = code or EXIT_BUDGET
    return code


def _wait(control: ControlPlane, names: list[str], timeout: float) -> int:
    from atomr_infer.cli.watch import wait_for

    started = time.monotonic()
    try:
        outcome = wait_for(control.handle, names, timeout)
    except KeyboardInterrupt:
        err.print("interrupted: the rollout goes on in the background (`atomr status` to follow it)")
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001
        return report(AtomrError(f"lost track of the rollout: {one_line(exc)}"))
    took = time.monotonic() - started
    if outcome.ready and not (outcome.failed or outcome.pending):
        if took >= 1.0:
            _say(f"ready: {', '.join(outcome.ready)} ({took:.0f}s)")
        return EXIT_OK
    for name, reason in outcome.failed.items():
        then = (
            "the engine refused this spec, so it will recur: the manager tries 3 times and stops; "
            "fix the spec and deploy it again"
            if name in outcome.recurring
            else "its replicas serve the rest and try the adapter again with backoff; fix it (or lora.adapters) "
            "and deploy again: they then try it at once" if name in outcome.adapters
            else f"the manager retries with backoff, `atomr remove {name}` stops it"
        )
        report(AtomrError(f"deployment {name!r} failed: {reason} (hint: `atomr logs {name}`; {then})"))
    away = f" ({outcome.away})" if outcome.away else ""  # the manager's last answer was none
    for name in outcome.pending:
        report(
            AtomrError(
                f"deployment {name!r} not ready after {timeout:g}s{away} (hint: `atomr status {name}`, "
                f"`atomr logs {name}`; it keeps starting in the background)"
            )
        )
    return EXIT_FAILED


def _dry_run(deployments, address: str | None, local_head: bool) -> int:  # noqa: ANN001
    """Per deployment: the plan's actions and the budget verdict, or why the manager would refuse
    it (each with the deployments before it counted as applied). Starts and changes nothing.
    ``local_head``: no cluster runs, so the deploy would start one here (and refuse what the
    replicas could not find here)."""
    from atomr_infer.provision import require_device

    try:
        control = common.control_plane(address, start=False)
    except AtomrError as exc:
        control = None
        offline = one_line(exc)
        try:  # what the manager would refuse, as far as the vLLM here can tell
            common.check_engine_settings(deployments, models_here=local_head)
        except AtomrError as refused:
            return report(refused)
    code = EXIT_OK
    for i, d in enumerate(deployments):
        device_error = None
        try:
            require_device(d)
        except AtomrError as exc:
            device_error = str(exc)
        if control is None:
            _say(f"{d.name}: create {render.plural(d.replicas, 'replica')}")
            if d.autoscaling is not None:
                from atomr_infer.control.budget import scaling_summary

                _say(f"  scaling: {scaling_summary(d, None)}")
            _say(f"  budget: not checked: {offline}")
        else:
            try:
                plan = control.plan(d, alongside=tuple(deployments[:i]))  # as the deploy would apply them
            except AtomrError as exc:
                code = code or report(exc)
                continue
            _say(f"{d.name}: {'; '.join(plan.actions)}")
            if plan.scaling:
                _say(f"  scaling: {plan.scaling}")
            if d.lora is not None:
                from atomr_infer.control.budget import lora_summary

                _say(f"  lora: {lora_summary(d)}")
            if plan.budget_ok:
                _say(f"  budget: {plan.budget or 'ok'}")
            elif plan.error is None:  # over, with on_exceeded: warn: apply goes ahead and warns
                _say(f"  budget: over, warn only: {plan.budget}")
            else:
                _say(f"  budget: REJECTED: {plan.error}")
                code = code or EXIT_BUDGET
        if device_error:
            _say(f"  device: REJECTED: {device_error}")
            code = code or EXIT_FAILED
    _say("dry run: nothing was changed")
    return code


@app.command("remove")
def remove_command(
    names: list[str] = typer.Argument(None, help="Deployment names.", show_default=False),
    all_: bool = typer.Option(False, "--all", help="Remove every deployment."),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="Wait until the replicas have stopped (default)."),
    timeout: float = typer.Option(120.0, "--timeout", min=1.0, help="Seconds --wait waits."),
    address: str | None = common.address_option(),
) -> None:
    """Drain and remove deployments: in-flight requests finish, then the replicas stop."""
    if not names and not all_:
        usage_error("name a deployment to remove, or pass --all (hint: `atomr status` lists them)")
    try:
        control = common.control_plane(address, start=False)
        if all_:
            names = [s.name for s in control.list() if not s.removing]
            if not names:
                _say("no deployments")
                raise typer.Exit(EXIT_OK)
    except AtomrError as exc:
        fail(exc)
    code, removed = EXIT_OK, []
    for name in names:
        try:
            result = control.remove(name)
        except AtomrError as exc:
            code = code or report(exc)
            continue
        if not result.changed:
            listed = {s.name: s for s in control.list()}
            if name in listed and listed[name].removing:  # removed before (--no-wait, Ctrl-C): still draining
                _say(f"{name}: already being removed")
                removed.append(name)
                continue
            known = ", ".join(n for n, s in listed.items() if not s.removing) or "none"
            code = code or report(AtomrError(f"no deployment named {name!r} (deployments: {known})"))
            continue
        _say(f"{name}: {'; '.join(result.actions)}")
        removed.append(name)
    if wait and removed:
        try:
            code = _wait_removed(control, removed, timeout) or code
        except AtomrError as exc:
            code = report(exc)
    raise typer.Exit(code)


def _wait_removed(control: ControlPlane, names: list[str], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    pending = list(names)
    while pending and time.monotonic() < deadline:
        for name in list(pending):
            try:
                gone = control.status(name) is None
            except AtomrError as exc:  # the manager restarts, or has not read its state back: asked again
                if not exc.retryable:
                    raise
                break
            if gone:
                pending.remove(name)
                _say(f"{name}: removed")
        if pending:
            time.sleep(0.5)
    if pending:
        return report(AtomrError(f"still draining after {timeout:g}s: {', '.join(pending)} (hint: `atomr status`)"))
    return EXIT_OK
