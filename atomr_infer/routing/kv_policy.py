"""``routing.policy: kv_events``: send a request to the replica that holds the most of its
prompt's leading blocks, as the replicas' own KV-cache events say (routing/kv_index.py), within
the load bound prefix affinity uses (routing/prefix.py ``load_cap``).

Reasons: ``kv_hit`` (the deepest holder under the bound, one block less per request it has open;
ties to the less loaded), ``kv_overflow``
(every holder is above it: the least loaded instead), ``kv_miss`` (no replica holds the first
block: placed as prefix affinity places a new conversation, or at a LoRA adapter's home). Pure:
the router and ``scripts/sim_routing.py`` run the same code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from atomr_infer.routing.prefix import Named, load_cap

# Requests of imbalance a holder may take over the mean at low load. Prefix affinity's 4 is for
# a guess; here a hit is known, but the simulation (scripts/sim_routing.py, 100 replicas with
# evictions) found 4 piling the holders of popular system prompts to 1.33x the mean load, and 2.5
# 1.15x at the same hit rate.
KV_SLACK = 2.5
# Among holders under the bound, each request open on one counts as one block less held: a
# holder of nearly as much but less loaded wins (simulated at 1,000 replicas: max/mean load 1.28
# against 1.37, hit rate 0.998 of the oracle's against 1.000).
BLOCKS_PER_REQUEST = 1.0


def pick_by_depth(
    replicas: Sequence[Named], loads: Mapping[str, int], max_concurrent: int, depths: Mapping[str, int],
    place: Callable[[], tuple[Any, str]], load_bound: float = 1.25,
) -> tuple[Any, str]:
    """(replica, reason) from each replica's ``depths`` (leading blocks held); ``place`` decides
    a miss. None when every replica is at ``max_concurrent``."""
    free = {r.actor_name: r for r in replicas if loads.get(r.actor_name, 0) < max_concurrent}
    if not free:
        return None, "full"
    holders = [n for n in free if depths.get(n, 0) > 0]
    if not holders:
        placed, _reason = place()
        return placed, "kv_miss"
    _, cap = load_cap(sum(loads.get(r.actor_name, 0) for r in replicas), len(replicas), load_bound, KV_SLACK)
    under = [n for n in holders if loads.get(n, 0) + 1 <= cap]
    if under:
        score = {n: depths[n] - BLOCKS_PER_REQUEST * loads.get(n, 0) for n in under}
        return free[max(under, key=lambda n: (score[n], -loads.get(n, 0), n))], "kv_hit"
    return free[min(free, key=lambda n: (loads.get(n, 0), n))], "kv_overflow"
