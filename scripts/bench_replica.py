#!/usr/bin/env python
"""Throughput of a VllmReplica (and the Client's router) against raw ``vllm.LLM``, in one run.

    .venv/bin/python scripts/bench_replica.py [--sizes 64,256,1024:32] [--tokens 64]
                                              [--device cpu|cuda] [--graphs] [--quick]

A size is N prompts, or N:T for N prompts of T tokens each (else --tokens). ``--device cuda``
runs every arm on the GPU (tests/device_spec.py: the spec with ``gpu_memory_utilization`` 0.3),
``--graphs`` with CUDA graphs instead of eager, ``--quick`` a smoke run (``--sizes 8:16,32:16``).

(a) raw ``vllm.LLM.generate`` of N prompts x T tokens (ignore_eos), in its own process;
(b) the same N requests through the engine interface of a ``VllmReplica`` (engine/backend.py
    ``generate``: atomr's step loop and vLLM's output processing, no serving layer, no
    transport), in a process of its own (it replaces the replica actor's token-level path that
    issue 30 deleted);
(c) the same through ``atomr_infer.Client`` (manager routing table → router → the replica's
    vLLM OpenAI server, streamed completions as ``atomr serve`` answers them).
All three use identical engine arguments (deployments/smollm2.yaml); (a) is ``vllm.LLM`` as a
user gets it (its engine core in a process of its own), while the replica of (b) and (c) runs
the core in its step loop's thread, as atomr does on CPU. Prints output tokens/s
for each and the ratios against (a) last. Also the median latency of 20 re-applies of an
unchanged spec. Machines here are noisy: compare ratios from one run, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import types

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tests.device_spec import add_device_options  # noqa: E402 - after the path insert

QUICK_SIZES = "8:16,32:16"


def prompts(n: int, arm: str) -> list[str]:
    """n prompts no other arm or size sends: each starts with its own tag, so vLLM's prefix
    cache (on by default) never serves one arm from another's run."""
    return [f"{arm}{n}-{i}: write a short story about a lighthouse keeper." for i in range(n)]


def spec(opts: argparse.Namespace):  # noqa: ANN201 - a Deployment
    """deployments/smollm2.yaml on ``--device``; on cuda the GPU is shared (the raw arm's
    process may not have let go of its memory when the replica starts)."""
    from tests.device_spec import SHARED_GPU_MEMORY, smollm2_on

    return smollm2_on(opts.device, graphs=opts.graphs, gpu_memory_utilization=SHARED_GPU_MEMORY)


def parse_sizes(text: str, tokens: int) -> dict[int, int]:
    """"64,1024:32" -> {64: tokens, 1024: 32}: prompts -> tokens per prompt."""
    out = {}
    for item in text.split(","):
        n, _, t = item.partition(":")
        out[int(n)] = int(t) if t else tokens
    return out


def raw_main(sizes: dict[int, int], opts: argparse.Namespace) -> None:
    """Child process: raw vllm.LLM throughput for each size, as one JSON line."""
    from vllm import LLM, SamplingParams

    from atomr_infer.engine.vllm.engine_args import engine_args
    from atomr_infer.models import prepare_bundled

    args = engine_args(spec(opts), str(prepare_bundled("smollm2-135m-instruct")), opts.device)
    llm = LLM(**args)
    llm.generate(["warm up"], SamplingParams(max_tokens=8), use_tqdm=False)
    out = {}
    for n, tokens in sizes.items():
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
        started = time.perf_counter()
        results = llm.generate(prompts(n, "raw"), params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        out[n] = sum(len(r.outputs[0].token_ids) for r in results) / elapsed
    print("BENCH_RESULT " + json.dumps(out), flush=True)  # vLLM prints to stdout too


async def through(stream_fn, n: int, tokens: int, arm: str) -> float:
    """Output tokens/s of n concurrent requests; stream_fn(request) yields objects with token_ids."""
    async def one(p: str) -> int:
        count = 0
        async for chunk in stream_fn({"prompt": p, "max_tokens": tokens, "ignore_eos": True, "temperature": 0}):
            count += len(chunk.token_ids)
        return count

    started = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts(n, arm)))
    return sum(counts) / (time.perf_counter() - started)


def backend_main(sizes: dict[int, int], opts: argparse.Namespace) -> None:
    """Child process: a VllmReplica's backend, driven through the engine interface."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from atomr_infer.replica.actor import VllmReplica

    replica = VllmReplica(spec(opts), "bench")

    async def via_backend(req):
        params = SamplingParams(max_tokens=req["max_tokens"], ignore_eos=True, temperature=0,
                                output_kind=RequestOutputKind.DELTA)
        async for output in replica._backend.generate(req["prompt"], params, f"b-{time.monotonic_ns()}"):
            yield output.outputs[0]

    async def run_all() -> dict[int, float]:
        await replica.ready(600)
        await through(via_backend, 4, 8, "warm-backend")
        out = {n: await through(via_backend, n, tokens, "backend") for n, tokens in sizes.items()}
        await replica.shutdown()
        return out

    print("BENCH_RESULT " + json.dumps(asyncio.run(run_all())), flush=True)


def child(flag: str, opts: argparse.Namespace) -> dict[int, float]:
    proc = subprocess.run(
        [sys.executable, __file__, flag, "--sizes", opts.sizes, "--tokens", str(opts.tokens),
         "--device", opts.device, *(["--graphs"] if opts.graphs else [])],
        capture_output=True, text=True, check=True,
    )
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_RESULT "))
    return {int(k): v for k, v in json.loads(line.removeprefix("BENCH_RESULT ")).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="64,256,1024:32")
    ap.add_argument("--tokens", type=int, default=64)
    add_device_options(ap)
    ap.add_argument("--quick", action="store_true", help=f"A smoke run: --sizes {QUICK_SIZES} (ratios mean little).")
    ap.add_argument("--raw-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend-child", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.quick:
        opts.sizes = QUICK_SIZES
    sizes = parse_sizes(opts.sizes, opts.tokens)
    if opts.raw_child:
        raw_main(sizes, opts)
        return
    if opts.backend_child:
        backend_main(sizes, opts)
        return

    print(f"device {opts.device}, {'CUDA graphs' if opts.graphs else 'eager'}", flush=True)
    print(f"(a) raw vllm.LLM, {', '.join(f'{n}x{t}' for n, t in sizes.items())} prompts x tokens ...", flush=True)
    raw = child("--raw-child", opts)
    print("    " + ", ".join(f"{n} prompts: {v:.1f} tok/s" for n, v in raw.items()), flush=True)
    rep = child("--backend-child", opts)
    print("(b) VllmReplica's backend: " + ", ".join(f"{n} prompts: {v:.1f} tok/s" for n, v in rep.items()), flush=True)

    import ray

    from atomr_infer.client import Client
    from atomr_infer.control.client import manager_handle as get_manager

    os.environ.pop("RAY_ADDRESS", None)
    ray.init(
        address="local", _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
        logging_level="ERROR",
    )
    try:
        manager = get_manager()
        d = spec(opts)
        ray.get(manager.apply.remote(d))
        ray.get(manager.wait_ready.remote(d.name, 600))
        client = Client(manager=manager)

        async def via_client(req):
            # The OpenAI path (vLLM's serving layer in the replica, SSE back): count the usage.
            prompt = req.pop("prompt")
            async for chunk in client.astream_complete(d.name, prompt, **req, stream_options={"include_usage": True}):
                if chunk.usage is not None:
                    yield types.SimpleNamespace(token_ids=range(chunk.usage.completion_tokens))

        async def run_all():
            await through(via_client, 4, 8, "warm-client")
            cli = {}
            for n, tokens in sizes.items():
                cli[n] = await through(via_client, n, tokens, "client")
                print(f"(c) Client (router), {n} prompts: {cli[n]:.1f} tok/s", flush=True)
            return cli

        cli = asyncio.run(run_all())
        latencies = []
        for _ in range(20):
            started = time.perf_counter()
            result = ray.get(manager.apply.remote(d))
            latencies.append((time.perf_counter() - started) * 1000)
            assert not result.changed
        ray.get(manager.remove.remote(d.name))
        time.sleep(2)
    finally:
        ray.shutdown()

    from atomr_infer.engine.cpu import machine_line

    print(f"\nCPU: {machine_line()}")
    print(f"{'prompts':>8} {'raw tok/s':>10} {'backend':>10} {'client':>10} {'backend/raw':>12} {'client/raw':>11}")
    for n in sizes:
        r, c = rep[n] / raw[n], cli[n] / raw[n]
        print(f"{n:>8} {raw[n]:>10.1f} {rep[n]:>10.1f} {cli[n]:>10.1f} {r:>12.3f} {c:>11.3f}")
    print(f"\nre-apply of an unchanged spec: median {statistics.median(latencies):.1f} ms over 20 "
          f"(min {min(latencies):.1f}, max {max(latencies):.1f})")
    for n in sizes:
        print(f"ratio backend/raw @ {n}: {rep[n] / raw[n]:.3f}")
    for n in sizes:
        print(f"ratio client/raw @ {n}: {cli[n] / raw[n]:.3f}")


if __name__ == "__main__":
    main()
