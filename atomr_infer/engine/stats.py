"""Latency and token counters a replica reports through ``stats()``, kept by its backend's
per-request streams (engine-neutral: a stream's token counts and timestamps)."""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a backend's per-request stream (engine/vllm/stream.py)
    from atomr_infer.engine.vllm.stream import RequestStream

WINDOW = 1024  # summaries cover the most recent requests


@dataclass(frozen=True)
class Summary:
    count: int
    p50: float | None
    p95: float | None

    @classmethod
    def of(cls, values: collections.deque[float]) -> Summary:
        if not values:
            return cls(0, None, None)
        ordered = sorted(values)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return cls(len(ordered), statistics.median(ordered), p95)


@dataclass(frozen=True)
class ReplicaStats:
    phase: str
    in_flight: int
    waiting: int  # queued in vLLM, not scheduled yet (no engine metrics: admitted with no token yet)
    requests_started: int
    requests_finished: int
    requests_aborted: int
    tokens_generated: int
    ttft_s: Summary
    time_per_output_token_s: Summary
    kv_cache_usage: float | None
    uptime_s: float
    steps: int
    engine_unfinished: int | None  # requests the engine itself still holds
    prompt_tokens: int = 0  # of finished requests
    prompt_tokens_cached: int = 0  # of those, found in vLLM's prefix cache


class StatsCollector:
    def __init__(self) -> None:
        self.requests_started = self.requests_finished = self.requests_aborted = 0
        self.tokens_generated = 0
        self.prompt_tokens = self.prompt_tokens_cached = 0
        self._ttft: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._tpot: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def started(self) -> None:
        self.requests_started += 1

    def aborted(self) -> None:
        self.requests_aborted += 1

    def finished(self, stream: RequestStream) -> None:
        self.requests_finished += 1
        self.tokens_generated += stream.completion_tokens
        self.prompt_tokens += stream.prompt_tokens
        self.prompt_tokens_cached += stream.cached_tokens
        if stream.first_token_at is not None:
            self._ttft.append(stream.first_token_at - stream.submitted_at)
            if stream.last_token_at is not None and stream.decode_tokens > 1:  # per sequence, not per n choices
                decode = stream.last_token_at - stream.first_token_at
                self._tpot.append(decode / (stream.decode_tokens - 1))

    def snapshot(self, **live: object) -> ReplicaStats:
        return ReplicaStats(
            requests_started=self.requests_started,
            requests_finished=self.requests_finished,
            requests_aborted=self.requests_aborted,
            tokens_generated=self.tokens_generated,
            prompt_tokens=self.prompt_tokens,
            prompt_tokens_cached=self.prompt_tokens_cached,
            ttft_s=Summary.of(self._ttft),
            time_per_output_token_s=Summary.of(self._tpot),
            **live,  # type: ignore[arg-type]
        )
