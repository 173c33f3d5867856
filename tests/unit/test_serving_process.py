"""A serving process's interpreter settings (serving_process.py), and the heap freeze of a
Client's process (client.py), each in a fresh interpreter: they are process-wide."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SERVING = """
import gc, json, sys
from atomr_infer.serving_process import tune_serving_process
first, again = tune_serving_process(), tune_serving_process()
print(json.dumps({"first": first, "again": again, "frozen": gc.get_freeze_count(),
                  "gen0": gc.get_threshold()[0], "switch": sys.getswitchinterval()}))
"""

CLIENT = """
import gc, json
from atomr_infer.client import CHAT, COMPLETION
before, gen0 = gc.get_freeze_count(), gc.get_threshold()[0]
CHAT.model("chunk")
first = gc.get_freeze_count()
gc.unfreeze()  # a second freeze would show
COMPLETION.model("request")
print(json.dumps({"before": before, "first": first, "again": gc.get_freeze_count(),
                  "gen0_kept": gc.get_threshold()[0] == gen0}))
"""


def probe(script: str, **env: str) -> dict:
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_startup_heap_is_frozen_and_threads_get_the_gil_sooner_once():
    got = probe(SERVING)
    assert got["first"] is True and got["again"] is False
    assert got["frozen"] > 1000
    assert got["gen0"] == 10_000
    assert got["switch"] < 0.001  # CPython's default is 0.005


def test_it_can_be_turned_off_to_measure_without_it():
    got = probe(SERVING, ATOMR_PROCESS_TUNING="0")
    assert got["first"] is False and got["frozen"] == 0
    assert got["gen0"] == 700 and abs(got["switch"] - 0.005) < 1e-9


def test_a_client_freezes_its_process_heap_once_it_loads_vllms_types_and_only_that():
    got = probe(CLIENT)
    assert got["before"] == 0
    assert got["first"] > 100_000  # vLLM and torch: hundreds of thousands of objects
    assert got["again"] == 0  # once per process
    assert got["gen0_kept"]  # the caller's thresholds are its own


def test_a_clients_freeze_can_be_turned_off():
    got = probe(CLIENT, ATOMR_PROCESS_TUNING="0")
    assert got["first"] == 0 and got["again"] == 0
