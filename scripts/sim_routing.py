"""Routing policies against simulated replicas, from 2 to 1,000 of them.

The policies are atomr's own code (``routing/policy.py``, ``routing/prefix.py``), run against
simulated replicas: each has a prefix cache of KV blocks with LRU eviction, a prefill server
(time per uncached prompt token: a request's first token waits for the prefills before it and
its own) and continuous-batched decode (time per output token, which holds the request in
flight). The workload is multi-turn chat: conversations start as a Poisson stream sized to the
replica count, each opens with one of a few shared system prompts (Zipf popularity), and each
turn's prompt is the whole conversation so far (user and assistant lengths drawn lognormal,
as LLM chats are), sent after a think time. Several routers share the traffic, each with its
own index, as several ingress replicas would.

Policies: ``power_of_two`` (atomr's default), ``consistent_hash`` (rendezvous hashing of the
conversation, no load bound: the hot-spot baseline), ``prefix_affinity``, and ``oracle``
(knows every replica's cache: the longest cached prefix among replicas within the same load
bound). Reported per size: prefix hit rate (prompt tokens served from cache), max/mean and
p99/mean load (request-seconds in flight per replica while requests arrive, after a warm-up:
the load the routers place, not the empty start nor the drain after the last request), and
simulated TTFT p50/p99.

    .venv/bin/python scripts/sim_routing.py                  # 2, 10, 100 and 1,000 replicas
    .venv/bin/python scripts/sim_routing.py --replicas 1000 --turns-per-replica 30
"""

from __future__ import annotations

import argparse
import collections
import functools
import heapq
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atomr_infer.routing.channel import LOAD_FRESH_S  # noqa: E402
from atomr_infer.routing.kv_index import BlockRemoved, BlockStored, KVEventBatch, KvIndex, chain  # noqa: E402
from atomr_infer.routing.kv_policy import QueuedPrefill, pick_by_depth  # noqa: E402
from atomr_infer.routing.policy import pick_replica  # noqa: E402
from atomr_infer.routing.prefix import (  # noqa: E402
    PrefixIndex,
    PromptKey,
    load_cap,
    pick_prefix_affinity,
    rendezvous_order,
)

BLOCK_TOKENS = 64  # tokens per block (routing/prefix.py's 256 characters)


@dataclass
class Config:
    replicas: int
    routers: int = 4
    turns_per_replica: int = 100  # requests simulated per replica
    system_prompts: int = 8
    system_tokens: tuple[int, int] = (1024, 3072)  # uniform
    user_tokens_median: float = 150
    output_tokens_median: float = 200
    turns_median: float = 4
    think_s: float = 8.0  # mean, exponential
    prefill_s_per_token: float = 0.00025  # 4k tokens/s of prefill
    prefill_overhead_s: float = 0.010
    decode_s_per_token: float = 0.020
    cache_blocks: int = 1200  # KV blocks per replica (~77k tokens)
    utilization: float = 4.0  # of the prefill servers if nothing were cached (hits bring it under 1)
    max_concurrent: int = 64
    load_bound: float = 1.25
    warmup: float = 0.25  # of the requests: sent before load is counted (the replicas start empty)
    # kv_events: from a replica storing or evicting a block to the index, and from its prefill
    # waiting changing to the routers hearing it (in the batches of its next step)
    event_delay_s: float = 0.05
    event_loss: float = 0.01  # kv_events: batches a router's socket drops, recovered by replay...
    replay_s: float = 1.0  # ...this much later
    # kv_events: a router hears a replica's waiting prefill only in the batches of its own
    # requests there (every step while they stream), and keeps it for LOAD_FRESH_S after its
    # last one ends (routing/channel.py); True: every router hears every replica (the best case,
    # what this simulation assumed before)
    hear_all: bool = False
    seed: int = 1


class Replica:
    def __init__(self, name: str, cache_blocks: int) -> None:
        self.actor_name = name
        self.cache: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.capacity = cache_blocks
        self.prefill_free_at = 0.0
        self.load = 0
        self.served = 0
        self.in_flight: list[tuple[float, float]] = []  # (sent, done) of every request it served

    def cached_prefix(self, blocks: tuple[bytes, ...]) -> int:
        n = 0
        for b in blocks:
            if b not in self.cache:
                break
            n += 1
        return n

    def insert(self, blocks: tuple[bytes, ...], holders: dict[bytes, set[str]]) -> KVEventBatch:
        """Cache ``blocks`` (evicting the least recently used); what vLLM would publish."""
        events: list = []
        for i, b in enumerate(blocks):
            if b in self.cache:
                self.cache.move_to_end(b)
            else:
                self.cache[b] = None
                holders.setdefault(b, set()).add(self.actor_name)
                # As vLLM's BlockStored: the block's hash, its parent's, its tokens (here one
                # token per block standing for its contents), the block size.
                parent = as_int(blocks[i - 1]) if i else None
                events.append(BlockStored([as_int(b)], parent, [as_int(b)], 1))
        while len(self.cache) > self.capacity:
            old, _ = self.cache.popitem(last=False)
            holders[old].discard(self.actor_name)
            events.append(BlockRemoved([as_int(old)]))
        return KVEventBatch(0.0, events)


def as_int(block: bytes) -> int:
    return int.from_bytes(block, "big")


@dataclass
class Conversation:
    system: tuple[bytes, ...]
    key: bytes
    blocks: list[bytes] = field(default_factory=list)  # the conversation so far, in blocks
    tail: int = 0  # tokens past the last full block
    turns_left: int = 0
    serial: int = 0


def lognormal(rng: random.Random, median: float, sigma: float = 0.8) -> int:
    return max(1, int(rng.lognormvariate(math.log(median), sigma)))


def extend(conv: Conversation, tokens: int, rng: random.Random) -> None:
    """Append ``tokens`` tokens; every block filled gets its chained hash."""
    conv.tail += tokens
    while conv.tail >= BLOCK_TOKENS:
        conv.tail -= BLOCK_TOKENS
        conv.serial += 1
        previous = conv.blocks[-1] if conv.blocks else b""
        conv.blocks.append(hash_block(previous, f"{rng.random()}"))


def hash_block(previous: bytes, text: str) -> bytes:
    import hashlib

    return hashlib.blake2b(previous + text.encode(), digest_size=8).digest()


def oracle_pick(replicas: list[Replica], loads: dict[str, int], cfg: Config, key: PromptKey,
                holders: dict[bytes, set[str]]) -> Replica:
    by_name = {r.actor_name: r for r in replicas}
    _, cap = load_cap(sum(loads.values()), len(replicas), cfg.load_bound)
    under = {n for n in by_name if loads[n] + 1 <= cap and loads[n] < cfg.max_concurrent}
    best = None
    holding = under
    for b in key.blocks:
        holding = holding & holders.get(b, set())
        if not holding:
            break
        best = holding
    if best:
        return by_name[min(best, key=lambda n: (loads[n], n))]
    pool = under or set(by_name)
    return by_name[min(pool, key=lambda n: (loads[n], n))]


def p99(ordered: list[float]) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def simulate(cfg: Config, policy: str) -> dict[str, float]:
    rng = random.Random(cfg.seed)  # the same workload for every policy
    pick_rng = random.Random(cfg.seed + 1)
    replicas = [Replica(f"r{i}", cfg.cache_blocks) for i in range(cfg.replicas)]
    by_name = {r.actor_name: r for r in replicas}
    names = tuple(by_name)
    holders: dict[bytes, set[str]] = {}
    indexes = [PrefixIndex() for _ in range(cfg.routers)]
    # kv_events: every router's copy of the index gets the same events after the same delay, so
    # one index stands for all of them (a copy per router at 1,000 replicas would not fit here).
    kv = KvIndex()
    event_rng = random.Random(cfg.seed + 2)
    systems = []
    for _ in range(cfg.system_prompts):
        conv = Conversation((), b"")
        extend(conv, rng.randint(*cfg.system_tokens), rng)
        systems.append(tuple(conv.blocks))
    zipf = [1 / (i + 1) for i in range(cfg.system_prompts)]

    # Arrival rate: enough conversations to keep the prefill servers at ``utilization`` with
    # no cache hits (a rough mean prompt of system + half a conversation).
    mean_prompt = statistics.mean(cfg.system_tokens) + cfg.turns_median * (cfg.user_tokens_median +
                                                                          cfg.output_tokens_median) / 2
    per_request_s = cfg.prefill_overhead_s + mean_prompt * cfg.prefill_s_per_token
    requests_per_s = cfg.utilization * cfg.replicas / per_request_s
    conversations_per_s = requests_per_s / cfg.turns_median
    total_requests = cfg.turns_per_replica * cfg.replicas

    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(at: float, kind: str, payload: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, payload))

    t = 0.0
    started = 0
    while started < total_requests / cfg.turns_median * 1.2:
        t += rng.expovariate(conversations_per_s)
        system = systems[rng.choices(range(cfg.system_prompts), zipf)[0]]
        turns = max(1, int(rng.lognormvariate(math.log(cfg.turns_median), 0.6)))
        conv = Conversation(system, b"", list(system), 0, turns)
        first_user = lognormal(rng, cfg.user_tokens_median)
        conv.key = hash_block(b"conversation", f"{system[0].hex()}{rng.random()}")
        push(t, "turn", (conv, first_user))
        started += 1

    def publish(now: float, replica: Replica, batch: KVEventBatch) -> None:
        if policy == "kv_events" and batch.events:
            lost = event_rng.random() < cfg.event_loss
            push(now + cfg.event_delay_s + (cfg.replay_s if lost else 0.0), "events", (replica.actor_name, batch))

    ttfts: list[float] = []
    prompt_tokens = cached_tokens = 0
    sent = 0
    window_from = 0.0
    now = 0.0
    # kv_events: the blocks of prefill each router sent each replica, not yet answered; every
    # router's, as each replica says it (in its batches), and what the routers last heard it say
    queued: list[dict[str, float]] = [collections.defaultdict(float) for _ in range(cfg.routers)]
    prefill_waiting: dict[str, float] = collections.defaultdict(float)
    prefill_said: dict[str, float] = collections.defaultdict(float)  # what each replica says, delayed
    # Unless hear_all, a router hears that only from replicas where it has requests open; from one
    # where it has none now, what it last heard there and when.
    open_by: list[collections.Counter[str]] = [collections.Counter() for _ in range(cfg.routers)]
    heard: list[dict[str, tuple[float, float]]] = [{} for _ in range(cfg.routers)]

    def heard_by(router: int) -> Callable[[str], float]:
        if cfg.hear_all:
            return prefill_said.__getitem__
        opened, last = open_by[router], heard[router]

        def said(name: str) -> float:
            if opened[name]:
                return prefill_said[name]
            value, at = last.get(name, (0.0, -LOAD_FRESH_S))
            return value if now - at <= LOAD_FRESH_S else 0.0
        return said

    def report(now: float, name: str, work: float) -> None:
        prefill_waiting[name] += work
        push(now + cfg.event_delay_s, "report", (name, prefill_waiting[name]))
    while events and sent < total_requests:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "events":
            name, batch = payload  # type: ignore[misc]
            kv.apply(name, batch, now)
            continue
        if kind == "answered":
            router, name, work = payload  # type: ignore[misc]
            queued[router][name] -= work
            report(now, name, -work)
            continue
        if kind == "report":
            name, said = payload  # type: ignore[misc]
            prefill_said[name] = said
            continue
        if kind == "done":
            replica, conv, out_tokens, router = payload  # type: ignore[misc]
            replica.load -= 1
            if router is not None:
                open_by[router][replica.actor_name] -= 1
                if not open_by[router][replica.actor_name]:  # its last batch from there
                    heard[router][replica.actor_name] = (prefill_said[replica.actor_name], now)
            extend(conv, out_tokens, rng)
            publish(now, replica, replica.insert(tuple(conv.blocks), holders))
            conv.turns_left -= 1
            if conv.turns_left > 0:
                push(now + rng.expovariate(1 / cfg.think_s), "turn", (conv, lognormal(rng, cfg.user_tokens_median)))
            continue
        conv, user_tokens = payload  # type: ignore[misc]
        extend(conv, user_tokens, rng)
        blocks = tuple(conv.blocks)
        key = PromptKey(blocks, conv.key, len(conv.system))
        loads = {r.actor_name: r.load for r in replicas}
        if policy == "power_of_two":
            choice = pick_replica(replicas, loads, cfg.max_concurrent, pick_rng) or min(replicas, key=lambda r: r.load)
        elif policy == "consistent_hash":
            choice = by_name[rendezvous_order(conv.key, names)[0]]
        elif policy == "prefix_affinity":
            picked, _ = pick_prefix_affinity(replicas, loads, cfg.max_concurrent, key,
                                             indexes[pick_rng.randrange(cfg.routers)], cfg.load_bound)
            choice = picked or min(replicas, key=lambda r: r.load)  # type: ignore[assignment]
        elif policy == "kv_events":
            # A miss is placed as prefix affinity places it; each router knows the prefill it queued.
            router = pick_rng.randrange(cfg.routers)
            place = functools.partial(pick_prefix_affinity, replicas, loads, cfg.max_concurrent, key,
                                      indexes[router], cfg.load_bound)
            depths = kv.depths(chain([as_int(b) for b in blocks], 1))
            picked, _ = pick_by_depth(replicas, loads, cfg.max_concurrent, depths, place, cfg.load_bound,
                                      len(blocks), QueuedPrefill(queued[router], heard_by(router)))
            choice = picked or min(replicas, key=lambda r: r.load)  # type: ignore[assignment]
            queued_work = (router, len(blocks) - depths.get(choice.actor_name, 0))  # type: ignore[union-attr]
        else:
            choice = oracle_pick(replicas, loads, cfg, key, holders)
        replica = by_name[choice.actor_name]  # type: ignore[union-attr]
        tokens = len(blocks) * BLOCK_TOKENS + conv.tail
        hit = replica.cached_prefix(blocks) * BLOCK_TOKENS
        prompt_tokens += tokens
        cached_tokens += hit
        start = max(now, replica.prefill_free_at)
        first_token = start + cfg.prefill_overhead_s + (tokens - hit) * cfg.prefill_s_per_token
        replica.prefill_free_at = first_token
        router = None
        if policy == "kv_events":
            router, work = queued_work
            open_by[router][replica.actor_name] += 1
            queued[router][replica.actor_name] += work
            report(now, replica.actor_name, work)
            push(first_token, "answered", (router, replica.actor_name, work))
        publish(now, replica, replica.insert(blocks, holders))
        replica.load += 1
        replica.served += 1
        ttfts.append(first_token - now)
        out_tokens = lognormal(rng, cfg.output_tokens_median)
        done_at = first_token + out_tokens * cfg.decode_s_per_token
        replica.in_flight.append((now, done_at))
        if sent == int(total_requests * cfg.warmup):
            window_from = now
        push(done_at, "done", (replica, conv, out_tokens, router))
        sent += 1
    # Load: request-seconds in flight per replica (the time integral of its open requests, which
    # the load bound caps), counted from the end of the warm-up to the last request sent.
    busy = sorted(sum(max(0.0, min(done, now) - max(sent_at, window_from)) for sent_at, done in r.in_flight)
                  for r in replicas)
    mean_busy = max(1e-9, statistics.mean(busy))
    ttfts.sort()
    return {
        "hit_rate": cached_tokens / max(1, prompt_tokens),
        "max_mean": busy[-1] / mean_busy,
        # The max is one replica of many: the 99th percentile says whether the tail is the policy's.
        "p99_mean": p99(busy) / mean_busy,
        "ttft_p50": ttfts[len(ttfts) // 2],
        "ttft_p99": p99(ttfts),
        "requests": len(ttfts),
    }


POLICIES = ("power_of_two", "consistent_hash", "prefix_affinity", "kv_events", "oracle")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 10, 100, 1000])
    ap.add_argument("--turns-per-replica", type=int, default=100)
    ap.add_argument("--routers", type=int, default=4)
    ap.add_argument("--cache-blocks", type=int, default=Config.cache_blocks,
                    help="KV blocks per replica (fewer: more evictions)")
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--load-bound", type=float, default=1.25, help="routing.load_bound (and the oracle's)")
    ap.add_argument("--warmup", type=float, default=Config.warmup,
                    help="share of the requests sent before load is counted")
    ap.add_argument("--utilization", type=float, default=Config.utilization,
                    help="offered load: of the prefill servers if nothing were cached")
    ap.add_argument("--hear-all", action="store_true",
                    help="kv_events: every router hears every replica's waiting prefill (the best case)")
    args = ap.parse_args()
    print(f"{'replicas':>8} {'policy':>16} {'hit rate':>9} {'vs oracle':>9} {'max/mean':>9} {'p99/mean':>9} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'requests':>9} {'sim s':>6}")
    for n in args.replicas:
        cfg = Config(replicas=n, routers=args.routers, turns_per_replica=args.turns_per_replica, seed=args.seed,
                     load_bound=args.load_bound, utilization=args.utilization, warmup=args.warmup,
                     cache_blocks=args.cache_blocks, hear_all=args.hear_all)
        policies = [p for p in POLICIES if p in args.policies or p in ("oracle", "power_of_two", "prefix_affinity")]
        results = {}
        for policy in policies:
            began = time.perf_counter()
            results[policy] = r = simulate(cfg, policy)
            r["took"] = time.perf_counter() - began
        oracle = results["oracle"]["hit_rate"]
        for policy in policies:
            r = results[policy]
            print(f"{n:>8} {policy:>16} {r['hit_rate']:>9.3f} {r['hit_rate'] / max(oracle, 1e-9):>9.3f} "
                  f"{r['max_mean']:>9.2f} {r['p99_mean']:>9.2f} "
                  f"{r['ttft_p50'] * 1000:>7.0f}ms {r['ttft_p99'] * 1000:>7.0f}ms "
                  f"{r['requests']:>9} {r['took']:>6.1f}")
        pa, p2 = results["prefix_affinity"], results["power_of_two"]
        for name in ("prefix_affinity", "kv_events"):
            if name not in results:
                continue
            r = results[name]
            print(f"{n:>8} {name}: hit rate {r['hit_rate'] / max(oracle, 1e-9):.3f} of the oracle's, "
                  f"max/mean {r['max_mean']:.2f} (p99/mean {r['p99_mean']:.2f}), "
                  f"p99 TTFT {r['ttft_p99'] / p2['ttft_p99']:.2f}x power_of_two's "
                  f"and {r['ttft_p99'] / pa['ttft_p99']:.2f}x prefix_affinity's", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
