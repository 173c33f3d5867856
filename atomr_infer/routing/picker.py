"""Which ready replica a request goes to, by the deployment's ``routing`` settings, and why.

``ReplicaPicker`` holds what a router remembers between requests to decide: the prompt prefixes
it sent where (one ``PrefixIndex`` per deployment, and per adapter, since vLLM caches per
adapter) and the count of each reason it picked for. Policies: ``power_of_two`` (policy.py),
``prefix_affinity`` (prefix.py), ``kv_events`` (kv_policy.py: from the replicas' own KV-cache
events), a LoRA adapter's home (adapters.py), alone or with either of the last two.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from atomr_infer.log import get_logger
from atomr_infer.metrics import RouterMetrics
from atomr_infer.routing.adapters import pick_adapter_home
from atomr_infer.routing.kv_index import chain
from atomr_infer.routing.kv_policy import QueuedPrefill, pick_by_depth
from atomr_infer.routing.kv_subscriber import hub as kv_hub
from atomr_infer.routing.policy import pick_replica
from atomr_infer.routing.prefix import PrefixIndex, pick_prefix_affinity
from atomr_infer.routing.prompt_tokens import tokenizers
from atomr_infer.routing.table import DeploymentRoute, ReplicaRoute, RoutingTable
from atomr_infer.wire import RequestKind, RoutingFacts

log = get_logger(__name__)
MAX_KV_BLOCKS = 256  # a prompt's leading blocks matched by kv_events (32k tokens of 128)
# Shorter prompts are tokenized on the event loop, here and in replicas: a thread hop costs more.
INLINE_TOKENIZE_CHARS = 4000


@dataclass(frozen=True, slots=True)
class PromptIds:
    """A prompt's token ids and the model whose tokenizer made them: only replicas serving that
    model are matched by them (mid-roll to another model, the others hold other ids); ``salt``:
    the request's ``cache_salt``, in its first block's hash as vLLM puts it there."""

    model: str
    ids: list[int]
    salt: str | None = None


def tokenizer_source(dep: DeploymentRoute, usable: list[ReplicaRoute]) -> ReplicaRoute | None:
    """kv_events: the replica whose model's tokenizer a prompt is tokenized with: one serving the
    deployment's model (the one a roll goes to), else (none of those usable for this request) the
    first that publishes events. By the deployment's model first, so requests do not alternate
    between two models' tokenizers mid-roll."""
    publishing = [r for r in usable if r.kv_events is not None]
    return next((r for r in publishing if r.model == dep.model), publishing[0] if publishing else None)


def tokenizer_key(route: ReplicaRoute) -> str:
    """What a router's tokenizer for ``route`` is kept under: its model, and what its server
    renders chats with (a roll that changes only the chat template gets a new one)."""
    return f"{route.model}#{route.renders}" if route.renders else route.model


class ReplicaPicker:
    def __init__(self) -> None:
        # (deployment, adapter) -> the prefixes sent where; pruned as the table drops either
        self._prefixes: collections.defaultdict[tuple[str, str | None], PrefixIndex] = collections.defaultdict(
            PrefixIndex)
        self._tokenized: set[str] = set()  # the deployments whose tokenizers the last table kept
        self.reasons: collections.Counter[tuple[str, str]] = collections.Counter()  # (deployment, reason)
        self._metrics: RouterMetrics | None = None  # built on first use: inside Ray, they are exported
        self._followed: dict[str, DeploymentRoute] = {}  # kv_events: the route whose replicas are followed
        # kv_events: blocks of prefill this router sent each replica and had no answer to yet
        self._queued: collections.Counter[str] = collections.Counter()
        self._work: tuple[str, int] | None = None  # what the last pick queued

    @property
    def metrics(self) -> RouterMetrics:
        if self._metrics is None:
            self._metrics = RouterMetrics()
        return self._metrics

    def close(self) -> None:
        """Stop following what this router followed (the process's listener serves other routers too)."""
        for name in list(self._followed):
            kv_hub().follow(name, {}, self)
        self._followed.clear()

    def table_changed(self, table: RoutingTable) -> None:
        """Forget what only a deployment, or an adapter, gone from ``table`` (or routing by another
        policy now) needed: the KV events this router followed (their sockets and index), the
        tokenizers of models no replica serves, the prefixes sent (up to 200,000 blocks each)."""
        for name in list(self._followed):
            dep = table.deployments.get(name)
            if dep is None or dep.policy != "kv_events":
                kv_hub().follow(name, {}, self)
                del self._followed[name]
        # Each deployment of the table, and each of the last one's no longer in it, is named:
        # those that do not route by kv_events (now) keep no tokenizer.
        served = {name: {dep.model, *(tokenizer_key(r) for r in dep.replicas)} if dep.policy == "kv_events" else set()
                  for name, dep in table.deployments.items()}
        tokenizers().retain({**dict.fromkeys(self._tokenized - set(served), set()), **served})
        self._tokenized = {name for name, models in served.items() if models}
        for name, adapter in list(self._prefixes):
            dep = table.deployments.get(name)
            if (dep is None or dep.policy not in ("prefix_affinity", "kv_events")
                    or adapter is not None and adapter not in dep.adapters):
                del self._prefixes[name, adapter]

    async def prompt_tokens(
        self, dep: DeploymentRoute, usable: list[ReplicaRoute], facts: RoutingFacts,
    ) -> PromptIds | None:
        """``routing.policy: kv_events``: the token ids of the prompt of ``facts`` as the engine will
        see them (None where unknown here: another policy, no tokenizer fetched yet). A long prompt
        is tokenized in a thread (milliseconds for thousands of tokens) while the event loop routes
        others."""
        prompt, template = facts.prompt, facts.template
        # Responses and Messages requests render their own way (instructions, a system field,
        # typed parts): known only for chats and completions, which the router renders as vLLM.
        if dep.policy != "kv_events" or prompt is None or facts.kind not in (RequestKind.CHAT, RequestKind.COMPLETION):
            return None
        source = tokenizer_source(dep, usable)
        if source is None:
            return None
        tokenizer = tokenizers().get(dep.name, source.actor, tokenizer_key(source))
        if tokenizer is None:
            return None
        if len(str(prompt)) < INLINE_TOKENIZE_CHARS:
            ids = tokenizer.tokens(prompt, template)
        else:
            ids = await asyncio.to_thread(tokenizer.tokens, prompt, template)
        return None if ids is None else PromptIds(source.model, ids, facts.cache_salt)

    def pick(
        self, dep: DeploymentRoute, usable: list[ReplicaRoute], loads: Mapping[str, int], key: Callable[[], Any],
        adapter: str | None = None, tokens: PromptIds | None = None, waiting: Callable[[str], int] | None = None,
    ) -> ReplicaRoute | None:
        """The replica of ``usable`` (each with its ``loads``) for a request for ``adapter`` (None:
        the base model) whose prompt key ``key`` gives (read only where a policy needs it) and
        whose token ids are ``tokens`` (``prompt_tokens``); None when every one is full.
        ``waiting``: the blocks of prefill waiting on a replica, by its own word (kv_events)."""
        home = None
        if adapter is not None and dep.adapter_affinity:  # its home: fewer adapters per replica, fewer swaps
            home = functools.partial(pick_adapter_home, usable, loads, dep.max_concurrent, adapter, dep.load_bound)

        def by_prefix() -> tuple[Any, str]:  # a prefix sent there before, else its adapter's home
            prefixes = self._prefixes[dep.name, adapter]  # vLLM caches per adapter
            return pick_prefix_affinity(usable, loads, dep.max_concurrent, key(), prefixes, dep.load_bound, home)

        def conversation() -> bytes | None:  # kv_events breaks a tie of equal cost by it
            found = key()
            return None if found is None else found.conversation

        if dep.policy == "kv_events":
            choice, reason = self._by_kv_events(dep, usable, loads, adapter, tokens, by_prefix, waiting, conversation)
        elif dep.policy == "prefix_affinity":
            choice, reason = by_prefix()
        elif home is not None:
            choice, reason = home()
        else:
            return pick_replica(usable, loads, dep.max_concurrent)
        if choice is not None:
            self.reasons[dep.name, reason] += 1
            self.metrics.routed(dep.name, reason)
            log.debug("route", deployment=dep.name, replica=choice.actor_name, reason=reason)
        return choice  # type: ignore[return-value]

    def _by_kv_events(
        self, dep: DeploymentRoute, usable: list[ReplicaRoute], loads: Mapping[str, int], adapter: str | None,
        tokens: PromptIds | None, by_prefix: Callable[[], tuple[Any, str]],
        waiting: Callable[[str], int] | None = None, conversation: Callable[[], bytes | None] | None = None,
    ) -> tuple[Any, str]:
        """The replica whose request would cost least by what it holds and what waits there
        (routing/kv_policy.py); prefix affinity, its reason marked ``fallback_``, while no usable
        replica's events are fresh or the prompt's tokens are unknown here (no tokenizer yet)."""
        events = kv_hub()
        if self._followed.get(dep.name) is not dep:  # a new table: the replicas to listen to
            events.follow(dep.name, {r.actor_name: r.kv_events[:2] for r in dep.replicas if r.kv_events}, self)
            self._followed[dep.name] = dep
        index, now = events.index(dep.name), time.monotonic()
        # Only the replicas serving the model whose tokenizer gave ``tokens`` are matched by them.
        sources = {r.actor_name: r for r in usable
                   if r.kv_events is not None and tokens is not None and r.model == tokens.model}
        if not tokens or not tokens.ids or not any(not index.silent(name, now) for name in sources):
            choice, reason = by_prefix()
            return choice, f"fallback_{reason}"
        block_size = next(iter(sources.values())).kv_events[2]  # type: ignore[index]
        root = None if adapter is None else f"{dep.name}:{adapter}"
        blocks = chain(tokens.ids, block_size, root, limit=MAX_KV_BLOCKS, salt=tokens.salt)
        depths = {n: d for n, d in index.depths(blocks, sources).items() if not index.silent(n, now)}
        choice, reason = pick_by_depth(usable, loads, dep.max_concurrent, depths, by_prefix, dep.load_bound,
                                       len(blocks), QueuedPrefill(self._queued, waiting), conversation)
        if choice is not None and depths.get(choice.actor_name, 0) < len(blocks):
            index.expect(choice.actor_name, now)  # it will store blocks: it owes us an event
            self._queued[choice.actor_name] += len(blocks) - depths.get(choice.actor_name, 0)
            self._work = (choice.actor_name, len(blocks) - depths.get(choice.actor_name, 0))
        return choice, reason

    def take_work(self, actor_name: str) -> int:
        """The blocks of prefill the last pick queued on ``actor_name`` (0: none), for the router
        to hand back with ``answered`` once the replica answers."""
        work, self._work = self._work, None
        return work[1] if work is not None and work[0] == actor_name else 0

    def answer_once(self, actor_name: str, work: int) -> Callable[[], None]:
        """``answered(actor_name, work)`` the first time it is called: at the request's first
        output, when its replica says its prompt is computed (an answer not streamed), or at
        its end, whichever comes first."""

        def answer() -> None:
            nonlocal work
            if work:
                self.answered(actor_name, work)
                work = 0

        return answer

    def answered(self, actor_name: str, work: int) -> None:
        """A request's first answer came (or it ended): its prefill is no longer queued there."""
        left = self._queued[actor_name] - work
        if left > 0:
            self._queued[actor_name] = left
        else:
            self._queued.pop(actor_name, None)
