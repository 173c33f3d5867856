"""What a LoRA adapter swap costs on this machine, and how many swaps adapter-aware routing saves.

Part 1 (vLLM, in process, the bundled model, ``max_loras`` 1): N adapters of rank R (random
weights: a swap costs the same whatever they say), each request a short greedy completion, one
at a time: the base model; one adapter again and again (it keeps the slot); the adapters in
turn (each request swaps its adapter into the slot: from the host cache with ``max_cpu_loras``
N, from disk with 1). A swap's cost is the difference against the one-adapter case (the same
slot count: vLLM's CPU LoRA kernels cost per slot, so more slots is not a fair baseline).

Part 2 (no engine): the swaps a workload of uniformly random adapters causes on R replicas of
``max_loras`` slots each (an LRU of slots per replica, as vLLM keeps them), routed by
power-of-two choices against adapter homes (routing/adapters.py), both at equal load.
Swaps x the per-swap cost is the time routing can save.

    .venv/bin/python scripts/bench_lora_swap.py [--adapters 8] [--rank 8] [--requests 48]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_adapters(base: Path, count: int, rank: int, out: Path) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        path = out / f"a{i}"
        get_peft_model(model, config).save_pretrained(path)
        paths.append(path)
    return paths


def timings(base: Path, adapters: list[Path], max_cpu_loras: int, requests: int) -> dict[str, float]:
    """Median seconds per request on one engine with one LoRA slot: the base model, one adapter
    again and again (no swap), and the adapters in turn (a swap every request)."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(model=str(base), enable_lora=True, max_loras=1, max_cpu_loras=max_cpu_loras,
              max_lora_rank=max(8, RANK), enforce_eager=True, max_model_len=512, disable_log_stats=True)
    params = SamplingParams(max_tokens=8, temperature=0)
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    for lora in loras:  # warm: every adapter read once
        llm.generate(["Hello"], params, lora_request=lora, use_tqdm=False)

    def median(pick) -> float:  # noqa: ANN001
        times = []
        for i in range(requests):
            started = time.perf_counter()
            llm.generate(["The capital of France is"], params, lora_request=pick(i), use_tqdm=False)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    return {"base": median(lambda i: None), "same": median(lambda i: loras[0]),
            "cycling": median(lambda i: loras[i % len(loras)])}


def swaps(route: str, adapters: int, replicas: int, slots: int, requests: int, concurrency: int = 8,
          seed: int = 0) -> int:
    """Adapter swaps (a request whose adapter has no slot on its replica) in a steady stream of
    ``concurrency`` requests in flight; slots kept least recently used first, as vLLM does."""
    from atomr_infer.routing.adapters import pick_adapter_home
    from atomr_infer.routing.table import ReplicaRoute

    rng = random.Random(seed)
    routes = [ReplicaRoute(f"r{i}", f"r{i}", None) for i in range(replicas)]
    resident: dict[str, collections.OrderedDict[str, bool]] = {r.actor_name: collections.OrderedDict() for r in routes}
    load: collections.Counter[str] = collections.Counter()
    in_flight: collections.deque[str] = collections.deque()
    count = 0
    for _ in range(requests):
        adapter = f"a{rng.randrange(adapters)}"
        if route == "adapter_home":
            choice = pick_adapter_home(routes, load, 10**6, adapter)[0].actor_name
        else:
            a, b = rng.sample(routes, 2)
            choice = a.actor_name if load[a.actor_name] <= load[b.actor_name] else b.actor_name
        load[choice] += 1
        in_flight.append(choice)
        if len(in_flight) > concurrency:
            load[in_flight.popleft()] -= 1
        held = resident[choice]
        if adapter in held:
            held.move_to_end(adapter)
        else:
            count += 1
            held[adapter] = True
            if len(held) > slots:
                held.popitem(last=False)
    return count


RANK = 8


def main() -> None:
    global RANK
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--slots", type=int, default=2, help="max_loras per replica in part 2")
    args = parser.parse_args()
    RANK = args.rank
    from atomr_infer.models import prepare_bundled

    base = prepare_bundled("smollm2-135m-instruct")
    with tempfile.TemporaryDirectory() as tmp:
        adapters = make_adapters(base, args.adapters, args.rank, Path(tmp))
        cached = timings(base, adapters, args.adapters, args.requests)  # swaps from the host cache
        uncached = timings(base, adapters, 1, args.requests)  # swaps from disk
    swap = cached["cycling"] - cached["same"]
    print(f"part 1: {args.adapters} adapters of rank {args.rank}, max_loras 1, 8 greedy tokens a request, "
          "one at a time, median")
    print(f"  base model            {cached['base'] * 1000:8.1f} ms/request")
    print(f"  one adapter (no swap) {cached['same'] * 1000:8.1f} ms/request")
    print(f"  adapters in turn      {cached['cycling'] * 1000:8.1f} ms/request   swap from host {swap * 1000:+.1f} ms")
    disk = uncached["cycling"] - uncached["same"]
    print(f"  max_cpu_loras 1       {uncached['cycling'] * 1000:8.1f} ms/request   "
          f"swap from disk {disk * 1000:+.1f} ms")
    n = 10_000
    print(f"part 2: {n} requests over {args.adapters} adapters, {args.replicas} replicas x {args.slots} slots")
    for route in ("power_of_two", "adapter_home"):
        count = swaps(route, args.adapters, args.replicas, args.slots, n)
        print(f"  {route:13s} {count:6d} swaps ({count / n:.2f}/request): "
              f"{count * swap / n * 1000:.2f} ms/request swapping from host")


if __name__ == "__main__":
    main()
