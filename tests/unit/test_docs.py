"""The docs stay a site that builds and a map that stays short.

mkdocs.yml builds with ``strict: true`` and link validation: a broken link or anchor, or a page
left out of the nav, fails the build, as it does in ``make lint``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_MAP_LINES = 200
MAX_README_LINES = 200


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if mkdocs is None:
        pytest.fail("mkdocs is not installed (the dev extra: `make setup`)")
    proc = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "index.html").is_file()


@pytest.mark.parametrize(
    ("path", "limit"),
    [("docs/architecture.md", MAX_MAP_LINES), ("README.md", MAX_README_LINES)],
)
def test_the_map_and_the_readme_stay_short(path: str, limit: int) -> None:
    lines = len((ROOT / path).read_text().splitlines())
    assert lines < limit, f"{path} has {lines} lines; keep it under {limit} (reference goes to docs/)"
