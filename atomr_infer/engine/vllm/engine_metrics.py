"""vLLM's own engine metrics, exported through Ray, and the two gauges the replica reads of them.

vLLM records its metrics (``vllm:*``: running and waiting requests, KV-cache use, prefix-cache
hits, time to first token, inter-token latency, …) through stat loggers on every engine step.
``vllm serve`` serves them at ``/metrics`` from its process's Prometheus registry, but nothing
scrapes a Ray actor's registry. So, as Ray Serve LLM does (``log_engine_metrics``, on by
default), a replica records them with vLLM's ``RayPrometheusStatLogger``: Ray's metrics agent
exports them on each node's metrics port as ``ray_vllm_*``. Their ``ReplicaId`` tag, which that
logger fills from a Ray Serve replica's context (none here), names the replica instead.

That logger replaces vLLM's Prometheus one, which the replica read its KV-cache use and waiting
requests from. ``SchedulerGauges``, a stat logger of its own, keeps the last step's values instead:
two attribute writes per step, and no registry scan per read.
"""

from __future__ import annotations

from typing import Any

from atomr_infer.log import get_logger
from atomr_infer.spec import Deployment

log = get_logger(__name__)


class SchedulerGauges:
    """The last engine step's KV-cache use (0-1) and waiting requests, as vLLM's
    ``vllm:kv_cache_usage_perc`` and ``vllm:num_requests_waiting`` report them. ``factory`` is the
    stat-logger factory to hand vLLM; ``read`` is (None, None) until an engine is built with it."""

    def __init__(self) -> None:
        self.kv_cache_usage: float | None = None
        self.waiting: int | None = None

    def read(self) -> tuple[float | None, int | None]:
        return self.kv_cache_usage, self.waiting

    def factory(self) -> type:
        from vllm.v1.metrics.loggers import StatLoggerBase

        gauges = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                gauges.kv_cache_usage, gauges.waiting = 0.0, 0  # an engine just built holds nothing

            def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                       engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    gauges.kv_cache_usage = scheduler_stats.kv_cache_usage
                    gauges.waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs

            def log_engine_initialized(self) -> None:
                pass

        return _Logger


def stat_loggers(deployment: Deployment, replica: str, gauges: SchedulerGauges) -> list[Any]:
    """The stat-logger factories for ``LLMEngine.from_engine_args``: the replica's gauges, and
    vLLM's Ray one where the spec exports engine metrics (``runtime_config.engine_metrics``)."""
    loggers: list[Any] = [gauges.factory()]
    if deployment.runtime_config.engine_metrics:
        from vllm.v1.metrics import ray_wrappers

        if ray_wrappers.ray_metrics is None:  # its import of ray.serve failed: the engine would not start
            log.warning("engine_metrics_unavailable", deployment=deployment.name,
                        reason="vLLM's Ray metrics need ray.serve and ray.util.metrics, which do not import here")
            return loggers
        # Each metric reads its ReplicaId tag from this module function, at creation and at every
        # labels() call; a replica is one process, so naming it process-wide names it everywhere.
        ray_wrappers._get_replica_id = lambda: replica
        loggers.append(ray_wrappers.RayPrometheusStatLogger)
    return loggers
