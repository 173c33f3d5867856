"""The module layout stays as docs/architecture.md draws it: no import cycles, small modules."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "atomr_infer"
MAX_LINES = 400


def test_no_import_cycles() -> None:
    # The contract in .importlinter, as `make lint` runs it: cycles among the modules of any
    # package, counting imports inside functions (they still tie the modules together).
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if lint is None:
        pytest.fail("lint-imports is not installed (the dev extra: `make setup`)")
    proc = subprocess.run([lint, "--no-cache"], cwd=PACKAGE.parent, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


def test_no_module_over_the_line_budget() -> None:
    sizes = {p.relative_to(PACKAGE.parent): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert len(sizes) > 40  # the walk found the package
    over = {str(p): n for p, n in sizes.items() if n > MAX_LINES}
    assert not over, over
