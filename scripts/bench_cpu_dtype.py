#!/usr/bin/env python
"""Output tokens/s of vLLM's CPU backend in bfloat16 and in float32, on this CPU, in one run.

    .venv/bin/python scripts/bench_cpu_dtype.py [--prompts 64] [--tokens 64] [--rounds 2]

What ``dtype: auto`` on CPU chooses between (engine/cpu.py): bf16 where the CPU has native bf16
instructions, float32 elsewhere. Each dtype runs raw ``vllm.LLM`` (deployments/smollm2.yaml's
engine arguments, the bundled model) in a process of its own; rounds alternate the two so
machine drift hits both. Prints the CPU, each round, the medians and float32/bf16.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def child(dtype: str, n: int, tokens: int) -> None:
    from vllm import LLM, SamplingParams

    from atomr_infer.engine.vllm.engine_args import engine_args
    from atomr_infer.models import prepare_bundled
    from atomr_infer.spec import load_deployments

    spec = load_deployments(os.path.join(REPO, "deployments", "smollm2.yaml"))[0]
    args = {**engine_args(spec, str(prepare_bundled("smollm2-135m-instruct")), "cpu"), "dtype": dtype}
    llm = LLM(**args)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    llm.generate(["warm up"], params, use_tqdm=False)
    prompts = [f"Write a short story about a lighthouse keeper named Keeper{i}." for i in range(n)]
    started = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    rate = sum(len(r.outputs[0].token_ids) for r in results) / (time.perf_counter() - started)
    print("BENCH_RESULT " + json.dumps(rate), flush=True)


def run(dtype: str, n: int, tokens: int) -> float:
    cmd = [sys.executable, __file__, "--child", dtype, "--prompts", str(n), "--tokens", str(tokens)]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_RESULT "))
    return float(json.loads(line.removeprefix("BENCH_RESULT ")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child:
        child(opts.child, opts.prompts, opts.tokens)
        return
    from atomr_infer.engine.cpu import auto_bf16, cpu_dtype, machine_line

    print(f"CPU: {machine_line()}; dtype auto picks {cpu_dtype('auto', auto_bf16())}")
    print(f"{opts.prompts} prompts x {opts.tokens} tokens, raw vllm.LLM, {opts.rounds} rounds")
    rates: dict[str, list[float]] = {"bfloat16": [], "float32": []}
    for r in range(opts.rounds):
        for dtype in (("bfloat16", "float32") if r % 2 == 0 else ("float32", "bfloat16")):
            rates[dtype].append(run(dtype, opts.prompts, opts.tokens))
            print(f"  round {r + 1} {dtype:>8}: {rates[dtype][-1]:.1f} tok/s", flush=True)
    bf16, fp32 = statistics.median(rates["bfloat16"]), statistics.median(rates["float32"])
    print(f"median: bfloat16 {bf16:.1f} tok/s, float32 {fp32:.1f} tok/s, float32/bf16 {fp32 / bf16:.2f}")


if __name__ == "__main__":
    main()
