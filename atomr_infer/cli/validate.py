"""``atomr validate``: check deployment specs without touching a cluster."""

from __future__ import annotations

from pathlib import Path

import typer

from atomr_infer.cli import common
from atomr_infer.cli.app import app, err, fail, out
from atomr_infer.errors import AtomrError


@app.command()
def validate(
    paths: list[Path] = typer.Argument(..., help="YAML files or directories of them.", show_default=False),
) -> None:
    """Check deployment specs without touching a cluster. Exits 2 on any problem."""
    try:
        deployments = common.load_specs(paths)
        common.check_engine_settings(deployments)  # against the vLLM installed here
    except AtomrError as exc:
        fail(exc)
    for d, missing in common.missing_local_models(deployments):  # the cluster's nodes may have it
        err.print(f"warning: {d.name}: model: {missing.message} on this machine (the replicas load it on "
                  "their nodes: it must be there)", markup=False)
    for d in deployments:
        size = f"{d.replicas} replica{'s' if d.replicas != 1 else ''}"
        where = "cpu" if d.device == "cpu" else f"{d.gpus} GPU{'s' if d.gpus != 1 else ''} each, device {d.device}"
        out.print(f"valid: {d.name}  {d.model}  ({size}, {where})", markup=False, emoji=False)
