"""The ``atomr`` entry point: the Typer app (``cli/app.py``) with every command registered.

Each command module registers itself on ``app`` when imported; only this module imports them
all, so the commands depend on ``app`` and never the other way round.
"""

from __future__ import annotations

import sys

import typer

from atomr_infer.cli import cache, chat, deploy, lifecycle, probe, serve, status, validate  # noqa: F401 - registers the commands
from atomr_infer.cli.app import EXIT_FAILED, EXIT_INTERRUPTED, app, err, fail
from atomr_infer.cli.common import cannot_import
from atomr_infer.errors import AtomrError


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(EXIT_INTERRUPTED)
    except AtomrError as exc:  # one a command let through (a manager gone mid-wait): a line, as every error
        try:
            fail(exc)
        except typer.Exit as done:
            sys.exit(done.exit_code)
    except ImportError as exc:  # a part of Ray, vLLM or torch this host cannot load: one line
        if (exc.name or "").startswith("atomr_infer"):
            raise  # a bug of atomr's own, not this host's: its traceback
        what = exc.name or "a part of Ray, vLLM or torch"
        err.print(f"error: {cannot_import(what, exc)} (hint: `atomr probe` checks this host; `make setup` repairs it)",
                  markup=False)
        sys.exit(EXIT_FAILED)


if __name__ == "__main__":
    main()
