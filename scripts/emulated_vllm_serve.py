#!/usr/bin/env python
"""``vllm serve`` over the emulated engine's core: the peer arm of scripts/bench_dataplane.py.

    .venv/bin/python scripts/emulated_vllm_serve.py --step-ms 10 -- <vllm serve arguments>

vLLM's own API server and ``AsyncLLM`` (its tokenizer, input and output processing, output
handler) run unchanged; only the engine-core client is the emulated engine's ``TimedCore``
(atomr_infer/engine/vllm/emulated.py), given the async methods ``AsyncLLM`` calls. So the ideal rate
is streams / step time here too, and what it delivers below that is vLLM's own front half in one
API process: the ceiling a user of ``vllm serve`` gets on this CPU, beside atomr's arms.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from atomr_infer.engine.vllm.emulated import TOKEN_TEXT, TimedCore  # noqa: E402
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
    step_ms = 10.0
    if args[:1] == ["--step-ms"]:
        step_ms, args = float(args[1]), args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    # The emulated core is a thread of this process, where vllm serve's core is a process of its
    # own: with CPython's 5 ms switch interval it would wait behind the API server's thread for
    # up to 5 ms a step. What atomr's serving process uses (serving_process.py), so
    # the core keeps time here too; it favours the peer if anything.
    sys.setswitchinterval(SWITCH_INTERVAL_S)

    from vllm.v1.engine.core_client import EngineCoreClient

    def make_async_mp_client(*_args: Any, renderer: Any = None, **_kw: Any) -> AsyncTimedCore:
        token = renderer.tokenizer.encode(TOKEN_TEXT, add_special_tokens=False)[0]
        return AsyncTimedCore(step_ms / 1000, token)

    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)  # type: ignore[method-assign]

    import runpy

    sys.argv = ["vllm.entrypoints.openai.api_server", *args]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
