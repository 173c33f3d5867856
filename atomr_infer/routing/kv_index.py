"""What each replica really holds in its prefix cache, from vLLM's own KV-cache events.

vLLM (``kv_events_config``) publishes, per engine step, a ``KVEventBatch`` of ``BlockStored``
(full blocks just cached: their hashes, their parent's, their tokens, the LoRA adapter),
``BlockRemoved`` (evicted) and ``AllBlocksCleared``. The structures below mirror vLLM 0.32's
(``vllm/distributed/kv_events.py``) field for field, so a router decodes them with msgspec alone:
importing vLLM's own would import torch, which only replicas load.

The index keys blocks by a hash of our own over the events' token ids, chained as vLLM chains
its blocks and rooted at the adapter's name: a router hashes a prompt's token ids the same way
without knowing which hash function the engine was configured with (vLLM's sha256 of a pickle,
or xxhash with a per-process seed). vLLM's hash of each block is kept only to find it again in
its ``BlockRemoved`` and as the parent of the next run of blocks. What else vLLM hashes into a
block, as its event's ``extra_keys`` say (a request's ``cache_salt``, in its first block; a
multimodal input's identifier; prompt embeddings' digest), goes into ours too: a prompt stored
under one salt matches only requests with that salt (a router folds the request's into the
first block), and a block with an image or embeddings in it never matches a text prompt.

``KvIndex.depths`` answers, for a prompt's block hashes, how many leading blocks each replica
holds. Thread-safe: the event thread (routing/kv_subscriber.py) applies batches while routers
read.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from collections.abc import Container, Iterable, Sequence
from typing import Any

import msgspec

BlockHash = bytes | int  # vLLM sends the low 64 bits as an int unless told to send the bytes
# A replica sent a prompt with blocks it did not hold must report storing them within this long;
# until it reports again its entries are not trusted (a publisher that stopped, a lost socket).
SILENT_S = 5.0


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


decode_batch = msgspec.msgpack.Decoder(KVEventBatch).decode


def root_hash(adapter: str | None) -> int:
    """The parent of a prompt's first block: vLLM caches each adapter's blocks apart."""
    if adapter is None:
        return 0
    return int.from_bytes(hashlib.blake2b(adapter.encode(), digest_size=8).digest(), "big")


_encode = msgspec.msgpack.Encoder().encode


def extra_hash(keys: Sequence[Any]) -> int:
    """A block's extra keys (as its event lists them, the LoRA name left out) as one int, the
    same in every process (a str in a tuple would be hashed with the process's salt)."""
    return int.from_bytes(hashlib.blake2b(_encode(list(keys)), digest_size=8).digest(), "big")


def chain(tokens: Sequence[int], block_size: int, adapter: str | None = None, limit: int = 1 << 30,
          salt: str | None = None) -> list[int]:
    """Our hash of every full block of ``tokens`` (at most ``limit``), each chaining the ones
    before it; ``salt``: the request's ``cache_salt``, which vLLM hashes into the first block.
    A tuple of ints hashes the same in every process (only str and bytes are salted)."""
    out: list[int] = []
    parent = root_hash(adapter)
    for start in range(0, min(len(tokens) // block_size, limit) * block_size, block_size):
        if start == 0 and salt:
            parent = hash((parent, *tokens[:block_size], extra_hash([salt])))
        else:
            parent = hash((parent, *tokens[start:start + block_size]))
        out.append(parent)
    return out


def _extras(event: BlockStored) -> list[int | None] | None:
    """Each block's ``extra_hash`` (None: it has no extra keys), or None where the event's
    extra keys are not one entry per block (which block they go with is unknown)."""
    keys = event.extra_keys
    if not keys:
        return [None] * len(event.block_hashes)
    if len(keys) != len(event.block_hashes):
        return None
    out: list[int | None] = []
    for entry in keys:
        entry = list(entry or ())
        if entry and event.lora_name is not None and entry[0] == event.lora_name:
            entry = entry[1:]  # an adapter's blocks are rooted at its name already (vLLM lists it first)
        out.append(extra_hash(entry) if entry else None)
    return out


class KvIndex:
    """Block hash -> the replicas holding it, for one deployment, from every replica's events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # our block hash -> replica -> how many of its KV-cache groups hold it (a hybrid model's
        # full-attention and sliding-window groups each store the same hashes; a sliding window's
        # blocks go while the full-attention copy stays)
        self._holders: dict[int, dict[str, int]] = {}
        # replica -> (its KV-cache group, vLLM's hash) -> our hash. One entry per key, however often
        # it is reported stored (vLLM may report reused blocks again): the first removal forgets it,
        # which can miss a block still held but never believes one evicted.
        self._blocks: dict[str, dict[tuple[int | None, BlockHash], int]] = collections.defaultdict(dict)
        self.heard_at: dict[str, float] = {}  # replica -> when its last batch was applied
        self._awaiting: dict[str, float] = {}  # replica -> since when a batch is due from it
        self.events = 0  # applied, for the benchmarks
        self.skipped = 0  # BlockStored runs whose parent was never heard of (stored before we listened)

    def __len__(self) -> int:
        return len(self._holders)

    def blocks_of(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))

    def apply(self, replica: str, batch: KVEventBatch, now: float | None = None) -> None:
        with self._lock:
            for event in batch.events:
                self.events += 1
                if isinstance(event, BlockStored | BlockRemoved) and event.medium not in (None, "GPU"):
                    continue  # an offload tier's (CPU): not the device's prefix cache
                if isinstance(event, BlockStored):
                    self._stored(replica, event)
                elif isinstance(event, BlockRemoved):
                    self._removed(replica, event.group_idx, event.block_hashes)
                else:
                    self._drop(replica)
            self.heard_at[replica] = time.monotonic() if now is None else now
            self._awaiting.pop(replica, None)

    def expect(self, replica: str, now: float | None = None) -> None:
        """``replica`` was sent blocks it does not hold: it will report storing them."""
        self._awaiting.setdefault(replica, time.monotonic() if now is None else now)

    def silent(self, replica: str, now: float | None = None) -> bool:
        """Whether ``replica`` owes a report for longer than ``SILENT_S``."""
        since = self._awaiting.get(replica)
        return since is not None and (time.monotonic() if now is None else now) - since > SILENT_S

    def _stored(self, replica: str, event: BlockStored) -> None:
        mine, group = self._blocks[replica], event.group_idx
        size, tokens = event.block_size, event.token_ids
        extras = _extras(event)
        if size <= 0 or len(tokens) != len(event.block_hashes) * size or extras is None:
            self.skipped += 1  # tokens not one block per hash (a placeholder, a window's skipped blocks)
            return
        if event.parent_block_hash is None:
            parent = root_hash(event.lora_name)
        else:
            known = mine.get((group, event.parent_block_hash))
            if known is None:  # its parent was stored before we listened (or evicted): unusable
                self.skipped += 1
                return
            parent = known
        for i, vllm_hash in enumerate(event.block_hashes):
            extra = extras[i]
            if extra is None:
                parent = hash((parent, *tokens[i * size:(i + 1) * size]))
            else:  # as chain() folds a salt in
                parent = hash((parent, *tokens[i * size:(i + 1) * size], extra))
            before = mine.get((group, vllm_hash))
            if before == parent:
                continue  # reported again: held once
            if before is not None:  # the hash stored again for other tokens: the old entry goes
                self._unhold(before, replica)
            mine[group, vllm_hash] = parent
            held = self._holders.setdefault(parent, {})
            held[replica] = held.get(replica, 0) + 1

    def _removed(self, replica: str, group: int | None, hashes: Iterable[BlockHash]) -> None:
        mine = self._blocks.get(replica)
        if mine is None:
            return
        for vllm_hash in hashes:
            ours = mine.pop((group, vllm_hash), None)
            if ours is not None:  # else stored before we listened
                self._unhold(ours, replica)

    def _drop(self, replica: str) -> None:
        for ours in self._blocks.pop(replica, {}).values():
            self._unhold(ours, replica)

    def _unhold(self, ours: int, replica: str) -> None:
        holders = self._holders.get(ours)
        if holders is not None and replica in holders:
            holders[replica] -= 1
            if not holders[replica]:
                del holders[replica]
            if not holders:
                del self._holders[ours]

    def drop(self, replica: str) -> None:
        """Forget everything ``replica`` held (it left, restarted, or its events were lost)."""
        with self._lock:
            self._drop(replica)
            self.heard_at.pop(replica, None)
            self._awaiting.pop(replica, None)

    def depths(self, blocks: Sequence[int], replicas: Container[str] | None = None) -> dict[str, int]:
        """How many of ``blocks`` (a prompt's chained hashes), from the first, each replica
        holding at least the first holds (of ``replicas`` only, where given). Costs what the
        holders of the prompt's blocks number, not what the replicas do."""
        with self._lock:
            first = self._holders.get(blocks[0]) if blocks else None
            if not first:
                return {}
            depth = {n: 1 for n in first if replicas is None or n in replicas}
            for i, block in enumerate(blocks[1:], start=1):
                holders = self._holders.get(block)
                if not holders:
                    break
                advanced = False
                for name in holders:
                    if depth.get(name) == i:
                        depth[name] = i + 1
                        advanced = True
                if not advanced:
                    break
        return depth
