"""A replica's open requests: one ``RequestStream`` each, between the step loop and the callers.

Touched only from the actor's event loop. A stream is registered *before* its request is
submitted to the step loop, so no output can arrive for an unknown id; each engine step's
outputs are spread over the streams by ``dispatch``. Counts, metrics and per-request logs of
starts, finishes, failures and aborts are kept here, where those happen.
"""

from __future__ import annotations

import time
from typing import Any

from atomr_infer.engine.stats import StatsCollector
from atomr_infer.engine.vllm.step_loop import StepLoop
from atomr_infer.engine.vllm.stream import RequestStream, finish_reason
from atomr_infer.errors import InvalidRequest
from atomr_infer.metrics import ReplicaMetrics, failure_reason


class OpenStreams:
    def __init__(self, loop: StepLoop, stats: StatsCollector, metrics: ReplicaMetrics, log: Any) -> None:
        self._loop, self._stats, self._metrics, self._log = loop, stats, metrics, log
        self._streams: dict[str, RequestStream] = {}
        # Why no stream can run any more (the engine failed, was found wedged, or shut down): a
        # request vLLM's serving layer was still preparing then would wait for output for good.
        self.failed: BaseException | None = None

    def __len__(self) -> int:
        return len(self._streams)

    def prefilling_tokens(self) -> int:
        """Prompt tokens of the open requests without their first token yet."""
        return sum(s.prompt_tokens for s in self._streams.values() if s.first_token_at is None)

    @property
    def waiting(self) -> int:
        """Open requests without their first token yet."""
        return sum(1 for s in self._streams.values() if s.first_token_at is None)

    def open(
        self, request_id: str, prompt_tokens: int, prompt: Any, params: Any, logged_id: str | None = None,
        **options: Any,
    ) -> RequestStream:
        """Register a stream, then submit its request to the step loop (in that order)."""
        if request_id in self._streams:
            raise InvalidRequest("request_id", f"{request_id!r} is already in flight on this replica")
        kind = getattr(getattr(params, "output_kind", None), "name", None)
        stream = RequestStream(request_id, prompt_tokens, logged_id, cumulative=kind == "CUMULATIVE")
        if self.failed is not None:  # nothing would ever step it: its consumer raises at once
            stream.fail(self.failed)
            return stream
        self._streams[request_id] = stream  # registered before it can produce output
        self._stats.started()
        self._metrics.request_started()
        self._log.debug("request_started", request_id=stream.logged_id, prompt_tokens=prompt_tokens)
        self._loop.submit(request_id, prompt, params, **options)
        return stream

    def close(self, stream: RequestStream) -> None:
        """The consumer is done with ``stream``; abort it in the engine if it is still running."""
        self._streams.pop(stream.request_id, None)
        if not stream.finished:
            self._loop.abort([stream.request_id])
            self._stats.aborted()
            self._metrics.request_failed("aborted")
            self._log.info("request_aborted", request_id=stream.logged_id)

    def dispatch(self, outputs: list[Any]) -> None:
        """One engine step's outputs, each to its stream."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            stream.put(out)
            if out.finished:
                self._stats.finished(stream)
                self._finished(stream, finish_reason(out))

    def _finished(self, s: RequestStream, finish: str) -> None:
        self._metrics.request_finished(
            finish, s.prompt_tokens, s.completion_tokens, s.submitted_at, s.first_token_at, s.last_token_at,
            decode_tokens=s.decode_tokens,
        )
        self._log.debug(
            "request_finished",
            request_id=s.logged_id,
            finish_reason=finish,
            prompt_tokens=s.prompt_tokens,
            completion_tokens=s.completion_tokens,
            ttft_s=None if s.first_token_at is None else round(s.first_token_at - s.submitted_at, 4),
            e2e_s=round(time.monotonic() - s.submitted_at, 4),
        )

    def fail_one(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and not stream.finished:
            stream.fail(error)
            self._metrics.request_failed(failure_reason(error))
            self._log.debug("request_failed", request_id=stream.logged_id, error=str(error))

    def fail_all(self, error: BaseException) -> None:
        """Fail every open stream, and every one opened from now on, with ``error``."""
        self.failed = self.failed or error
        for stream in list(self._streams.values()):
            if not stream.finished:
                stream.fail(error)
                self._metrics.request_failed(failure_reason(error))
