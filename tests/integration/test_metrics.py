"""atomr metrics as Prometheus scrapes them from Ray's metrics agent, and replica logs on disk.

Requests go through the shared ``smollm2`` deployment; since other tests share it, counters
are compared as deltas. The agent exports what workers report with a delay of several
seconds, so every check polls with a bounded timeout.
"""

from __future__ import annotations

import glob
import json
import os
import time
import urllib.request
from collections.abc import Callable

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from atomr_infer.client import Client
from atomr_infer.metrics import REPLICA_STATES
from tests.replica_http import http_request

pytestmark = pytest.mark.integration
EXPORT_TIMEOUT_S = 90.0
Series = dict[tuple[str, frozenset], float]


def metrics_url() -> str:
    node = next(n for n in ray.nodes() if n["Alive"])
    return f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"


def scrape() -> Series:
    """Every ``ray_atomr_*`` and ``ray_vllm_*`` sample (vLLM's own engine metrics, exported by the
    replicas: engine/vllm/engine_metrics.py): (name, labels) -> value, with Ray's own labels dropped."""
    body = urllib.request.urlopen(metrics_url(), timeout=10).read().decode()
    out: Series = {}
    ray_labels = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId", "JobId"}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if not s.name.startswith(("ray_atomr_", "ray_vllm_")):
                continue
            labels = frozenset((k, v) for k, v in s.labels.items() if k not in ray_labels and not k.startswith("otel"))
            key = (s.name, labels)
            out[key] = out.get(key, 0.0) + s.value  # summed over workers (one per replica)
    return out


def total(series: Series, name: str, **labels: str) -> float:
    """Sum of ``name`` over the series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in series.items() if n == name and want <= lab)


def has(series: Series, name: str, **labels: str) -> bool:
    want = set(labels.items())
    return any(n == name and want <= lab for (n, lab) in series)


def poll(check: Callable[[Series], bool], what: str, timeout: float = EXPORT_TIMEOUT_S) -> Series:
    deadline = time.monotonic() + timeout
    series: Series = {}
    while time.monotonic() < deadline:
        series = scrape()
        if check(series):
            return series
        time.sleep(1.0)
    names = sorted({n for n, _ in series})
    raise AssertionError(f"{what}: not seen within {timeout:.0f}s; atomr series exported: {names}")


@pytest.fixture(scope="module")
def replica_id(smollm2, manager) -> str:
    status = ray.get(manager.status.remote(smollm2))
    return next(r.replica_id for r in status.replicas if r.state == "ready")


def test_request_metrics_match_what_the_client_received(smollm2, smollm2_replica, manager, replica_id):
    tags = {"deployment": smollm2, "replica": replica_id}
    gen, ttft = "ray_atomr_generation_tokens_total", "ray_atomr_time_to_first_token_seconds_count"
    # vLLM's own count of the tokens it generated, from the same replica (aborted requests' too,
    # which atomr's counts leave out: only its growth is compared).
    vllm_gen, vllm_tags = "ray_vllm_generation_tokens_total", {"ReplicaId": f"{smollm2}-{replica_id}"}

    # Baseline only once the export has caught up with what the replica has counted so far.
    stats = ray.get(smollm2_replica.stats.remote())
    before = poll(
        lambda s: total(s, gen, **tags) == stats.tokens_generated
        and total(s, "ray_atomr_requests_started_total", **tags) == stats.requests_started,
        "the export catching up with earlier requests",
    )

    client = Client(manager=manager)
    prompts = ["What is the capital of France?", "Name a colour.", "Count from one to five."]
    completions = [
        client.chat(smollm2, [{"role": "user", "content": p}], max_tokens=m, temperature=0)
        for p, m in zip(prompts, (24, 8, 16), strict=True)
    ]
    client.close()
    generated = sum(c.usage.completion_tokens for c in completions)
    prompt_tokens = sum(c.usage.prompt_tokens for c in completions)
    n = len(completions)
    assert generated > 0

    after = poll(
        lambda s: total(s, ttft, **tags) >= total(before, ttft, **tags) + n
        and total(s, gen, **tags) >= total(before, gen, **tags) + generated
        and total(s, vllm_gen, **vllm_tags) >= total(before, vllm_gen, **vllm_tags) + generated,
        "the new requests",
    )

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **tags, **labels) - total(before, name, **tags, **labels)

    assert delta(gen) == generated
    assert total(after, vllm_gen, **vllm_tags) - total(before, vllm_gen, **vllm_tags) >= generated
    assert delta("ray_atomr_prompt_tokens_total") == prompt_tokens
    assert delta("ray_atomr_requests_started_total") == n
    assert delta("ray_atomr_requests_finished_total") == n
    reasons = {c.choices[0].finish_reason for c in completions}
    assert sum(delta("ray_atomr_requests_finished_total", finish_reason=r) for r in reasons) == n
    assert delta(ttft) == n
    assert delta("ray_atomr_e2e_request_latency_seconds_count") == n
    multi_token = sum(1 for c in completions if c.usage.completion_tokens > 1)
    assert delta("ray_atomr_time_per_output_token_seconds_count") == multi_token
    # Plausible times, read from the buckets (cumulative; Ray exports each ``_sum`` from bucket
    # midpoints, so sums are approximate): on this CPU every first token within 30 s, every
    # request within 2 min, every later token within 1 s.
    assert delta("ray_atomr_time_to_first_token_seconds_bucket", le="+Inf") == n
    assert delta("ray_atomr_time_to_first_token_seconds_bucket", le="30.0") == n
    assert delta("ray_atomr_e2e_request_latency_seconds_bucket", le="120.0") == n
    assert delta("ray_atomr_time_per_output_token_seconds_bucket", le="1.0") == multi_token
    assert delta("ray_atomr_time_to_first_token_seconds_sum") > 0
    assert delta("ray_atomr_e2e_request_latency_seconds_sum") > 0
    # At least one engine step per generated token of the longest request.
    longest = max(c.usage.completion_tokens for c in completions)
    assert delta("ray_atomr_engine_step_duration_seconds_count") >= longest


def test_gauges_report_load_kv_cache_and_state(smollm2, replica_id):
    tags = {"deployment": smollm2, "replica": replica_id}
    series = poll(
        lambda s: has(s, "ray_atomr_requests_in_flight", **tags)
        and has(s, "ray_atomr_kv_cache_usage_ratio", **tags)
        and total(s, "ray_atomr_replica_state", state="ready", **tags) == 1,
        "the replica's gauges",
    )
    assert total(series, "ray_atomr_requests_in_flight", **tags) >= 0
    assert total(series, "ray_atomr_requests_waiting", **tags) >= 0
    assert 0.0 <= total(series, "ray_atomr_kv_cache_usage_ratio", **tags) <= 1.0
    states = {s: total(series, "ray_atomr_replica_state", state=s, **tags) for s in REPLICA_STATES}
    assert states == {s: float(s == "ready") for s in REPLICA_STATES}


def test_manager_reports_reconcile_passes_and_applies(smollm2, manager, ray_cluster):
    from tests.conftest import smollm2_spec

    result = ray.get(manager.apply.remote(smollm2_spec()))  # the same spec again: unchanged
    assert not result.changed
    series = poll(
        lambda s: total(s, "ray_atomr_manager_applies_total", deployment=smollm2, result="unchanged") >= 1
        and total(s, "ray_atomr_manager_reconcile_duration_seconds_count") > 0,
        "the manager's metrics",
    )
    assert total(series, "ray_atomr_manager_applies_total", deployment=smollm2, result="changed") >= 1


def test_replica_log_has_lifecycle_lines_and_request_ids(smollm2_replica, smollm2, replica_id):
    """The actor's stderr file (what the dashboard's log viewer shows) carries JSON lines."""
    pid = ray.get(smollm2_replica.__ray_call__.remote(lambda self: os.getpid()))
    logs_dir = ray._private.worker.global_worker.node.get_logs_dir_path()
    request_id = f"metrics-log-{time.monotonic_ns()}"
    story = [{"role": "user", "content": "Tell me a long story."}]
    # Long enough, whatever the CPU's speed, that the cancel lands before the request ends.
    long = {"messages": story, "max_tokens": 1800, "ignore_eos": True, "temperature": 0, "request_id": request_id,
            "stream": True}
    gen = smollm2_replica.http.remote(http_request("/v1/chat/completions", long))
    ray.get(next(gen))  # the head, then the caller leaves: the replica logs request_aborted at INFO
    ray.cancel(gen)

    def lines() -> list[dict]:
        out = []
        for path in glob.glob(os.path.join(logs_dir, f"worker-*-{pid}.err")):
            with open(path, errors="replace") as f:
                out += [json.loads(line) for line in f if line.startswith("{") and '"event"' in line]
        return out

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = lines()
        # vLLM makes its engine request id from the body's (chatcmpl-<id>...).
        aborted = [x for x in found if x["event"] == "request_aborted" and request_id in str(x.get("request_id"))]
        if aborted:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"no request_aborted line for {request_id} in worker-*-{pid}.err: {found[-5:]}")
    assert aborted[0]["deployment"] == smollm2 and aborted[0]["replica"] == replica_id
    ready = [x for x in found if x["event"] == "replica_ready"]
    assert ready and ready[0]["level"] == "info" and ready[0]["replica"] == replica_id
