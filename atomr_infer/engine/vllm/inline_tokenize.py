"""Short text prompts tokenized on the event loop, not in vLLM's tokenizer thread.

vLLM's renderer hands every text prompt to a thread pool (``make_async``), so that a long one
does not hold up the event loop. For a short prompt the hand-off costs more than the
tokenizing: the thread must take the GIL from a busy event loop and give the result back
through it, and a burst's prompts queue one behind another on that thread. Measured with the
emulated engine (a core in its own process, 2 ms steps): 64 streams opened at once through the
Client were all admitted in 0.05-0.06 s instead of 0.06-0.14 s (docs/performance.md).

Prompts under ``INLINE_TOKENIZE_CHARS`` characters (the router's own limit, routing/picker.py:
about 1,000 tokens, ~2.5 ms at most) are tokenized inline; longer ones still go to vLLM's thread,
as ``vllm serve`` sends them all. The limit is per prompt: a burst of short ones holds the loop
for the sum of theirs, which the hand-offs cost more than. Only text prompts come this way
(``/v1/completions``, text embeddings, ``/tokenize``): a chat's template is rendered and
tokenized together in vLLM's thread (``_apply_chat_template_async``), which is left as it is.

Only where the tokenizer is vLLM's thread-safe pool (``ThreadSafeHFTokenizerMixin``, which the
HF renderer makes): there each call borrows a copy of its own. A renderer that shares one raw
tokenizer between its thread and this loop (a Rust tokenizer set for another truncation can
raise "Already borrowed") keeps vLLM's behaviour.
"""

from __future__ import annotations

from typing import Any

from atomr_infer.routing.picker import INLINE_TOKENIZE_CHARS


def tokenize_short_prompts_inline(renderer: Any) -> bool:
    """Wrap ``renderer``'s offloaded tokenizing (vLLM 0.32's ``_tokenize_prompt_async``, which
    its ``_tokenize_singleton_prompt_async`` awaits) so that short prompts skip the thread.
    Whether it did: a renderer without it, or without a thread-safe tokenizer, is left as it is."""
    from vllm.tokenizers.hf import ThreadSafeHFTokenizerMixin

    offloaded = getattr(renderer, "_tokenize_prompt_async", None)
    inline = getattr(renderer, "_tokenize_prompt", None)
    if offloaded is None or inline is None or not isinstance(getattr(renderer, "tokenizer", None),
                                                             ThreadSafeHFTokenizerMixin):
        return False
    if getattr(offloaded, "atomr_inline", False):
        return True

    async def tokenize(prompt: Any, params: Any) -> Any:
        text = prompt.get("prompt") if isinstance(prompt, dict) else None
        if isinstance(text, str) and len(text) < INLINE_TOKENIZE_CHARS:
            return inline(prompt, params)
        return await offloaded(prompt, params)

    tokenize.atomr_inline = True  # type: ignore[attr-defined]
    renderer._tokenize_prompt_async = tokenize
    return True
