"""What exporting vLLM's engine metrics through Ray costs a replica per engine step
(``runtime_config.engine_metrics``, engine/vllm/engine_metrics.py).

vLLM's ``StatLoggerManager.record`` runs once per engine step in the replica's step-loop thread:
gauges and counters per step, a time-to-first-token or inter-token-latency observation per running
request, and a dozen histograms per finished request. This times that call, with the loggers a
replica has:
- ``prometheus``: vLLM's Prometheus logger (what ``vllm serve`` pays, and a replica with
  ``engine_metrics: false``), plus atomr's gauges;
- ``ray``: vLLM's ``RayPrometheusStatLogger`` in its place (``engine_metrics: true``), plus the gauges;
at 1 to 256 running requests, one of them finishing each step, alternately, in a Ray driver (Ray
metrics record nothing outside Ray). It prints µs per step and the ratio ray/prometheus.

    .venv/bin/python scripts/bench_engine_metrics.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def stats_of_one_step(running: int) -> tuple[object, object]:
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

    iteration = IterationStats()
    iteration.num_generation_tokens = running
    iteration.inter_token_latencies_iter = [0.012] * running
    iteration.max_num_generation_tokens_iter = [1]
    iteration.n_params_iter = [1]
    iteration.finished_requests = [FinishedRequestStats(FinishReason.LENGTH, "r", 1.5, 30, 0, 64, 64, 0.01, 0.02,
                                                        1.4, 1.38, 0.02)]
    scheduler = SchedulerStats(num_running_reqs=running, num_waiting_reqs=2, kv_cache_usage=0.4)
    return scheduler, iteration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", default="1,16,64,256", help="running requests per step, comma-separated")
    parser.add_argument("--steps", type=int, default=2000, help="steps timed per arm and size, per round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import ray
    from vllm import EngineArgs
    from vllm.v1.metrics.loggers import StatLoggerManager

    from atomr_infer.engine.vllm.engine_metrics import SchedulerGauges, stat_loggers
    from atomr_infer.models import prepare_bundled
    from atomr_infer.spec import parse_deployment

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    config = EngineArgs(model=str(prepare_bundled("smollm2-135m-instruct")), max_model_len=512,
                        enforce_eager=True).create_engine_config()
    managers = {}
    for arm, on in (("prometheus", False), ("ray", True)):
        spec = parse_deployment({"name": "bench", "model": "bundled:smollm2-135m-instruct",
                                 "runtime_config": {"engine_metrics": on}})
        managers[arm] = StatLoggerManager(config, custom_stat_loggers=stat_loggers(spec, "bench-r0", SchedulerGauges()),
                                          enable_default_loggers=False)
    for running in [int(n) for n in args.running.split(",")]:
        scheduler, iteration = stats_of_one_step(running)
        per_step: dict[str, list[float]] = {arm: [] for arm in managers}
        for _ in range(args.rounds):
            for arm, manager in managers.items():
                started = time.perf_counter()
                for _ in range(args.steps):
                    manager.record(scheduler_stats=scheduler, iteration_stats=iteration)
                per_step[arm].append((time.perf_counter() - started) / args.steps * 1e6)
        prom, ray_us = statistics.median(per_step["prometheus"]), statistics.median(per_step["ray"])
        print(f"{running:>4} running: prometheus {prom:7.1f} µs/step, ray {ray_us:7.1f} µs/step, "
              f"ray/prometheus {ray_us / prom:.2f}, +{ray_us - prom:.1f} µs")
    ray.shutdown()


if __name__ == "__main__":
    main()
