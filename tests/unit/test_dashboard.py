"""The Grafana dashboard shipped in the package: it loads, and every query names a metric we export."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from atomr_infer.metrics import MANAGER_METRICS, RAY_PREFIX, REPLICA_METRICS, exported_series

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}


def load_dashboard() -> dict:
    text = (resources.files("atomr_infer") / "dashboards" / "atomr-grafana.json").read_text()
    return json.loads(text)


def queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["definition"])
    return exprs


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (Grafana variables and label matchers removed)."""
    e = re.sub(r'"[^"]*"', "", expr)  # strings
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)  # label lists
    e = re.sub(r"\$\w+", "", e)  # Grafana variables outside selectors
    e = re.sub(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*\w+\s*\)", r"\1", e)
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call or word in PROMQL_WORDS or re.fullmatch(r"e\d+|inf|nan", word, re.I):
            continue
        names.add(word)
    return names


def test_metric_name_parser():
    assert metric_names(
        'histogram_quantile(0.95, sum by (le, deployment) (rate(ray_x_bucket{deployment=~"$deployment"}[5m])))'
    ) == {"ray_x_bucket"}
    assert metric_names("sum by (d) (ray_a) / clamp_min(sum by (d) (ray_b), 1e-9)") == {"ray_a", "ray_b"}
    assert metric_names("label_values(ray_c, deployment)") == {"ray_c"}


def test_dashboard_loads_with_a_prometheus_datasource_variable():
    dash = load_dashboard()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"


def test_every_query_names_an_exported_metric():
    exported = exported_series()
    used: set[str] = set()
    for expr in queries(load_dashboard()):
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{expr!r} uses {sorted(unknown)}, not exported (exported: {sorted(exported)})"
        used |= names
    # The panels: TTFT, TPOT, tokens/s, queue/in-flight, KV use, errors.
    for needed in (
        "atomr_time_to_first_token_seconds_bucket",
        "atomr_time_per_output_token_seconds_bucket",
        "atomr_generation_tokens_total",
        "atomr_requests_waiting",
        "atomr_requests_in_flight",
        "atomr_kv_cache_usage_ratio",
        "atomr_requests_failed_total",
    ):
        assert RAY_PREFIX + needed in used, needed


@pytest.mark.parametrize("name", sorted({**REPLICA_METRICS, **MANAGER_METRICS}))
def test_metric_names_follow_prometheus_conventions(name):
    kind = {**REPLICA_METRICS, **MANAGER_METRICS}[name][0]
    assert re.fullmatch(r"atomr_[a-z0-9_]+", name)
    if kind == "counter":
        assert name.endswith("_total")
    if kind == "histogram":
        assert name.endswith("_seconds")
