"""What the KV-event index costs (routing.policy kv_events), at 1,000 simulated replicas.

1. Events one index keeps up with: msgpack batches as vLLM's publisher sends them (BlockStored
   runs and BlockRemoved evictions, block size 16 as on a GPU), decoded and applied by
   ``KvIndex`` (routing/kv_index.py), into an index already holding every replica's cache.
2. Routing latency a request adds: the prompt's tokens (a chat of about 2,000 tokens through the
   bundled model's tokenizer and chat template, routing/prompt_tokens.py), its chain of block
   hashes, the depth each replica holds and the pick (routing/kv_policy.py): p50/p99.
3. Where to tokenize: here (the router) against a round trip to a Ray actor that tokenizes (what
   "a cheap call to the replica" would cost at best: the same tokenizer, no engine around it).

    .venv/bin/python scripts/bench_kv_index.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402

from atomr_infer.routing.kv_index import BlockRemoved, BlockStored, KVEventBatch, KvIndex, chain, decode_batch  # noqa: E402
from atomr_infer.routing.kv_policy import pick_by_depth  # noqa: E402


class Route:
    def __init__(self, name: str) -> None:
        self.actor_name = name


def percentiles(samples: list[float]) -> str:
    samples = sorted(samples)
    return (f"p50 {statistics.median(samples) * 1e6:,.0f} µs, "
            f"p99 {samples[int(len(samples) * 0.99)] * 1e6:,.0f} µs")


def tokenizer_files() -> dict[str, str]:
    from atomr_infer.models.bundled import prepare_bundled

    path = prepare_bundled("smollm2-135m-instruct")
    return {n: (path / n).read_text() for n in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
            if (path / n).is_file()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=1000)
    ap.add_argument("--blocks-per-replica", type=int, default=2000)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--no-ray", action="store_true", help="skip the round trip to a Ray actor")
    args = ap.parse_args()
    rng = random.Random(1)
    size = args.block_size
    names = [f"atomr:d:r{i}" for i in range(args.replicas)]
    encode = msgspec.msgpack.Encoder().encode

    # Each replica's cache: runs of 8 blocks, hashes unique per replica.
    index = KvIndex()
    serial = 0
    for name in names:
        for _ in range(args.blocks_per_replica // 8):
            tokens = [rng.randrange(50_000) for _ in range(8 * size)]
            index.apply(name, KVEventBatch(0.0, [BlockStored(list(range(serial, serial + 8)), None, tokens, size)]))
            serial += 8
    print(f"index: {args.replicas} replicas x {args.blocks_per_replica} blocks = {len(index):,} block hashes")

    # 1. A step's batch: 4 blocks stored (a prefill of 64 tokens), 4 evicted.
    batches = []
    for i in range(20_000):
        tokens = [rng.randrange(50_000) for _ in range(4 * size)]
        evicted = [rng.randrange(serial) for _ in range(4)]
        batch = KVEventBatch(time.time(), [BlockStored(list(range(serial, serial + 4)), None, tokens, size),
                                           BlockRemoved(evicted)])
        serial += 4
        batches.append((names[i % len(names)], encode(batch)))
    began = time.perf_counter()
    for name, payload in batches:
        index.apply(name, decode_batch(payload))
    took = time.perf_counter() - began
    blocks = len(batches) * 8
    print(f"1. events: {len(batches) / took:,.0f} batches/s, {blocks / took:,.0f} blocks stored or evicted/s "
          f"(decode + apply, one thread)")

    # 2. Routing latency at this size, with and without the tokenizer.
    from atomr_infer.routing.prompt_tokens import PromptTokenizer

    tokenizer = PromptTokenizer(tokenizer_files())
    document = " ".join(f"Line {i}: the harbour master logs ship number {i} at dawn." for i in range(150))
    chats = [[{"role": "system", "content": document}, {"role": "user", "content": f"Question {i}?"}]
             for i in range(args.requests)]
    known = chain(tokenizer.tokens(chats[0]), size)
    holder_tokens = tokenizer.tokens(chats[0])
    for name in rng.sample(names, 20):  # twenty replicas hold the document
        index.apply(name, KVEventBatch(0.0, [BlockStored(list(range(serial, serial + len(known))), None,
                                                          holder_tokens[:len(known) * size], size)]))
        serial += len(known)
    routes = [Route(n) for n in names]
    loads = {n: rng.randrange(4) for n in names}

    def place() -> tuple[Route, str]:
        return routes[0], "miss"

    whole, without = [], []
    for chat in chats:
        began = time.perf_counter()
        tokens = tokenizer.tokens(chat)
        tokenized = time.perf_counter()
        hashes = chain(tokens, size)
        depths = index.depths(hashes)
        choice, reason = pick_by_depth(routes, loads, 64, depths, place, blocks=len(hashes))
        done = time.perf_counter()
        whole.append(done - began)
        without.append(done - tokenized)
    assert reason == "kv_hit" and depths[choice.actor_name] == len(known), (reason, depths[choice.actor_name])
    print(f"2. routing, {len(holder_tokens)}-token chat, {args.replicas} replicas: {percentiles(whole)} "
          f"(tokenizing included); {percentiles(without)} (chain + depths + pick alone)")

    # 3. Tokenizing here against a round trip to an actor that tokenizes.
    local = []
    for chat in chats[:500]:
        began = time.perf_counter()
        tokenizer.tokens(chat)
        local.append(time.perf_counter() - began)
    print(f"3. tokenize here: {percentiles(local)}")
    if not args.no_ray:
        import ray

        ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR")
        try:
            @ray.remote
            class Tokenize:
                def __init__(self, files: dict[str, str]) -> None:
                    from atomr_infer.routing.prompt_tokens import PromptTokenizer

                    self._tokenizer = PromptTokenizer(files)

                def tokens(self, chat: list) -> list[int] | None:
                    return self._tokenizer.tokens(chat)

            actor = Tokenize.remote(tokenizer_files())
            ray.get(actor.tokens.remote(chats[0]))
            remote = []
            for chat in chats[:500]:
                began = time.perf_counter()
                ray.get(actor.tokens.remote(chat))
                remote.append(time.perf_counter() - began)
            print(f"   tokenize in an actor (a Ray round trip): {percentiles(remote)}; "
                  f"{statistics.median(remote) / statistics.median(local):.1f}x here")
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
