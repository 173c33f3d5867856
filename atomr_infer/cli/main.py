"""The ``atomr`` entry point: the Typer app (``cli/app.py``) with every command registered.

Each command module registers itself on ``app`` when imported; only this module imports them
all, so the commands depend on ``app`` and never the other way round.
"""

from __future__ import annotations

import sys

from atomr_infer.cli import chat, deploy, lifecycle, probe, serve, status, validate  # noqa: F401 - registers the commands
from atomr_infer.cli.app import EXIT_INTERRUPTED, app, err


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
