"""Request limits per API key and per deployment (``serving.rate_limits``), one budget for the
whole API however many ingress replicas serve it.

A budget is a token bucket: ``requests_per_minute`` requests at once, refilled at that rate.
The buckets live in one small actor (``atomr-ratelimit``), created by the first ingress
replica that needs it, so that limits hold across ingress replicas; each limited request
costs one call to it. A refused request gets 429 with ``Retry-After`` and OpenAI's
``x-ratelimit-*-requests`` headers, which accepted ones carry too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from atomr_infer.errors import RequestError

LIMITER_NAME = "atomr-ratelimit"


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again
    retry_after_s: float = 0.0  # until one request fits, when refused

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers (and ``Retry-After`` on a refusal)."""
        out = {
            "x-ratelimit-limit-requests": str(self.limit),
            "x-ratelimit-remaining-requests": str(self.remaining),
            "x-ratelimit-reset-requests": f"{self.reset_s:.3f}s",
        }
        if not self.allowed:
            out["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return out


class RateLimited(RequestError):
    """Over a key's or a deployment's ``requests_per_minute`` (HTTP 429)."""

    def __init__(self, subject: str, verdict: Verdict) -> None:
        super().__init__(subject, verdict)
        self.subject, self.verdict = subject, verdict  # "the API key 'alice'", "deployment 'smollm2'"

    def __str__(self) -> str:
        return (
            f"{self.subject} is over its limit of {self.verdict.limit} requests per minute; "
            f"retry in {max(1, math.ceil(self.verdict.retry_after_s))}s"
        )


class Buckets:
    """Token buckets by key name; pure, with the clock given (the actor below holds one)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._state: dict[str, tuple[float, float, int]] = {}  # name -> (tokens, at, per minute)

    def take(self, name: str, per_minute: int) -> Verdict:
        now = self._clock()
        tokens, at, known = self._state.get(name, (float(per_minute), now, per_minute))
        if known != per_minute:  # the limit changed with the key file: start full at the new one
            tokens, at = float(per_minute), now
        rate = per_minute / 60.0
        tokens = min(float(per_minute), tokens + (now - at) * rate)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        self._state[name] = (tokens, now, per_minute)
        reset = (per_minute - tokens) / rate
        retry = 0.0 if allowed else (1.0 - tokens) / rate
        return Verdict(allowed, per_minute, int(tokens), reset, retry)


class RateLimiter:
    """The Ray actor that holds every ingress replica's buckets (``limiter_handle``)."""

    def __init__(self) -> None:
        self._buckets = Buckets()

    def take(self, name: str, per_minute: int) -> Verdict:
        return self._buckets.take(name, per_minute)


def limiter_handle():  # noqa: ANN201 - a Ray actor handle
    """The shared limiter actor, created on first use (by whichever ingress replica comes first)."""
    import ray

    from atomr_infer.cluster import NAMESPACE

    return (
        ray.remote(RateLimiter)
        .options(name=LIMITER_NAME, namespace=NAMESPACE, get_if_exists=True, num_cpus=0, lifetime="detached")
        .remote()
    )
