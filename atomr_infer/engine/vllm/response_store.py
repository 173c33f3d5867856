"""vLLM's store of Responses-API responses, turned on per deployment and bounded.

vLLM keeps stored responses, their input messages and a background stream's events in three
plain dicts on its Responses serving object, turned on by ``VLLM_ENABLE_RESPONSES_API_STORE``
and never emptied (its own FIXME: "this may cause a memory leak"). The replica sets the switch
from the spec (``serving.openai.response_store``) on that object, not through the process's
environment, and swaps the dicts for ``BoundedStore``s over one ``StoreIndex``: at most
``max_responses`` response ids, each kept ``max_age_s`` after it was last written to any of the
three, and dropped from all three at once. A response whose background task still runs is
never dropped; one still being answered (its input messages stored, not yet the response) is
not pushed out by newer ones, only by its age, while those spared take at most half the store
(vLLM writes no response for a request its client left: those look answering until their age).
Everything else of the store (what is stored when, the 404 for an id it does not hold) is vLLM's.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from atomr_infer.spec.serving import ResponseStore

STORES = ("response_store", "msg_store", "event_store")  # keyed alike: by the response's id


class StoreIndex:
    """When each response id was last written to any of its stores, and which ids go: at most
    ``max_items`` ids, each for ``max_age_s`` after its last write, oldest first, except ids
    ``keep`` says are still in use, and ids ``answering`` says are still being answered, which
    go by their age only. An id goes from every store at once: vLLM writes a response's
    input messages when it starts and the response when it ends, so stores bounded apart kept a
    response whose messages were gone (its next turn then lost the user's earlier turns)."""

    def __init__(
        self, max_items: int, max_age_s: float, keep: Callable[[Any], bool] = lambda key: False,
        clock: Callable[[], float] = time.monotonic, answering: Callable[[Any], bool] = lambda key: False,
    ) -> None:
        self._max_items, self._max_age_s, self._keep, self._clock = max_items, max_age_s, keep, clock
        self._answering = answering
        self._written: collections.OrderedDict[Any, float] = collections.OrderedDict()
        # Ids still being answered that the count pushed out: kept, oldest first, by their age only.
        self._spared: collections.OrderedDict[Any, float] = collections.OrderedDict()
        self.stores: list[BoundedStore] = []

    def store(self) -> BoundedStore:
        """A new store of this index."""
        store = BoundedStore(self)
        self.stores.append(store)
        return store

    def written(self, key: Any) -> None:
        self._spared.pop(key, None)  # answered now: it goes by count again
        self._written[key] = self._clock()
        self._written.move_to_end(key)
        self.evict()

    def dropped(self, key: Any) -> None:
        """``key`` was taken out of one store: forgotten once no store holds it."""
        if not any(dict.__contains__(store, key) for store in self.stores):
            self._written.pop(key, None)
            self._spared.pop(key, None)

    def evict(self) -> None:
        oldest_kept = self._clock() - self._max_age_s
        while self._spared and next(iter(self._spared.values())) <= oldest_kept:  # they go by their age
            self._drop(self._spared.popitem(last=False)[0])
        kept: list[tuple[Any, float]] = []
        while self._written:
            key, at = next(iter(self._written.items()))
            fresh = at > oldest_kept
            if fresh and len(self._written) + len(kept) + len(self._spared) <= self._max_items:
                break
            del self._written[key]
            if self._keep(key):
                kept.append((key, at))
            # Pushed out while it generated, a response was stored without its input messages: its
            # next turn lost the user's earlier ones (a KeyError, 500, under Harmony). Spared, it
            # still goes by its age, and at most half the store is spared: vLLM writes no response
            # for a request whose client left (or that failed), which looks answering until then,
            # and spared without a bound those pushed out every finished response.
            elif fresh and len(self._spared) < self._max_items // 2 and self._answering(key):
                self._spared[key] = at
            else:
                self._drop(key)
        for key, at in reversed(kept):  # still running: back at the front, in their order
            self._written[key] = at
            self._written.move_to_end(key, last=False)
        while self._spared and len(self._written) + len(self._spared) > self._max_items:  # nothing else left
            self._drop(self._spared.popitem(last=False)[0])

    def _drop(self, key: Any) -> None:
        for store in self.stores:
            dict.pop(store, key, None)


class BoundedStore(dict):  # type: ignore[type-arg]
    """One of vLLM's store dicts, bounded by its ``StoreIndex``. Overrides the methods vLLM's
    serving code uses (``get``, ``[]``, ``in``, ``pop``)."""

    def __init__(self, index: StoreIndex) -> None:
        super().__init__()
        self._index = index

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        self._index.written(key)

    def __getitem__(self, key: Any) -> Any:
        self._index.evict()
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._index.evict()
        return super().__contains__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._index.evict()
        return super().get(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        value = super().pop(key, *default)
        self._index.dropped(key)
        return value

    def __delitem__(self, key: Any) -> None:
        super().__delitem__(key)
        self._index.dropped(key)


def configure_response_store(state: Any, config: ResponseStore) -> None:
    """Turn vLLM's response store on or off on the app's Responses serving object (where the
    model has one) and bound it as ``config`` says."""
    serving = getattr(state, "openai_serving_responses", None)
    if serving is None:
        return
    serving.enable_store = config.enabled

    def running(key: Any) -> bool:
        return key in serving.background_tasks

    def answering(key: Any) -> bool:  # its input messages are written as it starts, the response as it ends
        return dict.__contains__(messages, key) and not dict.__contains__(responses, key)

    index = StoreIndex(config.max_responses, config.max_age_s, running, answering=answering)
    for name in STORES:
        setattr(serving, name, index.store())
    responses, messages = serving.response_store, serving.msg_store
