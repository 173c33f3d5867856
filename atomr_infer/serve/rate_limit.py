"""Request and token limits per API key and per deployment (``serving.rate_limits``), one budget
for the whole API however many ingress replicas serve it.

A budget is a token bucket: ``requests_per_minute`` requests at once, refilled at that rate.
A ``tokens_per_minute`` budget admits a request while it is above zero and is charged the
prompt and completion tokens the response reports once it ends (it may go below zero: the
next requests wait until it refills), as OpenAI's token limits do.
The buckets live in one small actor (``atomr-ratelimit``), created by the first ingress
replica that needs it, so that limits hold across ingress replicas; each limited request
costs one call to it. A refused request gets 429 with ``Retry-After`` and OpenAI's
``x-ratelimit-*-requests`` / ``-tokens`` headers, which accepted ones carry too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from atomr_infer.errors import RequestError
from atomr_infer.log import get_logger

LIMITER_NAME = "atomr-ratelimit"
log = get_logger(__name__)


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again
    retry_after_s: float = 0.0  # until one request fits, when refused
    unit: str = "requests"  # or "tokens"

    @property
    def retry_after(self) -> int:
        """``retry_after_s`` as ``Retry-After`` says it: whole seconds, at least 1."""
        return max(1, math.ceil(self.retry_after_s))

    def headers(self) -> dict[str, str]:
        """OpenAI's rate-limit headers (and ``Retry-After`` on a refusal)."""
        out = {
            f"x-ratelimit-limit-{self.unit}": str(self.limit),
            f"x-ratelimit-remaining-{self.unit}": str(self.remaining),
            f"x-ratelimit-reset-{self.unit}": f"{self.reset_s:.3f}s",
        }
        if not self.allowed:
            out["Retry-After"] = str(self.retry_after)
        return out


class RateLimited(RequestError):
    """Over a key's or a deployment's ``requests_per_minute`` or ``tokens_per_minute`` (HTTP 429)."""

    def __init__(self, subject: str, verdict: Verdict) -> None:
        super().__init__(subject, verdict)
        self.subject, self.verdict = subject, verdict  # "the API key 'alice'", "deployment 'smollm2'"

    def __str__(self) -> str:
        return (
            f"{self.subject} is over its limit of {self.verdict.limit} {self.verdict.unit} per minute; "
            f"retry in {self.verdict.retry_after}s"
        )


class Buckets:
    """Token buckets by key name; pure, with the clock given (the actor below holds one)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._state: dict[str, tuple[float, float, int]] = {}  # name -> (tokens, at, per minute)

    def take(
        self, name: str, per_minute: int, cost: float = 1.0, need: float | None = None, unit: str = "requests"
    ) -> Verdict:
        """Allowed when the bucket holds ``need`` (default: ``cost``); then ``cost`` is taken.
        ``need=1, cost=0`` asks "may a request start"; ``need=0, cost=n`` charges n afterwards."""
        need = cost if need is None else need
        now = self._clock()
        tokens, at, known = self._state.get(name, (float(per_minute), now, per_minute))
        if known != per_minute:  # the limit changed: start full at the new one
            tokens, at = float(per_minute), now
        rate = per_minute / 60.0
        tokens = min(float(per_minute), tokens + (now - at) * rate)
        allowed = tokens >= need
        if allowed:
            tokens -= cost
        self._state[name] = (tokens, now, per_minute)
        reset = (per_minute - tokens) / rate
        retry = 0.0 if allowed else (need - tokens) / rate
        return Verdict(allowed, per_minute, max(0, int(tokens)), reset, retry, unit)

    def take_all(self, asks: list[tuple[str, int, float, float, str]]) -> list[Verdict]:
        """``take`` from every bucket of ``asks`` (name, per minute, cost, need, unit) if every one
        allows it, else from none: a request the deployment's budget refuses does not spend its
        key's. The verdicts, a refusing one among them when refused."""
        peeks = [self.take(name, per_minute, 0.0, need, unit) for name, per_minute, _cost, need, unit in asks]
        if not all(v.allowed for v in peeks):
            return peeks
        return [self.take(*ask) for ask in asks]


class RateLimiter:
    """The Ray actor that holds every ingress replica's buckets (``limiter_handle``)."""

    def __init__(self) -> None:
        self._buckets = Buckets()

    def take(
        self, name: str, per_minute: int, cost: float = 1.0, need: float | None = None, unit: str = "requests"
    ) -> Verdict:
        return self._buckets.take(name, per_minute, cost, need, unit)

    def take_all(self, asks: list[tuple[str, int, float, float, str]]) -> list[Verdict]:
        return self._buckets.take_all(asks)


@dataclass(frozen=True)
class Budget:
    """One limit a request is under: a key's or a deployment's, of requests or of tokens."""

    bucket: str  # "key:alice:requests", "deployment:smollm2:tokens"
    subject: str  # "the API key 'alice'", "deployment 'smollm2'"
    per_minute: int
    unit: str  # "requests" | "tokens"


def budgets_of(
    key_name: str | None, key_limits: tuple[int | None, int | None], deployment: str | None,
    deployment_limits: tuple[int | None, int | None],
) -> list[Budget]:
    """The budgets of a request: the key's and the deployment's (requests, tokens) per minute."""
    out = []
    for kind, name, limits in (("key", key_name, key_limits), ("deployment", deployment, deployment_limits)):
        if name is None:
            continue
        subject = f"the API key {name!r}" if kind == "key" else f"deployment {name!r}"
        for unit, per_minute in zip(("requests", "tokens"), limits, strict=True):
            if per_minute is not None:
                out.append(Budget(f"{kind}:{name}:{unit}", subject, per_minute, unit))
    return out


async def admit(limiter: Any, budgets: list[Budget]) -> dict[str, str]:
    """Take one request from each request budget and check that each token budget is above
    zero, in one call, all or nothing; the tightest budget's headers per unit. ``RateLimited``
    naming the first that refuses."""
    asks = [(b.bucket, b.per_minute, 1.0 if b.unit == "requests" else 0.0, 1.0, b.unit) for b in budgets]
    verdicts = await limiter.take_all.remote(asks)
    tightest: dict[str, Verdict] = {}
    for b, verdict in zip(budgets, verdicts, strict=True):
        if not verdict.allowed:
            raise RateLimited(b.subject, verdict)
        if b.unit not in tightest or verdict.remaining < tightest[b.unit].remaining:
            tightest[b.unit] = verdict
    return {k: v for verdict in tightest.values() for k, v in verdict.headers().items()}


def charge(limiter: Any, budgets: list[Budget], tokens: int | None) -> None:
    """Charge a finished request's tokens to its token budgets (not waited for)."""
    for b in budgets:
        if b.unit == "tokens" and tokens:
            limiter.take.remote(b.bucket, b.per_minute, float(tokens), 0.0, b.unit)


def limiter_handle():  # noqa: ANN201 - a Ray actor handle
    """The shared limiter actor, created on first use (by whichever ingress replica comes first)."""
    import ray

    from atomr_infer.cluster import NAMESPACE

    return (
        ray.remote(RateLimiter)
        # Restarted if its process dies (its buckets start full again), rather than refusing every
        # limited request from then on.
        .options(name=LIMITER_NAME, namespace=NAMESPACE, get_if_exists=True, num_cpus=0, lifetime="detached",
                 max_restarts=-1, max_task_retries=1)
        .remote()
    )


class IngressLimits:
    """An ingress replica's side of the limits: admitting a request under its key's and its
    deployment's budgets, and charging its tokens when it ends."""

    def __init__(self) -> None:
        self._limiter: Any = None  # the shared actor, looked up on the first limited request

    async def admit(
        self, key: str | None, key_limits: tuple[int | None, int | None], deployment: str | None,
        deployment_limits: tuple[int | None, int | None],
    ) -> tuple[dict[str, str], list[Budget]]:
        """The rate-limit headers and the token budgets to charge; ``RateLimited`` (429)."""
        budgets = budgets_of(key, key_limits, deployment, deployment_limits)
        if not budgets:
            return {}, []
        if self._limiter is None:
            self._limiter = limiter_handle()
        try:
            headers = await admit(self._limiter, budgets)
        except RateLimited:
            raise
        except Exception as exc:  # noqa: BLE001 - a Ray error: the actor is gone (killed, its node lost)
            # Looked up again (get_if_exists makes a new one), once: the handle held a dead actor for good.
            log.warning("rate_limiter_lost", error=f"{type(exc).__name__}: {exc}"[:300])
            if isinstance(exc, AttributeError):  # one an older atomr made (no take_all): replaced
                import ray

                ray.kill(self._limiter)
            self._limiter = limiter_handle()
            headers = await admit(self._limiter, budgets)
        return headers, [b for b in budgets if b.unit == "tokens"]

    def charge(self, budgets: list[Budget], tokens: int | None) -> None:
        if budgets and self._limiter is not None:
            charge(self._limiter, budgets, tokens)

