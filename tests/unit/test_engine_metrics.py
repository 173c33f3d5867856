"""vLLM's engine metrics through Ray, and the gauges the replica reads of them (engine/vllm/engine_metrics.py),
over vLLM's own StatLoggerManager and a real config of the bundled model."""

from __future__ import annotations

import pytest

from atomr_infer.engine.vllm.engine_metrics import SchedulerGauges, stat_loggers
from atomr_infer.spec import Deployment
from tests.conftest import smollm2_spec


@pytest.fixture(scope="module")
def vllm_config(bundled_model_dir):
    from vllm import EngineArgs

    return EngineArgs(model=str(bundled_model_dir), max_model_len=512, enforce_eager=True).create_engine_config()


@pytest.fixture
def replica_id_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.metrics import ray_wrappers

    monkeypatch.setattr(ray_wrappers, "_get_replica_id", ray_wrappers._get_replica_id)  # put back afterwards


def engine_metrics(on: bool) -> Deployment:
    spec = smollm2_spec()
    return spec.model_copy(update={"runtime_config": spec.runtime_config.model_copy(update={"engine_metrics": on})})


def test_the_gauges_read_what_vllms_own_prometheus_gauges_report(vllm_config) -> None:
    from vllm.v1.metrics.loggers import StatLoggerManager
    from vllm.v1.metrics.reader import get_metrics_snapshot
    from vllm.v1.metrics.stats import SchedulerStats

    gauges = SchedulerGauges()
    assert gauges.read() == (None, None)  # no engine (an emulated one): the replica counts requests with no token
    manager = StatLoggerManager(vllm_config, custom_stat_loggers=[gauges.factory()], enable_default_loggers=False)
    assert gauges.read() == (0.0, 0)  # an engine just built, before its first step: empty, as vLLM's gauges say
    manager.record(SchedulerStats(num_running_reqs=4, num_waiting_reqs=2, num_skipped_waiting_reqs=1,
                                  kv_cache_usage=0.25), None)
    vllm_says = {m.name: m.value for m in get_metrics_snapshot() if m.name.startswith("vllm:num_requests_waiting")
                 or m.name == "vllm:kv_cache_usage_perc"}
    assert gauges.read() == (0.25, 3)
    assert (vllm_says["vllm:kv_cache_usage_perc"], vllm_says["vllm:num_requests_waiting"]) == (0.25, 3)


def test_engine_metrics_go_through_ray_tagged_with_the_replica(vllm_config, replica_id_restored) -> None:
    from vllm.v1.metrics.loggers import StatLoggerManager
    from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger
    from vllm.v1.metrics.stats import SchedulerStats

    gauges = SchedulerGauges()
    factories = stat_loggers(engine_metrics(True), "smollm2-r3", gauges)
    assert RayPrometheusStatLogger in factories
    manager = StatLoggerManager(vllm_config, custom_stat_loggers=factories, enable_default_loggers=False)
    ray_logger = next(lg for lg in manager.stat_loggers if isinstance(lg, RayPrometheusStatLogger))
    assert ray_logger.gauge_scheduler_running[0]._tags["ReplicaId"] == "smollm2-r3"
    # It replaced vLLM's Prometheus logger, which the replica read its gauges from: they still read.
    manager.record(SchedulerStats(num_waiting_reqs=5, kv_cache_usage=0.5), None)
    assert gauges.read() == (0.5, 5)


def test_engine_metrics_off_leaves_vllms_prometheus_logger(replica_id_restored) -> None:
    factories = stat_loggers(engine_metrics(False), "smollm2-r0", SchedulerGauges())
    assert [f.__name__ for f in factories] == ["_Logger"]
