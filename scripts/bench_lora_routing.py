"""Adapter-aware routing against adapter-blind power of two, end to end on real replicas.

Two CPU replicas of the bundled SmolLM2 (one thread each), LoRA on with more adapters than
slots (8 adapters of rank 8, random weights, ``max_loras`` 2, ``max_cpu_loras`` 8): a request
whose adapter has no slot waits until one frees. One deployment whose
``routing.adapter_affinity`` is switched in place between rounds; users send chats, each for an
adapter drawn uniformly, streamed through the ``Client`` (whose router applies the policy).
Reported per policy: TTFT p50/p90, output tokens/s, and the adapter swaps the routing caused
(counted over the sequence of (replica, adapter) the router chose, with an LRU of ``max_loras``
slots per replica, as vLLM keeps them; vLLM does not count its own); then the ratios.

    .venv/bin/python scripts/bench_lora_routing.py [--rounds 2] [--users 8] [--requests 12]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from scripts.bench_lora_swap import make_adapters  # noqa: E402

NAME = "bench-lora"
WORDS = ["river", "mountain", "system", "answer", "number", "people", "window", "garden", "letter", "market"]


def spec(adapters: dict[str, str], affinity: bool, slots: int) -> dict:
    return {
        "name": NAME, "model": "bundled:smollm2-135m-instruct", "device": "cpu", "replicas": 2,
        "runtime_config": {"max_model_len": 1024, "max_num_seqs": 16, "enforce_eager": True,
                           "cpu_kvcache_space_gb": 1, "cpu_threads": 1},
        "serving": {"max_concurrent": 16},
        "lora": {"adapters": adapters, "max_loras": slots, "max_lora_rank": 8, "max_cpu_loras": len(adapters)},
        "routing": {"adapter_affinity": affinity},
    }


class Routed:
    """The router's choices, in order: a measuring hook on the Client's own router."""

    def __init__(self) -> None:
        from atomr_infer.routing.picker import ReplicaPicker

        self.choices: list[tuple[str, str | None]] = []
        pick = ReplicaPicker.pick

        def recording(picker, dep, usable, loads, key, adapter=None, tokens=None):  # noqa: ANN001, ANN202
            choice = pick(picker, dep, usable, loads, key, adapter, tokens)
            if choice is not None:
                self.choices.append((choice.actor_name, adapter))
            return choice

        ReplicaPicker.pick = recording  # type: ignore[method-assign]

    def swaps(self, since: int, slots: int) -> int:
        resident: dict[str, collections.OrderedDict[str, bool]] = collections.defaultdict(collections.OrderedDict)
        count = 0
        for replica, adapter in self.choices[since:]:
            held = resident[replica]
            if adapter in held:
                held.move_to_end(adapter)
                continue
            count += 1
            held[adapter] = True
            if len(held) > slots:
                held.popitem(last=False)
        return count


def run_round(cp, client, routed: Routed, adapters: dict[str, str], affinity: bool, salt: int, args) -> dict:
    cp.apply(spec(adapters, affinity, args.slots))  # in place: the same replicas, adapters and slots
    since = len(routed.choices)
    ttfts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def user(u: int) -> None:
        rng = random.Random(salt * 1000 + u)
        for _ in range(args.requests):
            adapter = f"a{rng.randrange(len(adapters))}"
            ask = [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(12)) + "?"}]
            started, first, used = time.perf_counter(), None, 0
            for chunk in client.stream_chat(f"{NAME}:{adapter}", ask, max_tokens=args.max_tokens, temperature=0.0,
                                            ignore_eos=True, stream_options={"include_usage": True}):
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
                if chunk.usage is not None:
                    used = chunk.usage.completion_tokens
            with lock:
                ttfts.append((first or time.perf_counter()) - started)
                tokens[0] += used

    started = time.perf_counter()
    threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    ttfts.sort()
    return {"affinity": affinity, "ttft_p50": statistics.median(ttfts), "ttft_p90": ttfts[int(0.9 * len(ttfts))],
            "tok_s": tokens[0] / wall, "swaps": routed.swaps(since, args.slots), "requests": len(ttfts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each policy, interleaved")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--slots", type=int, default=2, help="max_loras per replica")
    ap.add_argument("--users", type=int, default=8, help="concurrent streams")
    ap.add_argument("--requests", type=int, default=12, help="per user per round")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    import ray

    from atomr_infer.client import Client
    from atomr_infer.control.client import ControlPlane, manager_handle
    from atomr_infer.engine.cpu import machine_line
    from atomr_infer.models import prepare_bundled

    work = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    print(f"making {args.adapters} adapters ...", flush=True)
    paths = make_adapters(prepare_bundled("smollm2-135m-instruct"), args.adapters, 8, work)
    adapters = {p.name: str(p) for p in paths}
    os.environ.pop("RAY_ADDRESS", None)
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False,
             namespace="atomr", log_to_driver=False, logging_level="WARNING")
    try:
        cp = ControlPlane(manager_handle())
        cp.apply(spec(adapters, True, args.slots))
        print("starting 2 replicas and loading the adapters ...", flush=True)
        status = cp.wait_ready(NAME, 900)
        assert status is not None and status.replicas_ready == 2, status
        while any(set(r.adapters) != set(adapters) or set(r.adapters.values()) != {"loaded"}
                  for r in cp.status(NAME).replicas):
            time.sleep(0.5)
        routed, client = Routed(), Client(manager=cp.handle)
        results = []
        for round_ in range(args.rounds):
            for i, affinity in enumerate((False, True)):
                r = run_round(cp, client, routed, adapters, affinity, salt=1 + 2 * round_ + i, args=args)
                results.append(r)
                label = "adapter homes" if affinity else "power of two"
                print(f"round {round_ + 1} {label:>13}: TTFT p50 {r['ttft_p50'] * 1000:7.1f} ms, "
                      f"p90 {r['ttft_p90'] * 1000:7.1f} ms, {r['tok_s']:6.1f} output tok/s, "
                      f"{r['swaps']} swaps ({r['requests']} requests)", flush=True)
        client.close()

        def med(affinity: bool, key: str) -> float:
            return statistics.median(r[key] for r in results if r["affinity"] is affinity)

        print(f"\nCPU: {machine_line()}; {args.adapters} adapters, 2 replicas x max_loras {args.slots}, "
              f"{args.users} streams, {args.max_tokens} tokens a request, medians of {args.rounds} rounds")
        for key, label in (("ttft_p50", "TTFT p50"), ("ttft_p90", "TTFT p90"), ("tok_s", "output tok/s"),
                           ("swaps", "swaps")):
            home, blind = med(True, key), med(False, key)
            ratio = home / max(blind, 1e-9)
            print(f"{label:>14}: adapter homes {home:.4g} vs power of two {blind:.4g}: ratio {ratio:.3f}")
        cp.remove(NAME)
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
