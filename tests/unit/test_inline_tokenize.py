"""Short prompts are tokenized on the event loop, long ones still in vLLM's tokenizer thread
(engine/vllm/inline_tokenize.py)."""

from __future__ import annotations

import asyncio
import inspect
import threading

from vllm.renderers.base import BaseRenderer

from atomr_infer.engine.vllm.inline_tokenize import INLINE_CHARS, tokenize_short_prompts_inline


class Renderer:
    """vLLM 0.32's renderer as the wrapper sees it: ``_tokenize_prompt`` (sync) and its
    offloaded ``_tokenize_prompt_async``; records the thread each prompt was tokenized on."""

    def __init__(self) -> None:
        self.threads: list[str] = []

        async def offloaded(prompt, params):
            return await asyncio.to_thread(self._tokenize_prompt, prompt, params)

        self._tokenize_prompt_async = offloaded

    def _tokenize_prompt(self, prompt, params):
        self.threads.append(threading.current_thread().name)
        return {"prompt_token_ids": [len(prompt["prompt"])], "params": params}


def test_short_prompts_skip_the_thread_and_long_ones_keep_it():
    renderer = Renderer()
    tokenize_short_prompts_inline(renderer)
    tokenize_short_prompts_inline(renderer)  # idempotent: wrapped once

    async def main():
        short = await renderer._tokenize_prompt_async({"prompt": "x" * INLINE_CHARS}, "p")
        long = await renderer._tokenize_prompt_async({"prompt": "x" * (INLINE_CHARS + 1)}, "p")
        return short, long, threading.current_thread().name

    short, long, loop_thread = asyncio.run(main())
    assert short == {"prompt_token_ids": [INLINE_CHARS], "params": "p"}
    assert long == {"prompt_token_ids": [INLINE_CHARS + 1], "params": "p"}
    assert renderer.threads[0] == loop_thread and renderer.threads[1] != loop_thread


def test_vllms_renderer_still_offloads_through_the_attribute_wrapped():
    """The wrapper replaces an attribute of vLLM's own renderer: if vLLM renames it, it would
    silently wrap nothing, so this fails instead."""
    init = inspect.getsource(BaseRenderer.__init__)
    assert "self._tokenize_prompt_async = make_async(" in init and "self._tokenize_prompt," in init
    assert "await self._tokenize_prompt_async(prompt, params)" in inspect.getsource(BaseRenderer)
    renderer = object()
    tokenize_short_prompts_inline(renderer)  # a renderer without it is left alone
