"""Per-request output streams between the step loop and the callers.

A stream holds at most one pending vLLM ``RequestOutput``: if the consumer has not taken the
last one when the next engine step delivers more, the two are merged (``RequestOutput.add``,
as vLLM's ``RequestOutputCollector`` does; merging.py). So memory per request is bounded by its own output,
never by how far the consumer lags, and a caller receives at most one item per engine step.
Streams are touched only from the actor's event loop thread; the step loop hands outputs over
with one ``call_soon_threadsafe`` per engine step, not one per request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from atomr_infer.merging import MergingBuffer


def _merge_outputs(earlier: Any, later: Any) -> Any:
    earlier.add(later, aggregate=True)  # vLLM's RequestOutput (or anything with .add)
    return earlier


def _keep_later(earlier: Any, later: Any) -> Any:
    earlier.add(later, aggregate=False)  # CUMULATIVE: the later output holds all of the earlier
    return earlier


class RequestStream:
    __slots__ = (
        "request_id",
        "logged_id",
        "prompt_tokens",
        "completion_tokens",
        "_choice_tokens",
        "cached_tokens",
        "submitted_at",
        "first_token_at",
        "last_token_at",
        "_cumulative",
        "_outputs",
    )

    def __init__(self, request_id: str, prompt_tokens: int, logged_id: str | None = None,
                 cumulative: bool = False) -> None:
        self.request_id = request_id  # unique on the replica: the engine's
        self.logged_id = logged_id or request_id  # as the serving layer named it (the client's id in it)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0  # of all its choices (n > 1): what usage and the totals count
        self._choice_tokens: dict[int, int] = {}  # by choice index
        self.cached_tokens = 0  # prompt tokens vLLM's prefix cache had (its first output says)
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        # vLLM's CUMULATIVE outputs (its SamplingParams' default, which a few of its serving
        # paths keep) each hold every token so far: merged as vLLM's collector merges them.
        self._cumulative = cumulative
        self._outputs: MergingBuffer[Any] = MergingBuffer(_keep_later if cumulative else _merge_outputs)

    @property
    def finished(self) -> bool:
        return self._outputs.ended

    @property
    def decode_tokens(self) -> int:
        """Tokens of its longest choice: how far one sequence decoded. vLLM steps the n choices of
        a request side by side (one output per choice per step), so time per output token divides
        by these, not by ``completion_tokens``, as vLLM's own per-sequence metric does."""
        return max(self._choice_tokens.values(), default=0)

    def put(self, output: Any) -> None:
        """Deliver one engine step's output for this request (merged if one is pending)."""
        if self._outputs.ended:
            return
        now = time.monotonic()
        self.cached_tokens = max(self.cached_tokens, getattr(output, "num_cached_tokens", None) or 0)
        counts = choice_tokens(output)
        if self._cumulative:  # totals so far: what this step added
            counts = {i: max(0, n - self._choice_tokens.get(i, 0)) for i, n in counts.items()}
        new_tokens = sum(counts.values())
        if new_tokens:
            self.completion_tokens += new_tokens
            for index, count in counts.items():
                self._choice_tokens[index] = self._choice_tokens.get(index, 0) + count
            if self.first_token_at is None and output.finished and new_tokens > 1:
                self.first_token_at, self.last_token_at = whole_answer_times(output, now)
            else:
                self.first_token_at = self.first_token_at or now
                self.last_token_at = now
        self._outputs.put(output)
        if output.finished:
            self._outputs.end()

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error``; the consumer raises it after any pending output."""
        self._outputs.end(error)

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._outputs.__aiter__()


def whole_answer_times(output: Any, now: float) -> tuple[float | None, float | None]:
    """(first, last token) times of an answer that came out whole at ``now`` (``stream: false``:
    vLLM's FINAL_ONLY has no output before its last): its last token now, its first that much
    earlier as vLLM's own stats say its decode took; (None, None) where the engine keeps no stats
    (its time to first token is not its whole latency)."""
    stats = getattr(output, "metrics", None)
    first, last = getattr(stats, "first_token_ts", 0.0) or 0.0, getattr(stats, "last_token_ts", 0.0) or 0.0
    if not first or last < first:
        return None, None
    return now - (last - first), now


def choice_tokens(output: Any) -> dict[int, int]:
    """Tokens an engine step's output adds to each choice, by its index (DELTA: this step's;
    FINAL_ONLY: all)."""
    completions = getattr(output, "outputs", ())
    if not isinstance(completions, list):  # a pooling output: no generated tokens
        return {}
    counts: dict[int, int] = {}
    for c in completions:
        index = getattr(c, "index", 0)
        counts[index] = counts.get(index, 0) + len(getattr(c, "token_ids", ()))
    return counts


def finish_reason(output: Any) -> str:
    completions = getattr(output, "outputs", ())
    first = completions[0] if isinstance(completions, list) and completions else None
    return getattr(first, "finish_reason", None) or "stop"
