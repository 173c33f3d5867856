"""``routing.policy: kv_events``: send a request to the replica that holds the most of its
prompt's leading blocks, as the replicas' own KV-cache events say (routing/kv_index.py), within
the load bound prefix affinity uses (routing/prefix.py ``load_cap``).

Among the replicas under the bound, the one whose request would cost least: the blocks of the
prompt it does not hold, plus a sixteenth of the prefill waiting there (every router's, as the
replica says in its batches, or this router's own not yet answered, whichever is more); of
those costing the same, the least loaded, then the first in the conversation's rendezvous order
(as prefix affinity places one): a system prompt every replica holds spreads new conversations
over them, each conversation to the same one from every router. Reasons:
``kv_hit`` (it holds some of the prompt), ``kv_overflow`` (a replica holding none: the holders
are above the bound or busy prefilling), ``kv_miss`` (no replica holds the first block: placed
as prefix affinity places a new conversation, or at a LoRA adapter's home). Pure: the router
and ``scripts/sim_routing.py`` run the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from atomr_infer.routing.prefix import Named, load_cap, rendezvous_order

# Requests of imbalance a holder may take over the mean at low load. Prefix affinity's 4 is for
# a guess; here a hit is known, but the simulation (scripts/sim_routing.py, 100 replicas with
# evictions) found 4 piling the holders of popular system prompts to 1.33x the mean load, and 2.5
# 1.15x at the same hit rate.
KV_SLACK = 2.5
# What a replica costs a request: the blocks it must prefill (those it does not hold) plus this
# much per block of prefill waiting there (not yet prefilled). Simulated (scripts/sim_routing.py,
# evictions, 4 seeds, 2-100 replicas, 4 and 16 routers, all of them hearing every replica's
# waiting prefill 50 ms late): 1/16 gave the best p99 TTFT (0.26-0.74x prefix affinity's; with
# no weight, 0.29-0.88x: misses queue behind one another at the holder) at 0.93-1.00 of the
# oracle's hit rate; 1/8 to 1/2 sent hits away (2 replicas, 4 routers: 0.94 to 0.82 of the
# oracle). (1/2 was right when each router knew only its own requests, a quarter of the queue.)
# With each router hearing a replica only while it has requests there, as a real one (not swept
# again): 0.98-1.00 of the oracle, p99 TTFT 0.52-0.82x prefix affinity's (2-1,000 replicas).
QUEUED_BLOCK_WEIGHT = 0.0625


class QueuedPrefill:
    """The blocks of prefill waiting on each replica as one router knows it: what the replica
    last said (every router's requests), or what this router sent there and has no answer to,
    whichever is more. Read lazily: ``pick_by_depth`` asks only for the replicas it weighs."""

    def __init__(self, mine: Mapping[str, float], said: Callable[[str], float] | None = None) -> None:
        self._mine, self._said = mine, said

    def get(self, name: str, default: float = 0.0) -> float:
        return max(self._mine.get(name, default), self._said(name) if self._said else default)


def pick_by_depth(
    replicas: Sequence[Named], loads: Mapping[str, int], max_concurrent: int, depths: Mapping[str, int],
    place: Callable[[], tuple[Any, str]], load_bound: float = 1.25, blocks: int = 0,
    queued: QueuedPrefill | Mapping[str, float] | None = None, conversation: Callable[[], bytes | None] | None = None,
) -> tuple[Any, str]:
    """(replica, reason) from each replica's ``depths`` (leading blocks held of the prompt's
    ``blocks``) and the prefill ``queued`` there (blocks); ``place`` decides when no replica
    holds the first block. ``conversation``: the request's conversation key (``PromptKey``),
    asked for only to break a tie (None: by name). None when every replica is at ``max_concurrent``."""
    free = {r.actor_name: r for r in replicas if loads.get(r.actor_name, 0) < max_concurrent}
    if not free:
        return None, "full"
    if not any(depths.get(n, 0) > 0 for n in free):
        placed, _reason = place()
        return placed, "kv_miss"
    _, cap = load_cap(sum(loads.get(r.actor_name, 0) for r in replicas), len(replicas), load_bound, KV_SLACK)
    under = [n for n in free if loads.get(n, 0) + 1 <= cap] or list(free)
    queued = queued or {}

    def cost(n: str) -> tuple[float, int]:
        work = max(blocks, depths.get(n, 0)) - depths.get(n, 0) + QUEUED_BLOCK_WEIGHT * queued.get(n, 0.0)
        return work, loads.get(n, 0)

    costs = {n: cost(n) for n in under}
    least = min(costs.values())
    tied = sorted(n for n, c in costs.items() if c == least)
    key = conversation() if conversation is not None and len(tied) > 1 else None
    if key is not None:  # ordered among every replica, as prefix affinity orders them (and caches the order)
        best = next(n for n in rendezvous_order(key, tuple(r.actor_name for r in replicas)) if n in tied)
    else:
        best = tied[0]
    return free[best], "kv_hit" if depths.get(best, 0) > 0 else "kv_overflow"
