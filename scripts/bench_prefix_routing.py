"""Prefix-aware routing on real replicas: prefix_affinity and kv_events against power_of_two.

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

Workloads: ``chat`` (above) and ``shared`` (cache pressure, issue 35): many users ask about a
few long documents (Zipf popularity), one question each, against a KV cache small enough
(``--kv-gb``, 0.1 GB in bfloat16: about three documents a replica; twice that where the CPU lacks
native bf16 and the replicas run float32, so that it holds as many tokens) that documents evict each other, through
``--routers`` routers (a Client each; every request through a random one, as behind several
ingress replicas). Each round starts with every replica's prefix cache reset.

    .venv/bin/python scripts/bench_prefix_routing.py [--rounds 2] [--users 4]
    .venv/bin/python scripts/bench_prefix_routing.py --workload shared --routers 4 \
        --policies prefix_affinity kv_events
"""

from __future__ import annotations

import argparse
import collections
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


def spec(policy: str, max_batched_tokens: int | None = None, kv_gb: float = 1.0) -> dict:
    runtime = {"max_model_len": 4096, "max_num_seqs": 16, "enforce_eager": True, "cpu_kvcache_space_gb": kv_gb,
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


def shared_documents(clients, rng: random.Random, system: str, documents: list[str], asks: int, out: list) -> None:
    """``asks`` questions, each about a document drawn by Zipf popularity, each through a random router."""
    weights = [1 / (i + 1) for i in range(len(documents))]
    for _ in range(asks):
        document = rng.choices(documents, weights)[0]
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": "Read this:\n" + document + "\nQuestion: " + words(rng, 12) + "?"}]
        started = time.perf_counter()
        first = None
        for chunk in rng.choice(clients).stream_chat(NAME, messages, max_tokens=4, temperature=0.0):
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
        out.append((first or time.perf_counter()) - started)


def replica_cache(cp, ray) -> tuple[int, int]:
    """(prompt tokens, of them cached) summed over the deployment's replicas."""
    total = cached = 0
    for r in cp.status(NAME).replicas:
        if r.state == "ready":
            stats = ray.get(ray.get_actor(r.actor_name, namespace="atomr").stats.remote())
            total, cached = total + stats.prompt_tokens, cached + stats.prompt_tokens_cached
    return total, cached


def route_reasons(clients) -> collections.Counter:
    """How the routers of ``clients`` decided so far (reason -> requests), summed."""
    total: collections.Counter = collections.Counter()
    for client in clients:
        for router in client._routers.values():  # one per event loop the Client ran on
            total.update({reason: n for (_, reason), n in router.route_reasons.items()})
    return total


def run_round(cp, clients, ray, policy: str, salt: int, args) -> dict:
    cp.apply(spec(policy, args.max_batched_tokens, args.kv_gb))  # in place: the same replicas, another policy
    rng = random.Random(salt)
    system = "You answer questions about documents. " + words(rng, args.system_words)
    documents = [words(rng, args.doc_words) for _ in range(args.documents)]
    if args.workload == "shared":
        cp.reset_prefix_cache(NAME)  # every policy starts cold
        time.sleep(1.0)
    before, reasons = replica_cache(cp, ray), route_reasons(clients)
    ttfts: list[float] = []
    started = time.perf_counter()

    def user(u: int) -> None:
        user_rng = random.Random(salt * 1000 + u)
        if args.workload == "shared":
            shared_documents(clients, user_rng, system, documents, args.asks, ttfts)
            return
        for _ in range(args.conversations):
            conversation(user_rng.choice(clients), user_rng, system, args.turns, args.doc_words, ttfts)

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
            "hit_rate": cached / max(1, prompt), "rps": len(ttfts) / wall, "requests": len(ttfts),
            "reasons": dict(route_reasons(clients) - reasons)}


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
    ap.add_argument("--policies", nargs="+", default=["power_of_two", "prefix_affinity"],
                    choices=["power_of_two", "prefix_affinity", "kv_events"], help="the first is the baseline")
    ap.add_argument("--workload", choices=["chat", "shared"], default="chat")
    ap.add_argument("--routers", type=int, default=1, help="Clients (routers) requests are spread over")
    ap.add_argument("--documents", type=int, default=8, help="shared: the documents users ask about")
    ap.add_argument("--asks", type=int, default=8, help="shared: questions per user per round")
    ap.add_argument("--kv-gb", type=float, default=None,
                    help="each replica's KV cache (GB); default 1, or for the shared workload 0.1 in bfloat16 "
                         "(0.2 in float32, on a CPU without native bf16: as many tokens)")
    args = ap.parse_args()
    if args.kv_gb is None:
        from atomr_infer.engine.cpu import DTYPE_BYTES, auto_bf16, cpu_dtype

        # The same tokens in either dtype: the replicas run the CPU's native one (engine/cpu.py).
        args.kv_gb = 0.1 * DTYPE_BYTES[cpu_dtype(None, auto_bf16())] / 2 if args.workload == "shared" else 1.0

    import ray

    from atomr_infer.client import Client
    from atomr_infer.control.client import ControlPlane, manager_handle
    from atomr_infer.engine.cpu import machine_line

    os.environ.pop("RAY_ADDRESS", None)
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False,
             namespace="atomr", log_to_driver=False, logging_level="WARNING")
    try:
        cp = ControlPlane(manager_handle())
        cp.apply(spec(args.policies[0], args.max_batched_tokens, args.kv_gb))
        print("starting 2 replicas ...", flush=True)
        status = cp.wait_ready(NAME, 600)
        assert status is not None and status.replicas_ready == 2, status
        clients = [Client(manager=cp.handle) for _ in range(args.routers)]
        results = []
        for round_ in range(args.rounds):
            for i, policy in enumerate(args.policies):
                # shared: the same documents and questions for every policy of a round (each starts
                # with the caches reset); chat: conversations of its own (no cache to reset between).
                salt = 1 + round_ if args.workload == "shared" else 1 + len(args.policies) * round_ + i
                r = run_round(cp, clients, ray, policy, salt=salt, args=args)
                results.append(r)
                print(f"round {round_ + 1} {policy:>16}: TTFT p50 {r['ttft_p50'] * 1000:7.1f} ms, "
                      f"mean {r['ttft_mean'] * 1000:7.1f} ms, "
                      f"p90 {r['ttft_p90'] * 1000:7.1f} ms, prefix-cache hit rate {r['hit_rate']:.3f}, "
                      f"{r['rps']:.2f} requests/s ({r['requests']} requests); routed {r['reasons']}", flush=True)
        for client in clients:
            client.close()
        by = {p: [r for r in results if r["policy"] == p] for p in args.policies}

        def med(policy: str, key: str) -> float:
            return statistics.median(r[key] for r in by[policy])

        shape = (f"{args.asks} questions each on {args.documents} shared documents, {args.kv_gb} GB of KV cache "
                 "a replica" if args.workload == "shared" else f"{args.turns} turns")
        print(f"\nCPU: {machine_line()}; {args.users} users, {shape}, {args.doc_words}-word documents, "
              f"{args.routers} router(s), max_num_batched_tokens {args.max_batched_tokens or 'default'}, "
              f"medians of {args.rounds} rounds")
        base = args.policies[0]
        for key, label in (("ttft_p50", "TTFT p50"), ("ttft_mean", "TTFT mean"), ("ttft_p90", "TTFT p90"),
                           ("hit_rate", "prefix-cache hit rate"),
                           ("rps", "throughput (requests/s)")):
            for policy in args.policies[1:]:
                got, against = med(policy, key), med(base, key)
                print(f"{label:>24}: {policy} {got:.4g} vs {base} {against:.4g}: ratio {got / against:.3f}")
        cp.remove(NAME)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
