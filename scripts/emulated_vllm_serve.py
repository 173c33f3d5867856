#!/usr/bin/env python
"""``vllm serve`` over the emulated engine's core: the peer arm of scripts/bench_dataplane.py.

    .venv/bin/python scripts/emulated_vllm_serve.py --step-ms 10 [--core-process] -- <vllm serve arguments>

vLLM's own API server and ``AsyncLLM`` (its tokenizer, input and output processing, output
handler) run unchanged; only the engine-core client is the emulated engine's ``TimedCore``
(atomr_infer/engine/vllm/emulated.py), given the async methods ``AsyncLLM`` calls. So the ideal rate
is streams / step time here too, and what it delivers below that is vLLM's own front half in one
API process: the ceiling a user of ``vllm serve`` gets on this CPU, beside atomr's arms.

With ``--core-process`` the core is a process of its own, as ``vllm serve``'s is on a GPU, behind
vLLM's own ``AsyncMPClient`` (ZMQ, msgpack, its output task): emulated.py ``core_process_client``.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from atomr_infer.engine.vllm.emulated import CoreProcess, TimedCore, core_process_client, token_id  # noqa: E402
from atomr_infer.serving_process import SWITCH_INTERVAL_S  # noqa: E402


class AsyncTimedCore(TimedCore):
    """The async engine-core client ``AsyncLLM`` talks to (``AsyncMPClient``'s methods it uses)."""

    engine_ranks_managed = [0]

    class resources:  # noqa: N801 - BackgroundResources: AsyncLLM.errored reads engine_dead
        engine_dead = False

    async def get_output_async(self) -> Any:
        return await asyncio.get_running_loop().run_in_executor(None, self.get_output)

    async def add_request_async(self, request: Any) -> None:
        self.add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return self.get_supported_tasks()

    async def reset_mm_cache_async(self) -> None:
        return None

    async def reset_prefix_cache_async(self, *args: Any, **kwargs: Any) -> bool:
        return True

    async def is_sleeping_async(self) -> bool:
        return False


def main() -> None:
    args = sys.argv[1:]
    step_ms, core_process = 10.0, False
    while args[:1] in (["--step-ms"], ["--core-process"]):
        if args[0] == "--core-process":
            core_process, args = True, args[1:]
        else:
            step_ms, args = float(args[1]), args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not core_process:
        # The emulated core is a thread of this process, where vllm serve's core is a process of
        # its own: with CPython's 5 ms switch interval it would wait behind the API server's
        # thread for up to 5 ms a step. What atomr's serving process uses (serving_process.py),
        # so the core keeps time here too; it favours the peer if anything. A core in its own
        # process needs nothing of the kind: vllm serve runs as it is.
        sys.setswitchinterval(SWITCH_INTERVAL_S)

    from vllm.v1.engine.core_client import EngineCoreClient

    # Started first, as emulated_engine does: its imports overlap the server's start.
    core = CoreProcess.start(step_ms / 1000) if core_process else None

    def make_async_mp_client(vllm_config: Any, executor_class: Any, log_stats: bool, *client_args: Any,
                             renderer: Any = None, **client_kwargs: Any) -> Any:
        if core is not None:
            return core_process_client(True, core, token_id(renderer), vllm_config, executor_class, log_stats,
                                       *client_args, renderer=renderer, **client_kwargs)
        return AsyncTimedCore(step_ms / 1000, token_id(renderer))

    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)  # type: ignore[method-assign]

    import runpy

    sys.argv = ["vllm.entrypoints.openai.api_server", *args]
    try:
        runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
    finally:
        if core is not None:  # the client shuts it down; this covers a server that failed first
            core.shutdown()


if __name__ == "__main__":
    main()
