"""A Hugging Face hub cache laid out as huggingface_hub lays it out, offline: the real library
reads it; only the Hub itself (out of reach here) is missing. The ``offline_hub`` fixture
(conftest.py) is such a cache, empty."""

from __future__ import annotations

from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_snapshot(
    cache: Path, repo: str, files: dict[str, str | bytes], ref: str = "main", commit: str = COMMIT
) -> Path:
    """Lay out ``repo`` in a hub cache the way huggingface_hub does (refs/<ref> → snapshots/<commit>)."""
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, content in files.items():
        if isinstance(content, bytes):
            (snapshot / name).write_bytes(content)
        else:
            (snapshot / name).write_text(content)
    return snapshot
