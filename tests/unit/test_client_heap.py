"""The Client freezes its process's heap once vLLM's types are loaded (client.py), each case in
a fresh interpreter: the collector's state is process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import gc, json
from atomr_infer.client import CHAT, COMPLETION
before = gc.get_freeze_count()
CHAT.model("chunk")
first = gc.get_freeze_count()
gc.unfreeze()  # a second freeze would show
COMPLETION.model("request")
print(json.dumps({"before": before, "first": first, "again": gc.get_freeze_count(), "gen0": gc.get_threshold()[0]}))
"""


def probe(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loading_vllms_types_freezes_the_heap_once_and_leaves_the_thresholds():
    got = probe()
    assert got["before"] == 0
    assert got["first"] > 100_000  # vLLM and torch: hundreds of thousands of objects
    assert got["again"] == 0  # once per process
    assert got["gen0"] == 700  # CPython's default: only the replica's own process changes it


def test_it_can_be_turned_off():
    got = probe(ATOMR_PROCESS_TUNING="0")
    assert got["first"] == 0 and got["again"] == 0
