"""Short prompts are tokenized on the event loop, long ones still in vLLM's tokenizer thread
(engine/vllm/inline_tokenize.py)."""

from __future__ import annotations

import asyncio
import inspect
import threading

from vllm.renderers.base import BaseRenderer
from vllm.tokenizers.hf import ThreadSafeHFTokenizerMixin

from atomr_infer.engine.vllm.inline_tokenize import tokenize_short_prompts_inline
from atomr_infer.routing.picker import INLINE_TOKENIZE_CHARS as INLINE_CHARS


class PooledTokenizer(ThreadSafeHFTokenizerMixin):
    """What vLLM's HF renderer makes of its tokenizer: a pool each call borrows a copy from."""


class Renderer:
    """vLLM 0.32's renderer as the wrapper sees it: ``_tokenize_prompt`` (sync) and its
    offloaded ``_tokenize_prompt_async``; records the thread each prompt was tokenized on."""

    def __init__(self, tokenizer: object = None) -> None:
        self.threads: list[str] = []
        self.tokenizer = PooledTokenizer() if tokenizer is None else tokenizer

        async def offloaded(prompt, params):
            return await asyncio.to_thread(self._tokenize_prompt, prompt, params)

        self._tokenize_prompt_async = offloaded

    def _tokenize_prompt(self, prompt, params):
        self.threads.append(threading.current_thread().name)
        return {"prompt_token_ids": [len(prompt["prompt"])], "params": params}


def test_short_prompts_skip_the_thread_and_long_ones_keep_it():
    renderer = Renderer()
    assert tokenize_short_prompts_inline(renderer)
    wrapped = renderer._tokenize_prompt_async
    assert tokenize_short_prompts_inline(renderer) and renderer._tokenize_prompt_async is wrapped  # once

    async def main():
        short = await renderer._tokenize_prompt_async({"prompt": "x" * (INLINE_CHARS - 1)}, "p")
        long = await renderer._tokenize_prompt_async({"prompt": "x" * INLINE_CHARS}, "p")
        return short, long, threading.current_thread().name

    short, long, loop_thread = asyncio.run(main())
    assert short == {"prompt_token_ids": [INLINE_CHARS - 1], "params": "p"}
    assert long == {"prompt_token_ids": [INLINE_CHARS], "params": "p"}
    assert renderer.threads[0] == loop_thread and renderer.threads[1] != loop_thread


def test_a_tokenizer_shared_with_vllms_thread_is_left_to_that_thread():
    """A renderer whose tokenizer is one raw object (not vLLM's pool) keeps every call in its
    thread: the loop calling it at the same time could find it borrowed."""
    renderer = Renderer(tokenizer=object())
    offloaded = renderer._tokenize_prompt_async
    assert not tokenize_short_prompts_inline(renderer)
    assert renderer._tokenize_prompt_async is offloaded


def test_vllms_renderer_still_offloads_through_the_attribute_wrapped():
    """The wrapper replaces an attribute of vLLM's own renderer: if vLLM renames it, it would
    silently wrap nothing, so this fails instead."""
    init = inspect.getsource(BaseRenderer.__init__)
    assert "self._tokenize_prompt_async = make_async(" in init and "self._tokenize_prompt," in init
    assert "await self._tokenize_prompt_async(prompt, params)" in inspect.getsource(BaseRenderer)
    assert not tokenize_short_prompts_inline(object())  # a renderer without it is left alone
