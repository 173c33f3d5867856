"""``atomr probe``: what this host and cluster can run, as a checklist or JSON."""

from __future__ import annotations

import json

import typer
from rich.markup import escape

from atomr_infer.cli.app import app, out

_LABELS = {
    "gpu": "GPU",
    "cuda": "CUDA",
    "vllm": "vLLM",
    "hf_cache": "HF cache",
    "disk": "disk",
    "hf_token": "HF token",
    "weights": "weights",
    "ray": "Ray",
}
_WIDTH = max(map(len, _LABELS.values()))


@app.command("probe")
def probe_command(
    model: str | None = typer.Option(None, "--model", help="Also check that this model's weights are cached."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Check GPUs, CUDA, vLLM, the HF cache and token, and Ray. Exits 0: it reports, it does not judge."""
    from atomr_infer.provision.probe import probe

    report = probe(model)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    for check in report.checks:
        mark = "[green]✓[/]" if check.ok else "[red]✗[/]"
        label = _LABELS.get(check.name, check.name)
        out.print(f"{mark} {label:<{_WIDTH}}  {escape(check.detail)}")
        if check.hint and not check.ok:
            out.print(f"  {'':<{_WIDTH}}  hint: {escape(check.hint)}")
    if report.gpu_available:
        out.print("\nA CUDA GPU is available: device: cuda deployments (deployments/gemma.yaml) can run.")
    else:
        out.print(
            "\nNo usable CUDA GPU: device: cpu deployments (deployments/smollm2.yaml) can run here, "
            "device: cuda ones (deployments/gemma.yaml) cannot."
        )
