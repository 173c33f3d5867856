"""``atomr reset-cache``: an operator's action on every replica of a deployment.

vLLM's server has ``POST /reset_prefix_cache`` for the one engine behind it; atomr's API does not
serve it to API-key holders (serve/routes.py), and one call would reach one replica. This
command resets every ready replica of the deployment through the control plane."""

from __future__ import annotations

import typer

from atomr_infer.cli import common
from atomr_infer.cli.app import EXIT_FAILED, app, fail, out
from atomr_infer.errors import AtomrError


@app.command("reset-cache")
def reset_cache_command(
    name: str = typer.Argument(..., help="The deployment.", show_default=False),
    running: bool = typer.Option(
        False, "--running", help="Also preempt running requests, whose cached blocks otherwise keep it from resetting."
    ),
    address: str | None = common.address_option(),
) -> None:
    """Reset the prefix (KV) cache of every ready replica of a deployment."""
    from atomr_infer.control.client import ControlPlane

    try:
        common.connect(address, start=False)
        outcome = ControlPlane.connect(address, start=False).reset_prefix_cache(name, running)
    except AtomrError as exc:
        fail(exc)
    for replica_id, result in outcome.items():
        hint = " (running requests hold cached blocks: --running preempts them)" if result == "busy" else ""
        out.print(f"{name}/{replica_id}: {result}{hint}", markup=False, soft_wrap=True)
    if any(result != "reset" for result in outcome.values()):
        raise typer.Exit(EXIT_FAILED)
