"""prefix_affinity against power_of_two on real replicas: multi-turn chat with long prefixes.

Two CPU replicas of the bundled SmolLM2 (one thread each), one deployment whose
``routing.policy`` is switched in place between rounds. Users hold conversations: a shared
system prompt, then a long document in the first message (each conversation its own, as in
chat over a file), then turns whose prompts carry the whole conversation so far. Each round
uses conversations of its own, so no round is served from another's cache. Reported per
policy: TTFT p50/p90 (first streamed token, through the ``Client``, whose router applies the
policy), vLLM's prefix-cache hit rate (prompt tokens found cached, from the replicas' stats)
and throughput (requests/s); then the ratios.

Prefill is chunked into steps of 256 tokens by default (``--max-batched-tokens``): one CPU
thread prefills a document's ~1,700 tokens in seconds, and with vLLM's CPU default of 2,048
tokens a step, every other request on the replica waits that long behind it, which no GPU
replica does (its steps of thousands of tokens take tens of milliseconds).

    .venv/bin/python scripts/bench_prefix_routing.py [--rounds 2] [--users 4]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NAME = "bench-prefix"
WORDS = [
    "river", "mountain", "system", "answer", "number", "people", "window", "garden", "letter", "market",
    "silver", "winter", "engine", "bridge", "island", "forest", "doctor", "camera", "planet", "signal",
    "record", "museum", "theory", "valley", "harbor", "station", "circle", "pocket", "shadow", "orange",
    "button", "castle", "ticket", "rocket", "candle", "ladder",
]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def spec(policy: str, max_batched_tokens: int | None = None) -> dict:
    runtime = {"max_model_len": 4096, "max_num_seqs": 16, "enforce_eager": True, "cpu_kvcache_space_gb": 1,
               "cpu_threads": 1}
    if max_batched_tokens:  # chunked prefill: a long prompt's prefill in steps of this many tokens
        runtime["extra_engine_args"] = {"max_num_batched_tokens": max_batched_tokens}
    return {
        "name": NAME, "model": "bundled:smollm2-135m-instruct", "device": "cpu", "replicas": 2,
        "runtime_config": runtime,
        "serving": {"max_concurrent": 16},
        "routing": {"policy": policy},
    }


def conversation(client, rng: random.Random, system: str, turns: int, doc_words: int, out: list) -> None:
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Read this:\n" + words(rng, doc_words) + "\nWhat is it about?"}]
    for turn in range(turns):
        started = time.perf_counter()
        first, text = None, []
        for chunk in client.stream_chat(NAME, messages, max_tokens=16, temperature=0.0):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text.append(chunk.choices[0].delta.content)
        out.append((first or time.perf_counter()) - started)
        messages += [{"role": "assistant", "content": "".join(text)},
                     {"role": "user", "content": words(rng, 40) + f" (question {turn + 2})"}]


def replica_cache(cp, ray) -> tuple[int, int]:
    """(prompt tokens, of them cached) summed over the deployment's replicas."""
    total = cached = 0
    for r in cp.status(NAME).replicas:
        if r.state == "ready":
            stats = ray.get(ray.get_actor(r.actor_name, namespace="atomr").stats.remote())
            total, cached = total + stats.prompt_tokens, cached + stats.prompt_tokens_cached
    return total, cached


def run_round(cp, client, ray, policy: str, salt: int, args) -> dict:
    cp.apply(spec(policy, args.max_batched_tokens))  # in place: the same replicas, another policy
    rng = random.Random(salt)
    system = "You answer questions about documents. " + words(rng, args.system_words)
    before = replica_cache(cp, ray)
    ttfts: list[float] = []
    started = time.perf_counter()

    def user(u: int) -> None:
        user_rng = random.Random(salt * 1000 + u)
        for _ in range(args.conversations):
            conversation(client, user_rng, system, args.turns, args.doc_words, ttfts)

    threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    after = replica_cache(cp, ray)
    prompt, cached = after[0] - before[0], after[1] - before[1]
    ttfts.sort()
    return {"policy": policy, "ttft_p50": statistics.median(ttfts), "ttft_mean": statistics.mean(ttfts),
            "ttft_p90": ttfts[int(0.9 * len(ttfts))],
            "hit_rate": cached / max(1, prompt), "rps": len(ttfts) / wall, "requests": len(ttfts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each policy, interleaved")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=3, help="per user per round")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--doc-words", type=int, default=1200)
    ap.add_argument("--system-words", type=int, default=200)
    ap.add_argument("--max-batched-tokens", type=int, default=256,
                    help="the replicas' max_num_batched_tokens; 0: vLLM's CPU default (2048 per step)")
    args = ap.parse_args()

    import ray

    from atomr_infer.client import Client
    from atomr_infer.control.client import ControlPlane, manager_handle
    from atomr_infer.engine.cpu import machine_line

    os.environ.pop("RAY_ADDRESS", None)
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False,
             namespace="atomr", log_to_driver=False, logging_level="WARNING")
    try:
        cp = ControlPlane(manager_handle())
        cp.apply(spec("power_of_two", args.max_batched_tokens))
        print("starting 2 replicas ...", flush=True)
        status = cp.wait_ready(NAME, 600)
        assert status is not None and status.replicas_ready == 2, status
        client = Client(manager=cp.handle)
        results = []
        for round_ in range(args.rounds):
            for i, policy in enumerate(("power_of_two", "prefix_affinity")):
                r = run_round(cp, client, ray, policy, salt=1 + 2 * round_ + i, args=args)
                results.append(r)
                print(f"round {round_ + 1} {policy:>16}: TTFT p50 {r['ttft_p50'] * 1000:7.1f} ms, "
                      f"mean {r['ttft_mean'] * 1000:7.1f} ms, "
                      f"p90 {r['ttft_p90'] * 1000:7.1f} ms, prefix-cache hit rate {r['hit_rate']:.3f}, "
                      f"{r['rps']:.2f} requests/s ({r['requests']} requests)", flush=True)
        client.close()
        by = {p: [r for r in results if r["policy"] == p] for p in ("power_of_two", "prefix_affinity")}

        def med(policy: str, key: str) -> float:
            return statistics.median(r[key] for r in by[policy])

        print(f"\nCPU: {machine_line()}; {args.users} users, {args.turns} turns, {args.doc_words}-word documents, "
              f"max_num_batched_tokens {args.max_batched_tokens or 'default'}, medians of {args.rounds} rounds")
        for key, label in (("ttft_p50", "TTFT p50"), ("ttft_mean", "TTFT mean"), ("ttft_p90", "TTFT p90"),
                           ("hit_rate", "prefix-cache hit rate"),
                           ("rps", "throughput (requests/s)")):
            pa, p2 = med("prefix_affinity", key), med("power_of_two", key)
            print(f"{label:>24}: prefix_affinity {pa:.4g} vs power_of_two {p2:.4g}: ratio {pa / p2:.3f}")
        cp.remove(NAME)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
