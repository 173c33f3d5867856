"""Short prompts tokenized on the event loop, not in vLLM's tokenizer thread.

vLLM's renderer hands every prompt to a thread pool (``make_async``), so that a long one does
not hold up the event loop. For a short prompt the hand-off costs more than the tokenizing: the
thread must take the GIL from a busy event loop and give the result back through it, and a
burst's prompts queue one behind another on that thread. Measured with the emulated engine (a
core in its own process, 2 ms steps, 64 streams opened at once over HTTP): the replica took
~50 ms from a request's start to its engine request, most of it in that queue. Prompts up to
``INLINE_CHARS`` characters (about 1,000 tokens, ~2.5 ms of tokenizing at most) are tokenized
inline; longer ones still go to vLLM's thread, as ``vllm serve`` sends them all.
"""

from __future__ import annotations

from typing import Any

INLINE_CHARS = 4000  # as routing/prompt_tokens.py tokenizes in the router


def tokenize_short_prompts_inline(renderer: Any) -> None:
    """Wrap ``renderer``'s offloaded tokenizing (vLLM 0.32's ``_tokenize_prompt_async``, which
    its ``_tokenize_singleton_prompt_async`` awaits) so that short prompts skip the thread.
    A renderer without it is left as it is."""
    offloaded = getattr(renderer, "_tokenize_prompt_async", None)
    inline = getattr(renderer, "_tokenize_prompt", None)
    if offloaded is None or inline is None or getattr(offloaded, "atomr_inline", False):
        return

    async def tokenize(prompt: Any, params: Any) -> Any:
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if isinstance(text, str) and len(text) <= INLINE_CHARS:
            return inline(prompt, params)
        return await offloaded(prompt, params)

    tokenize.atomr_inline = True  # type: ignore[attr-defined]
    renderer._tokenize_prompt_async = tokenize
