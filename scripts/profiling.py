"""What a benchmark's servers spend their CPU on while under load: CPU time by process, and
py-spy profiles of the processes on the request path. Used by scripts/bench_http.py
(``--cpu-by-process``, ``--profile DIR``) to find where a stack falls behind (issue 31: atomr
behind ``vllm serve`` at a 2 ms GPU step).

A process that used about one CPU second per second of load was busy the whole time: its one
event loop (its GIL) is then what sets the pace, however many cores the host has.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
from process_table import cpu_seconds, cpu_used, role

# Where a Ray stack's request path starts, by process_table.role's names; their children (a GPU
# replica's engine core) are on it too. vllm serve's is its server process and its children.
PATH_ROOTS = {
    "atomr": ("ray::VllmReplica", "ray::ServeReplica:atomr-openai"),
    "rayllm": ("ray::ServeReplica:", "ray::ProxyActor"),
}


@contextlib.contextmanager
def cpu_during(label: str) -> Iterator[None]:
    """Print the CPU seconds per second of wall time of the busiest processes while the block ran."""
    before, started = cpu_seconds(), time.monotonic()
    yield
    wall = time.monotonic() - started
    used = cpu_used(before, cpu_seconds())
    busiest = ", ".join(f"{name} {seconds / wall:.2f}" for name, seconds in used.most_common(5) if seconds > 0)
    print(f"    CPU s/s over {wall:.1f} s ({label}): {busiest}", flush=True)


def path_processes(server: str, root: int | None) -> list[psutil.Process]:
    """The processes on ``server``'s request path, and their children."""
    roots = []
    if root is not None and server == "vllm":
        with contextlib.suppress(psutil.Error):
            roots = [psutil.Process(root)]
    else:
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                name = role(proc)
                if name.startswith(PATH_ROOTS.get(server, ())) and not (
                        server != "atomr" and name.startswith(PATH_ROOTS["atomr"])):
                    roots.append(proc)
    found = {}
    for proc in roots:
        with contextlib.suppress(psutil.Error):
            for each in (proc, *proc.children(recursive=True)):
                found[each.pid] = each
    return list(found.values())


@contextlib.contextmanager
def profiled(server: str, root: int | None, out: Path, rate: int = 100) -> Iterator[None]:
    """py-spy records each process on ``server``'s path while the block runs (``--nonblocking``:
    the process is not paused to be sampled), then writes speedscope files to ``out`` and prints
    each one's heaviest functions. Nothing when py-spy is missing (said once)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")  # the venv's, off PATH
    if not os.path.exists(spy):
        print("    (no py-spy: no profile)", flush=True)
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    recorders = []
    for proc in path_processes(server, root):
        name = role(proc).replace("::", "-").replace("/", "-").replace(":", "-")
        with contextlib.suppress(psutil.Error):  # Ray sets OMP_NUM_THREADS to an actor's num_cpus
            env = proc.environ()
            threads = {k: env[k] for k in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES") if k in env}
            print(f"    {name} ({proc.pid}): {proc.num_threads()} threads; {threads or 'no OMP/CUDA settings'}")
        path = out / f"{server}-{name}-{proc.pid}.json"
        cmd = [spy, "record", "--nonblocking", "--rate", str(rate), "--format", "speedscope", "--output", str(path),
               "--pid", str(proc.pid)]
        recorders.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), path))
    try:
        yield
    finally:
        for rec, _ in recorders:
            rec.send_signal(signal.SIGINT)  # py-spy writes its file on Ctrl-C
        for rec, path in recorders:
            try:
                _, err = rec.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                rec.kill()
                err = b"timed out writing"
            if path.exists():
                print(f"    profile {path.name}: {heaviest(path)}", flush=True)
            else:
                print(f"    profile {path.name}: none ({err.decode(errors='replace').strip()[-200:]})", flush=True)


def heaviest(path: Path, top: int = 6, threads: int = 3) -> str:
    """The functions with the most samples by own time in the file's ``threads`` busiest threads
    (function (file:line) share of that thread's samples)."""
    doc = json.loads(path.read_text())
    frames = doc["shared"]["frames"]
    profiles = sorted((p for p in doc.get("profiles", []) if p.get("samples")), key=lambda p: -len(p["samples"]))
    if not profiles:
        return "no samples"
    shown = []
    for profile in profiles[:threads]:
        own: collections.Counter = collections.Counter()
        for stack in profile["samples"]:
            if stack:
                frame = frames[stack[-1]]
                own[f"{frame['name']} ({Path(frame.get('file') or '?').name}:{frame.get('line', '?')})"] += 1
        total = len(profile["samples"])
        top_own = "; ".join(f"{name} {count / total:.0%}" for name, count in own.most_common(top))
        shown.append(f"[{profile.get('name', '?')}, {total} samples: {top_own}]")
    return " ".join(shown)
