"""Prefix-cache affinity (``routing.policy: prefix_affinity``): send a request to the replica
most likely to hold its prompt's prefix in vLLM's prefix cache, without piling onto one.

The router cannot tokenize (the tokenizer and chat template live in the replica), so a prompt
is cut into fixed blocks of characters (``BLOCK_CHARS``, about 64 tokens of English) and each
block's hash chains the ones before it, as vLLM's block hashes do over tokens: equal hashes
mean equal prefixes. Each router keeps an LRU index of which replica it sent each block hash
to; a request goes to the replica holding its longest indexed prefix (Ray Serve's
``PrefixCacheAffinityRouter`` keeps a character tree for the same purpose).

A prefix no router index knows (a new conversation, or one another router served) is placed
by two choices on the rendezvous hashing of its conversation key (the text up to the first
user message for chat, the first blocks for a plain prompt): its first replica, unless its
second is lighter by more than ``(load_bound - 1)`` x the mean load. So routers mostly place
the same conversation on the same replica, later turns, whose prompts extend it, follow, and
a cache miss (which costs the same anywhere) does not queue behind a busier replica. A match
that covers only the system prompt (shared by every conversation that uses it) does not count:
it says where that prompt went, not this conversation; each replica caches the popular system
prompts.

Hot spots, the known failure of affinity, are bounded as in consistent hashing with bounded
loads (Mirrokni, Thorup, Zadimoghaddam 2018): a replica takes a request only while it
would then hold at most ``load_bound`` x the mean (counting this request), or the mean plus
``SLACK`` requests where that is more (at low load a hit is worth a few requests of imbalance);
above it the request overflows to the least-loaded replica, and the index follows it there.
Pure functions: the router and ``scripts/sim_routing.py`` run the same code.
"""

from __future__ import annotations

import collections
import functools
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

BLOCK_CHARS = 256
MAX_BLOCKS = 256  # prompts longer than this many blocks are matched on their first ones
INDEX_ENTRIES = 200_000  # block hashes a router remembers (LRU)
SLACK = 4.0  # requests of imbalance a cache hit is always worth, at any load


class Named(Protocol):
    actor_name: str


@dataclass(frozen=True)
class PromptKey:
    blocks: tuple[bytes, ...]  # chained hashes of the prompt's full blocks
    conversation: bytes  # what places a prefix no index knows
    # Leading blocks every conversation with the same system prompt shares: a match no deeper
    # than these says where that prompt went, not this conversation.
    shared: int = 0


def _hash(previous: bytes, text: str) -> bytes:
    return hashlib.blake2b(previous + text.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def block_hashes(text: str, block_chars: int = BLOCK_CHARS, salt: str | None = None) -> tuple[bytes, ...]:
    """The chained hash of every full block of ``text`` (a partial last block is not cached).
    ``salt``: the request's ``cache_salt``, which vLLM hashes into the first block: the same
    text under another salt shares no cached block."""
    out: list[bytes] = []
    previous = _hash(b"salt", salt) if salt else b""
    for start in range(0, min(len(text), block_chars * MAX_BLOCKS) - block_chars + 1, block_chars):
        previous = _hash(previous, text[start : start + block_chars])
        out.append(previous)
    return tuple(out)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: the text ones say what the prefix is
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def chat_text(messages: Sequence[Any]) -> tuple[str, str, int]:
    """The messages as one text (roles kept: they change the rendered prompt), its part up to
    the end of the first user message (the conversation's identity) and the length of what
    comes before that message (the system prompt, shared by other conversations)."""
    text: list[str] = []
    key, shared = "", 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        if not key and message.get("role") == "user":
            shared = sum(map(len, text))
        text.append(f"\x1e{message.get('role', '')}\x1f{_content_text(message.get('content'))}")
        if not key and message.get("role") == "user":
            key = "".join(text)
    whole = "".join(text)
    return whole, key or whole, shared


def prompt_key(prompt: Any, block_chars: int = BLOCK_CHARS, salt: str | None = None) -> PromptKey | None:
    """The prefix key of a request's prompt as the edge parsed it (``RoutingFacts.prompt``):
    a chat's ``messages`` or a completion's ``prompt`` text, under its ``cache_salt``. None: no
    text to match."""
    if isinstance(prompt, list):
        text, conversation, shared = chat_text(prompt)
    elif isinstance(prompt, str):
        text, conversation, shared = prompt, prompt[: 2 * block_chars], 0
    else:
        return None
    if salt:  # another tenant's conversation: placed on its own
        conversation = f"{salt}\x1d{conversation}"
    return PromptKey(block_hashes(text, block_chars, salt), _hash(b"conversation", conversation), shared // block_chars)


class PrefixIndex:
    """Which replica each block hash was last sent to, least recently used forgotten first."""

    def __init__(self, capacity: int = INDEX_ENTRIES) -> None:
        self._where: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._capacity = capacity

    def __len__(self) -> int:
        return len(self._where)

    def longest(self, blocks: Sequence[bytes], candidates: Mapping[str, Any]) -> tuple[str | None, int]:
        """The candidate holding the longest prefix of ``blocks``, and how many blocks."""
        for i in range(len(blocks) - 1, -1, -1):
            where = self._where.get(blocks[i])
            if where is not None and where in candidates:
                return where, i + 1
        return None, 0

    def record(self, blocks: Sequence[bytes], replica: str) -> None:
        for block in blocks:
            self._where[block] = replica
            self._where.move_to_end(block)
        while len(self._where) > self._capacity:
            self._where.popitem(last=False)


@functools.lru_cache(maxsize=4096)
def rendezvous_order(key: bytes, names: tuple[str, ...]) -> tuple[str, ...]:
    """Names by highest-random-weight for ``key``: stable when other names come and go.
    Cached: a conversation's turns ask again with the same replica list."""
    return tuple(sorted(names, key=lambda n: hashlib.blake2b(key + n.encode(), digest_size=8).digest(), reverse=True))


def pick_prefix_affinity(
    replicas: Sequence[Named],
    loads: Mapping[str, int],
    max_concurrent: int,
    key: PromptKey | None,
    index: PrefixIndex,
    load_bound: float = 1.25,
    place: Callable[[], tuple[Any, str]] | None = None,
) -> tuple[Named | None, str]:
    """(replica, reason): ``affinity_hit`` (it holds the longest known prefix), ``overflow``
    (the one that does is above the load bound: the least loaded instead), ``no_affinity``
    (no known prefix: placed by the conversation's hash within the bound, or by ``place``, which
    gives the replica and its own reason: a LoRA adapter's home). None when every replica is at
    ``max_concurrent``. Records the choice in ``index``."""
    free = {r.actor_name: r for r in replicas if loads.get(r.actor_name, 0) < max_concurrent}
    if not free:
        return None, "full"
    mean, bound = load_cap(sum(loads.get(r.actor_name, 0) for r in replicas), len(replicas), load_bound)
    under = {n: r for n, r in free.items() if loads.get(n, 0) + 1 <= bound}

    def least_loaded() -> str:
        return min(free, key=lambda n: (loads.get(n, 0), n))

    if key is None:
        return free[least_loaded()], "no_affinity"
    holder, depth = index.longest(key.blocks, free)
    if holder is not None and depth > key.shared:
        name, reason = (holder, "affinity_hit") if holder in under else (least_loaded(), "overflow")
    elif place is not None:
        placed, reason = place()
        if placed is None:
            return None, reason
        name = placed.actor_name
    else:
        name, reason = _place(key.conversation, replicas, loads, under or free, (load_bound - 1) * mean), "no_affinity"
    index.record(key.blocks, name)
    return free[name], reason


def load_cap(total_load: int, replicas: int, load_bound: float, slack: float = SLACK) -> tuple[float, float]:
    """(mean, cap): the mean load counting one more request, and the most a replica may hold
    after taking it: ``load_bound`` x the mean, or the mean plus ``slack`` where that is more."""
    mean = (total_load + 1) / max(1, replicas)
    return mean, max(load_bound * mean, mean + slack)


def _place(conversation: bytes, replicas: Sequence[Named], loads: Mapping[str, int], allowed: Mapping[str, Any],
           headroom: float) -> str:
    """A conversation no index knows: two choices on its hash. Its first replica by rendezvous
    hashing, so that every router agrees, unless its second is lighter by more than
    ``headroom``: the prompt misses the cache on either, and the lighter one serves it sooner.
    A router that did not place it may later send a turn to the other one: a miss that turn,
    then the index knows."""
    ordered = [n for n in rendezvous_order(conversation, tuple(r.actor_name for r in replicas)) if n in allowed]
    first = ordered[0]
    if len(ordered) > 1 and loads.get(first, 0) > loads.get(ordered[1], 0) + headroom:
        return ordered[1]
    return first
