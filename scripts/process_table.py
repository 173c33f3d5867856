"""One row per process: what it is, its memory (PSS), and whether it maps torch, vLLM's
compiled code or libcuda. Printed by scripts/stack_memory.py and scripts/bench_http.py."""

from __future__ import annotations

import collections
import contextlib
import os
from pathlib import Path

import psutil

HEAVY = {"torch": ("libtorch_cpu.so", "libtorch_cuda.so"), "vllm": ("vllm/_C", "vllm/_moe_C"), "cuda": ("libcuda.so",)}
# The replicas and what they start: vLLM titles its processes VLLM::EngineCore_DP0, VLLM::Worker_TP0.
ENGINE_SIDE = ("ray::VllmReplica", "VLLM::", "EngineCore")


def role(proc: psutil.Process) -> str:
    """A short name for what the process is (Ray's process titles, else its command)."""
    with contextlib.suppress(psutil.Error):
        args = proc.cmdline()
        first = args[0] if args else proc.name()
        if first.startswith(("ray::", "ray-dashboard-", "VLLM::")):
            return first.split(" (")[0].split("(")[0]
        if "EngineCore" in proc.name() or "VLLM" in proc.name().upper():
            return proc.name()
        joined = " ".join(args)
        for name in ("gcs_server", "raylet", "dashboard.py", "log_monitor", "monitor.py", "client.server",
                     "forkserver", "atomr"):
            if name in joined:
                return name
        return os.path.basename(first)
    return "?"


def heavy(pid: int) -> str:
    """Which of torch, vLLM's compiled code and libcuda the process has mapped."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""
    return ",".join(name for name, files in HEAVY.items() if any(f in maps for f in files))


def engine_side(name: str) -> bool:
    return any(name.startswith(e) for e in ENGINE_SIDE)


def table(procs: list[psutil.Process]) -> tuple[dict[str, float], list[str]]:
    """Prints one row per process (the engines' last) and the two totals; returns them, and
    the processes other than the engines' that map torch or vLLM (the target, issue 31). libcuda
    alone is shown, not counted: on a GPU node Ray's dashboard agent maps it (seen on an H200)."""
    rows = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            rows.append((role(proc), proc.pid, proc.memory_full_info().pss / 2**30, heavy(proc.pid)))
    rows.sort(key=lambda r: (engine_side(r[0]), -r[2]))
    totals = {"engines": 0.0, "rest": 0.0}
    print(f"{'process':<40} {'pid':>8} {'PSS GiB':>8}  maps")
    for name, pid, pss, libs in rows:
        totals["engines" if engine_side(name) else "rest"] += pss
        print(f"{name[:40]:<40} {pid:>8} {pss:>8.3f}  {libs}")
    rest = [r for r in rows if not engine_side(r[0])]
    loaded = [f"{name} ({libs})" for name, _, _, libs in rest if {"torch", "vllm"} & set(libs.split(","))]
    cuda = [name for name, _, _, libs in rest if libs == "cuda"]
    idle = sum(1 for r in rest if r[0] == "ray::IDLE")
    print(f"replicas and engine cores: {totals['engines']:.2f} GiB; everything else: {totals['rest']:.2f} GiB "
          f"(target <= 1.0) in {len(rest)} processes, {idle} of them idle Ray workers")
    print("torch/vLLM outside the replicas: " + (", ".join(loaded) if loaded else "none")
          + (f" (libcuda alone: {', '.join(cuda)})" if cuda else ""))
    return totals, loaded


def cpu_seconds() -> dict[int, tuple[str, float]]:
    """Every process's CPU time so far (user + system), with its role."""
    out = {}
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            out[proc.pid] = (role(proc), times.user + times.system)
    return out


def cpu_used(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> collections.Counter:
    """CPU seconds each role used between two ``cpu_seconds()``, summed over its processes."""
    used: collections.Counter = collections.Counter()
    for pid, (name, seconds) in after.items():
        used[name] += seconds - before.get(pid, (name, 0.0))[1]
    return used
