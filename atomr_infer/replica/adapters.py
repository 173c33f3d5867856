"""The LoRA adapters a replica serves, kept as the manager wants them.

The manager sends the deployment's adapters (name -> source) with every health check; the
replica resolves each source to a directory (a Hugging Face repo id is fetched into the hub
cache, in a thread), loads what is new or changed (and, with backoff, what failed; at once when
the manager's retry count changes: an unchanged apply) and unloads what is gone, in the
background, and reports each adapter's state with its health: ``loading``, ``loaded``, or
``failed: <why>``. Routers send an adapter's requests only to replicas where it
is loaded, so a replica that is still loading it (or started later, or failed to load it) serves
none of them; one given a new source is ``reloading`` and still routed to (vLLM serves its old
weights) until the new one is in, or failed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from atomr_infer.errors import one_line
from atomr_infer.status import ADAPTER_LOADED as LOADED
from atomr_infer.status import ADAPTER_LOADING as LOADING
from atomr_infer.status import ADAPTER_RELOADING as RELOADING
from atomr_infer.status import ADAPTER_ROUTED

# A load that failed is tried again (a hub fetch that timed out, a file share that blinked) after
# this, doubling with each failure in a row up to RETRY_MAX_S; at once when its source changes.
RETRY_AFTER_S, RETRY_MAX_S = 10.0, 300.0
# (the adapter's full name "<deployment>:<adapter>", its directory) -> loaded; or the name -> unloaded
Load = Callable[[str, str], Awaitable[None]]
Unload = Callable[[str], Awaitable[None]]
Resolve = Callable[[str], object]  # an adapter's source -> its local directory (blocking: run in a thread)


class AdapterSet:
    def __init__(
        self, deployment: str, load: Load, unload: Unload, resolve: Resolve = str, retry_after_s: float = RETRY_AFTER_S,
    ) -> None:
        self._deployment, self._load, self._unload, self._resolve = deployment, load, unload, resolve
        self._paths: dict[str, str] = {}  # adapter -> the source it was (or is being) loaded from
        self.states: dict[str, str] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._retry_after_s = retry_after_s
        self._retry_at: dict[str, tuple[float, int]] = {}  # failed adapter -> (when to try again, failures)
        # adapter -> bumped by every change sync makes to it (kept once removed): only a load of the
        # latest may set its state. Its source alone does not tell: removed and added back (A -> B ->
        # A) while a load ran, the old load finished first and said loaded; the queued unload then
        # dropped it from vLLM, and routers sent it requests vLLM refused.
        self._generations: dict[str, int] = {}
        self._retry = 0  # the manager's retry count last heard (sync's retry)

    def full_name(self, adapter: str) -> str:
        return f"{self._deployment}:{adapter}"

    def sync(self, wanted: dict[str, str], retry: int = 0) -> list[asyncio.Task[None]]:
        """Start loading what ``wanted`` adds or changes and unloading what it drops; the tasks.
        A ``retry`` other than the last one (an unchanged apply: "fix lora.adapters and deploy
        again") tries those that failed again now, not after their backoff, ``loading`` meanwhile."""
        if retry != self._retry:
            self._retry = retry
            for name in [n for n in self._retry_at if n not in self._tasks]:
                self._retry_at[name], self.states[name] = (0.0, 0), LOADING
        started = []
        for name, path in wanted.items():
            if self._paths.get(name) != path:
                # A loaded one given a new source stays routable while it reloads: vLLM serves
                # the old weights until the new ones replace them (in place).
                self._paths[name] = path
                self._retry_at.pop(name, None)
                self.states[name] = RELOADING if self.states.get(name) in (LOADED, RELOADING) else LOADING
                started.append(self._run(name, self._load_one(name, path, self._change(name))))
            elif name in self._retry_at and name not in self._tasks and time.monotonic() >= self._retry_at[name][0]:
                # it says failed until it loads
                started.append(self._run(name, self._load_one(name, path, self._generations[name])))
        for name in [n for n in self._paths if n not in wanted]:
            del self._paths[name]
            self._change(name)
            self._retry_at.pop(name, None)
            self.states.pop(name, None)
            started.append(self._run(name, self._unload(self.full_name(name))))
        return started

    def _change(self, name: str) -> int:
        self._generations[name] = generation = self._generations.get(name, 0) + 1
        return generation

    def _run(self, name: str, work: Awaitable[None]) -> asyncio.Task[None]:
        previous = self._tasks.get(name)

        async def after_previous() -> None:
            if previous is not None:  # one change of an adapter at a time, in order
                await asyncio.gather(previous, return_exceptions=True)
            await work

        task = self._tasks[name] = asyncio.get_running_loop().create_task(after_previous())
        task.add_done_callback(lambda done: self._tasks.pop(name, None) if self._tasks.get(name) is done else None)
        return task

    async def _load_one(self, name: str, path: str, generation: int) -> None:
        try:
            await self._load(self.full_name(name), str(await asyncio.to_thread(self._resolve, path)))
        except Exception as exc:  # noqa: BLE001 - its state says why; the replica serves on
            if self._generations.get(name) == generation:
                self.states[name] = f"failed: {one_line(exc)}"
                failures = self._retry_at.get(name, (0.0, 0))[1] + 1
                wait = min(RETRY_MAX_S, self._retry_after_s * 2 ** (failures - 1))
                self._retry_at[name] = (time.monotonic() + wait, failures)
            return
        if self._generations.get(name) == generation:
            self.states[name] = LOADED
            self._retry_at.pop(name, None)

    def loaded(self) -> frozenset[str]:
        return frozenset(name for name, state in self.states.items() if state in ADAPTER_ROUTED)
