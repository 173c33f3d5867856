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


def test_the_errors_row_shows_what_clients_saw_beside_what_replicas_failed():
    """The only error panel divided replica-side failures by replica-side starts, titled "Error
    ratio": it counted failures the router then moved to another replica and missed the 503s and
    429s no replica took. The replica-side ratio now says so, and panels show the API's answers
    by status class and the migrations."""
    dash = load_dashboard()
    by_title = {p["title"]: p for p in dash["panels"]}
    assert "Error ratio" not in by_title and "Replica-side failure ratio" in by_title
    (api,) = by_title["API responses by status class"]["targets"]
    assert metric_names(api["expr"]) == {RAY_PREFIX + "atomr_api_requests_total"}
    # label_replace's regex is anchored; its replacement names group 1 as ${1} ("$1xx" is a group named "1xx").
    (target, replacement, source, regex) = re.findall(r'"([^"]*)"', api["expr"].split("[$__rate_interval])", 1)[1])
    assert (target, source) == ("class", "status")
    assert {s: replacement.replace("${1}", re.fullmatch(regex, s)[1]) for s in ("200", "429", "503")} == {
        "200": "2xx", "429": "4xx", "503": "5xx"}
    (migrations,) = by_title["Stream migrations/s"]["targets"]
    assert metric_names(migrations["expr"]) == {RAY_PREFIX + "atomr_migrations_total"}


def test_no_two_panels_overlap():
    taken: dict[tuple[int, int], str] = {}
    for panel in load_dashboard()["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for cell in ((x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])):
            assert cell not in taken, f"{panel['title']!r} overlaps {taken[cell]!r}"
            taken[cell] = panel["title"]
