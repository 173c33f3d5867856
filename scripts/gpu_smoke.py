#!/usr/bin/env python
"""The GPU smoke: the bundled model through every path a user takes, then both benchmarks, in one
table. Run it through scripts/gpu_smoke.sh, which picks the interpreter and stops everything on
exit (``--cleanup``).

    scripts/gpu_smoke.sh [--device cuda|cpu] [--skip-benchmarks]

On a private Ray head that it starts with ``atomr up`` on loopback (tests/atomr_head.py) and
stops with ``atomr down``: deploy eager, chat, serve over HTTP (plain and streamed), roll to CUDA
graphs, kill the replica and see it replaced, remove, two replicas on two GPUs and tensor
parallel over three (where the GPUs are), down; then ``bench_replica.py`` and ``bench_http.py
--no-rayllm`` in ``--quick`` mode on the device. The steps are tests/gpu/steps.py's, the ones
tests/gpu runs. Each step has a time limit; a step whose prerequisite failed is skipped. Prints
one row per step (ok / FAIL / skipped, seconds, a key figure) and exits 1 if any failed.
``--device cpu`` runs the same steps on vLLM's CPU backend (``make test`` does, so the plumbing
is tested on every change).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.atomr_head import AtomrHead  # noqa: E402 - after the path insert
from tests.gpu import steps  # noqa: E402

ENGINE_S = 600  # one engine start: ~30 s on 2 CPU cores or an H100 (eager), 82 s with CUDA graphs
BENCH_S = 900  # a quick benchmark run starts five engines


@dataclass
class Row:
    step: str
    result: str  # "ok", "FAIL" or "skipped"
    seconds: float
    figure: str


@dataclass
class Step:
    name: str
    run: Callable[[float], str]  # deadline -> key figure
    limit_s: float
    needs: tuple[str, ...] = ()


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 220 else text[:217] + "..."


def run_steps(plan: list[Step]) -> list[Row]:
    rows: list[Row] = []
    for step in plan:
        failed = [r.step for r in rows if r.step in step.needs and r.result != "ok"]
        if failed:
            rows.append(Row(step.name, "skipped", 0.0, f"needs {', '.join(failed)}"))
            continue
        print(f"--- {step.name} (limit {step.limit_s:.0f}s)", flush=True)
        started = time.monotonic()
        try:
            row = Row(step.name, "ok", 0.0, step.run(started + step.limit_s))
        except steps.Skipped as why:
            row = Row(step.name, "skipped", 0.0, str(why))
        except Exception as exc:  # noqa: BLE001 - a failed step is a row, and the next steps run
            row = Row(step.name, "FAIL", 0.0, one_line(exc))
        row.seconds = time.monotonic() - started
        print(f"    {row.result} in {row.seconds:.1f}s: {row.figure}", flush=True)
        rows.append(row)
    return rows


def prepare_model(deadline: float) -> str:
    """The bundled model converted (once per machine), so no later step times it."""
    code = "from atomr_infer.models import prepare_bundled; print(prepare_bundled('smollm2-135m-instruct'))"
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=steps.left(deadline), cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip()[-500:])
    return f"{proc.stdout.strip()} ({time.monotonic() - started:.0f}s)"


def run_script(args: list[str], log: Path, deadline: float) -> str:
    """A script in a session of its own, its output in ``log``; at the deadline Ctrl-C (its
    servers stop), then SIGKILL for the rest of its processes. Its output."""
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, *args], stdout=sink, stderr=subprocess.STDOUT, cwd=REPO,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        proc.wait(max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if proc.poll() is None:
            stop_tree(proc.pid)
    output = log.read_text()
    if proc.returncode != 0:
        tail = [ln for ln in output.splitlines() if ln.strip()][-3:]
        raise RuntimeError(f"exit {proc.returncode} (log {log}): " + " | ".join(tail))
    return output


def stop_tree(pid: int) -> None:
    """SIGINT to a process's group, then SIGKILL to what is left of it and its descendants."""
    with contextlib.suppress(psutil.Error):
        tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGINT)
        _, alive = psutil.wait_procs(tree, timeout=60)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=10)


def bench_replica(device: str, log: Path, deadline: float) -> str:
    out = run_script(["scripts/bench_replica.py", "--device", device, "--quick"], log, deadline)
    ratios = dict(re.findall(r"^ratio (\S+) @ \d+: ([\d.]+)$", out, re.MULTILINE))  # the largest size wins
    largest = re.findall(r"^ratio \S+ @ (\d+):", out, re.MULTILINE)
    if not ratios:
        raise RuntimeError(f"no ratios in its output (log {log})")
    return ", ".join(f"{k} {v}" for k, v in ratios.items()) + f" at {largest[-1]} prompts"


def bench_http(device: str, log: Path, deadline: float) -> str:
    out = run_script(["scripts/bench_http.py", "--device", device, "--quick", "--no-rayllm"], log, deadline)
    tput = re.findall(r"^c=(\d+)\s+output tok/s\s.*?([\d.]+)x$", out, re.MULTILINE)
    ttft = re.findall(r"^c=(\d+)\s+TTFT p50 ms\s.*?([\d.]+)x$", out, re.MULTILINE)
    if not tput:
        raise RuntimeError(f"no atomr/vllm ratios in its output (log {log})")
    cells = [f"c={c} tok/s {r}x" for c, r in tput] + [f"TTFT p50 {r}x" for c, r in ttft[-1:]]
    return "atomr/vllm serve " + ", ".join(cells)


def leftovers(head: AtomrHead) -> str:
    """Nothing of this run may outlive it: no child process, no process of its head."""
    children = psutil.Process().children(recursive=True)
    if children or head.running():
        names = [p.name() for p in children]
        stop_tree_all(children)
        head.down()
        raise RuntimeError(f"left running: {names or 'the head'} (now stopped)")
    return "no child process, no head process"


def stop_tree_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=10)


def print_table(rows: list[Row], device: str, total_s: float) -> None:
    width = max(len(r.step) for r in rows)
    print(f"\nGPU smoke, --device {device}: {sum(r.result == 'ok' for r in rows)} ok, "
          f"{sum(r.result == 'FAIL' for r in rows)} failed, {sum(r.result == 'skipped' for r in rows)} skipped "
          f"in {total_s:.0f}s")
    print(f"{'step':<{width}}  {'result':<7}  {'seconds':>7}  figure")
    for r in rows:
        print(f"{r.step:<{width}}  {r.result:<7}  {r.seconds:>7.1f}  {r.figure}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--skip-benchmarks", action="store_true", help="Leave out bench_replica and bench_http.")
    ap.add_argument("--workdir", type=Path, help="The head's state, Ray's temp dir and the logs: removed after "
                    "a run that passed, kept after one that failed (default: a new one in /tmp).")
    ap.add_argument("--cleanup", type=Path, metavar="WORKDIR",
                    help="Stop the head a run in WORKDIR may have left running (gpu_smoke.sh's exit trap).")
    opts = ap.parse_args()
    if opts.cleanup:
        port = opts.cleanup / "port"
        if port.exists():
            AtomrHead(opts.cleanup, int(port.read_text())).down()
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally-blocks run, as on Ctrl-C
    head = AtomrHead(opts.workdir)
    (head.workdir / "port").write_text(str(head.port))
    stack, logs = steps.Stack(head, opts.device), head.workdir
    d = opts.device
    plan = [
        Step("bundled model", prepare_model, 300),
        Step("up", lambda t: steps.start(stack, t), 180, ("bundled model",)),
        Step("deploy eager", lambda t: steps.deploy_eager(stack, t), ENGINE_S, ("up",)),
        Step("chat", lambda t: steps.chat(stack, t), 120, ("deploy eager",)),
        Step("serve HTTP", lambda t: steps.serve_http(stack, t), 300, ("deploy eager",)),
        Step("roll to CUDA graphs", lambda t: steps.roll_to_graphs(stack, t), ENGINE_S, ("deploy eager",)),
        Step("kill replica", lambda t: steps.replace_killed(stack, t), ENGINE_S, ("deploy eager",)),
        Step("remove", lambda t: steps.remove(stack, t), 180, ("deploy eager",)),
        Step("two replicas", lambda t: steps.two_replicas(stack, t), ENGINE_S, ("up",)),
        Step("tensor parallel", lambda t: steps.tensor_parallel(stack, t), ENGINE_S, ("up",)),
        Step("down", lambda t: steps.stop(stack, t), 300, ("up",)),
    ]
    if not opts.skip_benchmarks:
        plan += [
            Step("bench_replica --quick", lambda t: bench_replica(d, logs / "bench_replica.log", t), BENCH_S),
            Step("bench_http --quick", lambda t: bench_http(d, logs / "bench_http.log", t), BENCH_S),
        ]
    plan.append(Step("nothing left", lambda t: leftovers(head), 60))
    started = time.monotonic()
    try:
        rows = run_steps(plan)
    finally:
        head.down()
    print_table(rows, d, time.monotonic() - started)
    if any(r.result == "FAIL" for r in rows):
        print(f"kept for a look: {head.workdir} (the logs of the benchmarks and of Ray)")
        return 1
    shutil.rmtree(head.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
