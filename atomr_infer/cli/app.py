"""The ``atomr`` command line's Typer app and its conventions; ``cli/main.py`` registers the
commands (one module each) and is the entry point.

Exit codes: 0 ok, 1 failed, 2 invalid input, 3 rejected by a budget check, 130 interrupted.
Errors print one line, ``error: …``, with a hint where one helps; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import sys
import traceback
from typing import NoReturn

import typer
from rich.console import Console

from atomr_infer.errors import BudgetExceeded, SettingError, SpecError

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
    if isinstance(exc, SettingError):
        err.print(f"[red]error:[/] {_escape(str(exc))}", markup=True, emoji=False)
        raise typer.Exit(EXIT_INVALID)
    if isinstance(exc, KeyboardInterrupt):
        err.print("interrupted")
        raise typer.Exit(EXIT_INTERRUPTED)
    code = EXIT_BUDGET if isinstance(exc, BudgetExceeded) else EXIT_FAILED
    err.print(f"[red]error:[/] {_escape(str(exc) or type(exc).__name__)}", markup=True, emoji=False)
    raise typer.Exit(code)


def usage_error(message: str) -> NoReturn:
    """``error: message``, printed as given, and the usage exit code (2): before anything starts."""
    err.print(f"error: {message}", markup=False, emoji=False)
    raise typer.Exit(EXIT_INVALID)


def _escape(text: str) -> str:
    """``text`` printed as is in a markup line: brackets, and the backslashes before them."""
    from rich.markup import escape

    return escape(text)
