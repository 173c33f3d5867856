"""scripts/process_table.py: which processes count against issue 31's target (no process but the
replicas and their engine cores loads torch or vLLM), with the maps each has faked."""

from __future__ import annotations

import os

import psutil
import pytest

from scripts import process_table


@pytest.mark.parametrize(("maps", "counted"), [("cuda", False), ("torch,cuda", True), ("vllm", True), ("", False)])
def test_only_torch_or_vllm_outside_the_engines_counts(monkeypatch, capsys, maps, counted) -> None:
    """On an H200 Ray's dashboard agent maps libcuda (neither torch nor vLLM): stack_memory.py
    failed on every GPU node for it."""
    monkeypatch.setattr(process_table, "heavy", lambda pid: maps)
    monkeypatch.setattr(process_table, "role", lambda proc: "ray::DashboardAgent")
    _totals, loaded = process_table.table([psutil.Process(os.getpid())])
    assert bool(loaded) is counted
    assert ("libcuda alone: ray::DashboardAgent" in capsys.readouterr().out) is (maps == "cuda")
