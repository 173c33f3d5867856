"""Prometheus metrics through ``ray.util.metrics``: replicas and the manager.

Ray's metrics agent exports every custom metric on each node's metrics port with a ``ray_``
prefix, so ``atomr_requests_started_total`` is scraped as ``ray_atomr_requests_started_total``;
Ray adds ``Component``, ``NodeAddress``, ``SessionName`` and ``WorkerId`` labels of its own.
Every replica series carries ``deployment`` and ``replica`` tags.

Recording is cheap (a few µs per call): per request a handful of counter/histogram updates
when it starts and when it ends, per engine step one histogram observation, and the gauges
are refreshed by the replica every ``GAUGE_PERIOD_S`` rather than per request. Nothing is
recorded per token. Outside a Ray worker (unit tests, ``ray.util.metrics`` missing) every
metric is a no-op.

    replica   atomr_requests_started_total            counter
              atomr_requests_finished_total           counter   finish_reason
              atomr_requests_failed_total             counter   reason: invalid | unavailable | engine | aborted
              atomr_prompt_tokens_total               counter
              atomr_generation_tokens_total           counter
              atomr_time_to_first_token_seconds       histogram
              atomr_time_per_output_token_seconds     histogram
              atomr_e2e_request_latency_seconds       histogram
              atomr_engine_step_duration_seconds      histogram
              atomr_requests_in_flight                gauge
              atomr_requests_waiting                  gauge
              atomr_kv_cache_usage_ratio              gauge
              atomr_replica_state                     gauge     state (1 for the current one, else 0)
    manager   atomr_manager_reconcile_duration_seconds histogram
              atomr_manager_applies_total             counter   deployment, result: changed | unchanged | rejected
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from atomr_infer.errors import ReplicaUnavailable, RequestError
from atomr_infer.status import ReplicaState

GAUGE_PERIOD_S = 2.0
REPLICA_STATES = tuple(ReplicaState)
FAILURE_REASONS = ("invalid", "unavailable", "engine", "aborted")
APPLY_RESULTS = ("changed", "unchanged", "rejected")

# Boundaries cover a 2-core CPU (seconds per token) and an H100 (milliseconds per token).
TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 30.0]
TPOT_BUCKETS = [0.002, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0]
STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0]
RECONCILE_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]

# name -> (kind, help, extra tag keys); the deployment/replica tags come on top for replica metrics.
REPLICA_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "atomr_requests_started_total": ("counter", "Requests admitted to the engine.", ()),
    "atomr_requests_finished_total": ("counter", "Requests that finished normally.", ("finish_reason",)),
    "atomr_requests_failed_total": ("counter", "Requests that failed or were aborted.", ("reason",)),
    "atomr_prompt_tokens_total": ("counter", "Prompt tokens of finished requests.", ()),
    "atomr_generation_tokens_total": ("counter", "Tokens generated for finished requests.", ()),
    "atomr_time_to_first_token_seconds": ("histogram", "Admission to first generated token.", ()),
    "atomr_time_per_output_token_seconds": ("histogram", "Mean decode time per token after the first.", ()),
    "atomr_e2e_request_latency_seconds": ("histogram", "Admission to the last token.", ()),
    "atomr_engine_step_duration_seconds": ("histogram", "Duration of one engine.step() call.", ()),
    "atomr_requests_in_flight": ("gauge", "Requests admitted and not yet finished.", ()),
    "atomr_requests_waiting": ("gauge", "Requests vLLM queued and has not scheduled yet.", ()),
    "atomr_kv_cache_usage_ratio": ("gauge", "Fraction of KV-cache blocks in use (0-1).", ()),
    "atomr_replica_state": ("gauge", "1 for the replica's current state, 0 for the others.", ("state",)),
}
MANAGER_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "atomr_manager_reconcile_duration_seconds": ("histogram", "Duration of one reconcile pass.", ()),
    "atomr_manager_applies_total": ("counter", "apply() calls by outcome.", ("deployment", "result")),
    "atomr_manager_scale_decisions_total": (
        "counter", "Autoscaling decisions by deployment and direction (up, down).", ("deployment", "direction"),
    ),
    "atomr_manager_target_replicas": ("gauge", "Replicas the autoscaler aims for.", ("deployment",)),
}
ROUTER_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "atomr_route_decisions_total": (
        "counter", "Routing decisions by reason: prefix_affinity (affinity_hit, overflow, no_affinity), "
        "adapter homes (adapter_home, adapter_overflow), kv_events (kv_hit, kv_overflow, kv_miss, and fallback_<a "
        "prefix_affinity reason> while no replica's events are fresh).",
        ("deployment", "reason"),
    ),
    "atomr_migrations_total": (
        "counter", "Streams moved to another replica after theirs died, by reason (dead, unreachable).",
        ("deployment", "reason"),
    ),
}
API_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "atomr_api_requests_total": (
        "counter", "HTTP API model requests by API key name ('-' without keys), deployment and status.",
        ("key", "deployment", "status"),
    ),
    "atomr_api_tokens_total": (
        "counter", "Prompt plus completion tokens of HTTP API requests that report usage.", ("key", "deployment"),
    ),
}
BUCKETS = {
    "atomr_time_to_first_token_seconds": TTFT_BUCKETS,
    "atomr_time_per_output_token_seconds": TPOT_BUCKETS,
    "atomr_e2e_request_latency_seconds": E2E_BUCKETS,
    "atomr_engine_step_duration_seconds": STEP_BUCKETS,
    "atomr_manager_reconcile_duration_seconds": RECONCILE_BUCKETS,
}
# The series names Prometheus sees when it scrapes Ray's metrics port.
RAY_PREFIX = "ray_"


def exported_series() -> set[str]:
    """Every Prometheus series name these metrics produce (histograms: _bucket, _count, _sum)."""
    names: set[str] = set()
    for name, (kind, _, _) in {**REPLICA_METRICS, **MANAGER_METRICS, **API_METRICS, **ROUTER_METRICS}.items():
        full = RAY_PREFIX + name
        names |= {full + s for s in ("_bucket", "_count", "_sum")} if kind == "histogram" else {full}
    return names


def failure_reason(exc: BaseException) -> str:
    """The ``reason`` tag for a request that ended with ``exc``."""
    if isinstance(exc, RequestError):
        return "invalid"
    if isinstance(exc, ReplicaUnavailable):
        return "unavailable"
    return "engine"


class _Metric(Protocol):
    def record(self, value: float, tags: dict[str, str] | None = None) -> None: ...


class _Noop:
    def record(self, value: float, tags: dict[str, str] | None = None) -> None:
        pass


class _RayMetric:
    """One ``ray.util.metrics`` metric with its default tags; ``record`` is inc, observe or set."""

    def __init__(self, name: str, spec: tuple[str, str, tuple[str, ...]], defaults: dict[str, str]) -> None:
        from ray.util import metrics

        kind, description, extra = spec
        keys = (*defaults, *extra)
        if kind == "counter":
            metric: Any = metrics.Counter(name, description, keys)
        elif kind == "histogram":
            metric = metrics.Histogram(name, description, BUCKETS[name], keys)
        else:
            metric = metrics.Gauge(name, description, keys)
        self._metric = metric.set_default_tags(defaults)
        self._fn = self._inc if kind == "counter" else (metric.observe if kind == "histogram" else metric.set)

    def _inc(self, value: float, tags: dict[str, str] | None = None) -> None:
        if value > 0:  # ray's Counter rejects 0
            self._metric.inc(value, tags)

    def record(self, value: float, tags: dict[str, str] | None = None) -> None:
        self._fn(value, tags)


def ray_metrics_available() -> bool:
    """True inside a Ray worker or driver with ``ray.util.metrics`` importable."""
    try:
        import ray
        import ray.util.metrics  # noqa: F401
    except Exception:  # noqa: BLE001 - a missing or broken ray means no metrics
        return False
    return ray.is_initialized()


def _build(
    specs: dict[str, tuple[str, str, tuple[str, ...]]], defaults: dict[str, str], enabled: bool | None
) -> dict[str, _Metric]:
    if enabled is None:
        enabled = ray_metrics_available()
    if enabled:
        try:
            return {name: _RayMetric(name, spec, defaults) for name, spec in specs.items()}
        except Exception:  # noqa: BLE001 - metrics must never stop a replica or the manager
            pass
    return {name: _Noop() for name in specs}


class ReplicaMetrics:
    """The metrics of one replica, tagged ``deployment`` and ``replica``."""

    def __init__(self, deployment: str, replica: str, enabled: bool | None = None) -> None:
        self._m = _build(REPLICA_METRICS, {"deployment": deployment, "replica": replica}, enabled)
        self.enabled = not isinstance(self._m["atomr_requests_started_total"], _Noop)

    def request_started(self) -> None:
        self._m["atomr_requests_started_total"].record(1)

    def request_finished(
        self,
        finish_reason: str,
        prompt_tokens: int,
        completion_tokens: int,
        submitted_at: float,
        first_token_at: float | None,
        last_token_at: float | None,
        now: float | None = None,
        decode_tokens: int | None = None,
    ) -> None:
        """One finished request; times are ``time.monotonic()`` readings. ``decode_tokens``: those
        of its longest choice where it has n > 1 (time per output token is per sequence, as
        vLLM's); ``completion_tokens`` otherwise."""
        m = self._m
        m["atomr_requests_finished_total"].record(1, {"finish_reason": finish_reason})
        m["atomr_prompt_tokens_total"].record(prompt_tokens)
        m["atomr_generation_tokens_total"].record(completion_tokens)
        end = last_token_at if last_token_at is not None else (now if now is not None else time.monotonic())
        m["atomr_e2e_request_latency_seconds"].record(max(0.0, end - submitted_at))
        if first_token_at is not None:
            m["atomr_time_to_first_token_seconds"].record(max(0.0, first_token_at - submitted_at))
            sequence = completion_tokens if decode_tokens is None else decode_tokens
            if last_token_at is not None and sequence > 1:
                tpot = (last_token_at - first_token_at) / (sequence - 1)
                m["atomr_time_per_output_token_seconds"].record(max(0.0, tpot))

    def request_failed(self, reason: str) -> None:
        self._m["atomr_requests_failed_total"].record(1, {"reason": reason})

    def engine_step(self, seconds: float) -> None:
        self._m["atomr_engine_step_duration_seconds"].record(seconds)

    def set_load(self, in_flight: int, waiting: int, kv_cache_usage: float | None) -> None:
        self._m["atomr_requests_in_flight"].record(in_flight)
        self._m["atomr_requests_waiting"].record(waiting)
        if kv_cache_usage is not None:
            self._m["atomr_kv_cache_usage_ratio"].record(kv_cache_usage)

    def set_state(self, state: str) -> None:
        """Gauge 1 for ``state`` and 0 for the other states (refreshed, so re-set every call)."""
        gauge = self._m["atomr_replica_state"]
        for s in REPLICA_STATES:
            gauge.record(1.0 if s == state else 0.0, {"state": s})


class ManagerMetrics:
    """The control plane's metrics (reconcile pass duration, applies by result)."""

    def __init__(self, enabled: bool | None = None) -> None:
        self._m = _build(MANAGER_METRICS, {}, enabled)
        self._targets: set[str] = set()  # deployments whose target it reports

    def reconcile_pass(self, seconds: float) -> None:
        self._m["atomr_manager_reconcile_duration_seconds"].record(seconds)

    def applied(self, deployment: str, result: str) -> None:
        self._m["atomr_manager_applies_total"].record(1, {"deployment": deployment, "result": result})

    def scaled(self, deployment: str, direction: str) -> None:
        self._m["atomr_manager_scale_decisions_total"].record(1, {"deployment": deployment, "direction": direction})

    def target(self, deployment: str, target: int | None) -> None:
        """The autoscaler's target, every pass (an apply moves it too); None: not autoscaled (any
        more), or removed: 0 once, not the last target for good."""
        if target is not None or deployment in self._targets:
            self._m["atomr_manager_target_replicas"].record(target or 0, {"deployment": deployment})
        if target is None:
            self._targets.discard(deployment)
        else:
            self._targets.add(deployment)


class RouterMetrics:
    """A router's metrics (in the ingress replicas and in ``Client`` processes)."""

    def __init__(self, enabled: bool | None = None) -> None:
        self._m = _build(ROUTER_METRICS, {}, enabled)

    def routed(self, deployment: str, reason: str) -> None:
        self._m["atomr_route_decisions_total"].record(1, {"deployment": deployment, "reason": reason})

    def migrated(self, deployment: str, reason: str) -> None:
        self._m["atomr_migrations_total"].record(1, {"deployment": deployment, "reason": reason})


class ApiMetrics:
    """The HTTP ingress's metrics: requests and tokens by API key name and deployment."""

    def __init__(self, enabled: bool | None = None) -> None:
        self._m = _build(API_METRICS, {}, enabled)

    def request(self, key: str, deployment: str, status: int, tokens: int | None) -> None:
        self._m["atomr_api_requests_total"].record(1, {"key": key, "deployment": deployment, "status": str(status)})
        if tokens:
            self._m["atomr_api_tokens_total"].record(tokens, {"key": key, "deployment": deployment})

