"""The ``atomr`` command line.

Exit codes: 0 ok, 1 failed, 2 invalid input, 3 rejected by a budget check, 130 interrupted.
Errors print one line, ``error: …``, with a hint where one helps; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console

from atomr_infer.errors import AtomrError, BudgetExceeded, SpecError

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_BUDGET, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

app = typer.Typer(
    name="atomr",
    help="Declarative LLM deployments on Ray: deploy specs, chat with them, serve them over HTTP.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors.")) -> None:
    _state["debug"] = debug


def fail(exc: BaseException) -> NoReturn:
    """Print ``exc`` as ``error: …`` lines and exit with the code its type calls for."""
    if _state["debug"]:
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, SpecError):
        for problem in exc.problems:
            err.print(f"[red]error:[/] {_escape(str(problem))}", markup=True, emoji=False)
        raise typer.Exit(EXIT_INVALID)
    if isinstance(exc, KeyboardInterrupt):
        err.print("interrupted")
        raise typer.Exit(EXIT_INTERRUPTED)
    code = EXIT_BUDGET if isinstance(exc, BudgetExceeded) else EXIT_FAILED
    err.print(f"[red]error:[/] {_escape(str(exc) or type(exc).__name__)}", markup=True)
    raise typer.Exit(code)


def _escape(text: str) -> str:
    return text.replace("[", r"\[")


@app.command()
def validate(
    paths: list[Path] = typer.Argument(..., help="YAML files or directories of them.", show_default=False),
) -> None:
    """Check deployment specs without touching a cluster. Exits 2 on any problem."""
    from atomr_infer.spec import load_deployments

    try:
        deployments = load_deployments(*paths)
    except AtomrError as exc:
        fail(exc)
    for d in deployments:
        size = f"{d.replicas} replica{'s' if d.replicas != 1 else ''}"
        where = "cpu" if d.device == "cpu" else f"{d.gpus} GPU{'s' if d.gpus != 1 else ''} each, device {d.device}"
        out.print(f"valid: {d.name}  {d.model}  ({size}, {where})", markup=False, emoji=False)


from atomr_infer.cli import chat, deploy, lifecycle, status  # noqa: E402,F401  (up down deploy remove status logs chat)
from atomr_infer.cli import probe as _probe  # noqa: E402,F401  (registers `atomr probe`)
from atomr_infer.cli import serve as _serve  # noqa: E402,F401  (registers `atomr serve`)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
