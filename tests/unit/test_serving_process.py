"""A serving process's interpreter settings (replica/serving_process.py), each in a fresh
interpreter: they are process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = """
import gc, json, sys
from atomr_infer.replica.serving_process import tune_serving_process
first, again = tune_serving_process(), tune_serving_process()
print(json.dumps({"first": first, "again": again, "frozen": gc.get_freeze_count(),
                  "gen0": gc.get_threshold()[0], "switch": sys.getswitchinterval()}))
"""


def probe(**env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_startup_heap_is_frozen_and_threads_get_the_gil_sooner_once():
    got = probe()
    assert got["first"] is True and got["again"] is False
    assert got["frozen"] > 1000
    assert got["gen0"] == 10_000
    assert got["switch"] < 0.001  # CPython's default is 0.005


def test_it_can_be_turned_off_to_measure_without_it():
    got = probe(ATOMR_PROCESS_TUNING="0")
    assert got["first"] is False and got["frozen"] == 0
    assert got["gen0"] == 700 and abs(got["switch"] - 0.005) < 1e-9
