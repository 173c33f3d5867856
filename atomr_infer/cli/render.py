"""Rendering for the cluster commands: kubectl-style columns, ages, plans, replica rows.

Tables are plain aligned columns (two spaces apart, never wrapped or truncated), so they read
the same in a terminal, a pipe and ``grep``. A cell may carry a rich style, e.g. a link to the
replica's page on the Ray dashboard (terminals that support OSC 8 make it clickable).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rich.style import Style
from rich.text import Text

from atomr_infer.status import DeploymentStatus

Cell = str | tuple[str, str | Style]


def age(seconds: float | None) -> str:
    """kubectl's way: 45s, 3m12s, 12m, 5h3m, 2d4h."""
    if seconds is None or seconds < 0:
        return "-"
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    m, s = divmod(s, 60)
    if m < 10:
        return f"{m}m{s}s" if s else f"{m}m"
    h, m = divmod(m, 60)
    if h == 0:
        return f"{m}m"
    d, h = divmod(h, 24)
    if d == 0:
        return f"{h}h{m}m" if m else f"{h}h"
    return f"{d}d{h}h" if h else f"{d}d"


def columns(headers: Sequence[str], rows: Sequence[Sequence[Cell]]) -> list[Text]:
    """Aligned lines: a header and one line per row."""
    def plain(cell: Cell) -> str:
        return cell if isinstance(cell, str) else cell[0]

    widths = [max([len(h)] + [len(plain(r[i])) for r in rows]) for i, h in enumerate(headers)]
    lines = [Text("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(), style="bold")]
    for row in rows:
        line = Text()
        for i, (cell, width) in enumerate(zip(row, widths, strict=True)):
            text = plain(cell)
            last = i == len(row) - 1
            pad = "" if last else " " * (width - len(text) + 2)
            line.append(text, style=None if isinstance(cell, str) else cell[1])
            line.append(pad)
        lines.append(line)
    return lines


def deployments_lines(statuses: Sequence[DeploymentStatus], now: float | None = None) -> list[Text]:
    rows: list[list[Cell]] = []
    for s in statuses:
        state = s.state
        style = {"ready": "green", "failing": "red", "failed": "red", "removing": "yellow"}.get(state, "yellow")
        rows.append(
            [
                s.name,
                s.model or "-",
                f"{s.generation}/{s.observed_generation}",
                f"{s.replicas_ready}/{s.replicas_desired}",
                (str(state), style),
            ]
        )
    return columns(["NAME", "MODEL", "GENERATION", "READY", "STATUS"], rows)


def replica_rows(
    statuses: Sequence[DeploymentStatus],
    stats: dict[str, Any],
    nodes: dict[str, str],
    dashboard: str | None,
    now: float | None = None,
    waiting: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """One flat dict per replica: what ``atomr status`` shows and ``--json`` prints.
    ``waiting``: why a starting replica has no phase yet (``common.waiting_reasons``)."""
    now = time.time() if now is None else now
    rows = []
    for s in statuses:
        for r in s.replicas:
            st = stats.get(r.actor_name)
            tpot = st.time_per_output_token_s.p50 if st is not None else None
            rows.append(
                {
                    "deployment": s.name,
                    "replica": r.replica_id,
                    "actor_name": r.actor_name,
                    "state": str(r.state),
                    "reason": r.reason,
                    "phase": st.phase if st is not None else (waiting or {}).get(r.actor_name),
                    "generation": r.generation,
                    "model": r.model,  # mid-roll, the old spec's or the new
                    "node_id": r.node_id,
                    "node": nodes.get(r.node_id or ""),
                    "device": r.device,
                    "dtype": r.dtype,
                    "kv_cache_bytes": r.kv_cache_bytes,
                    "kv_cache_tokens": r.kv_cache_tokens,
                    "gpu_ids": list(r.gpu_ids),
                    "in_flight": st.in_flight if st is not None else r.in_flight,
                    "engine_unfinished": st.engine_unfinished if st is not None else None,
                    "tokens_generated": st.tokens_generated if st is not None else None,
                    "tokens_per_s": round(1.0 / tpot, 1) if tpot else None,
                    "ttft_p50_s": st.ttft_s.p50 if st is not None else None,
                    "requests_finished": st.requests_finished if st is not None else None,
                    "requests_aborted": st.requests_aborted if st is not None else None,
                    "uptime_s": round(now - r.started_at, 1) if r.started_at else None,
                    "actor_id": r.actor_id,
                    "dashboard_url": actor_url(dashboard, r.actor_id),
                    "adapters": dict(r.adapters),
                }
            )
    return rows


def actor_url(dashboard: str | None, actor_id: str | None) -> str | None:
    """The actor's page on the Ray dashboard."""
    return f"{dashboard}/#/actors/{actor_id}" if dashboard and actor_id else None


_STATE_STYLE = {"ready": "green", "starting": "yellow", "draining": "yellow", "unhealthy": "red", "stopped": "dim"}


def replicas_lines(rows: Sequence[dict[str, Any]]) -> list[Text]:
    cells: list[list[Cell]] = []
    for r in rows:
        name = f"{r['deployment']}/{r['replica']}"
        state = r["state"]
        if state == "starting" and r.get("phase") and r["phase"] != "starting":
            state = f"starting ({r['phase']})"
        elif r.get("reason") and state in ("unhealthy", "stopped"):
            state = f"{state} ({shorten(r['reason'], 40)})"
        cells.append(
            [
                (name, Style(link=r["dashboard_url"])) if r.get("dashboard_url") else name,
                (state, _STATE_STYLE.get(r["state"], "")),
                r.get("node") or (r["node_id"][:8] if r.get("node_id") else "-"),
                "/".join(filter(None, (r.get("device"), r.get("dtype")))) or "-",
                kv_cache(r),
                ",".join(r["gpu_ids"]) or "-",
                str(r["in_flight"]),
                "-" if r["tokens_generated"] is None else str(r["tokens_generated"]),
                "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f}",
                age(r["uptime_s"]),
            ]
        )
    headers = ["REPLICA", "STATE", "NODE", "DEVICE", "KV CACHE", "GPU IDS", "IN-FLIGHT", "TOKENS", "TOK/S", "UPTIME"]
    return columns(headers, cells)


def adapter_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Each replica's LoRA adapters and their states: ``smollm2/r0 adapters: pirate loaded, …``."""
    return [
        f"{r['deployment']}/{r['replica']} adapters: " + ", ".join(f"{a} {s}" for a, s in sorted(r["adapters"].items()))
        for r in rows if r.get("adapters")
    ]


def scaling_line(status: DeploymentStatus) -> str:
    """Autoscaling: bounds, target and load, the last decision and what the budget stopped."""
    a = status.autoscaling or {}
    line = (f"{status.name}: autoscaling {a['min_replicas']}-{a['max_replicas']}: target {a['target_replicas']} "
            f"replica(s), load {a['load']:g} ({a['target_ongoing_requests']:g} per replica)")
    if a.get("waiting"):
        line += f", {a['waiting']} waiting"
    last = a.get("last_decision")
    if last:
        when = time.strftime("%H:%M:%S", time.localtime(last["at"]))
        line += f"\n  last: {last['from_replicas']} → {last['to_replicas']} at {when}: {last['reason']}"
    if a.get("limited_by_budget"):
        line += f"\n  held by the budget: {a['limited_by_budget']}"
    return line


def failure_line(status: DeploymentStatus) -> str:
    """Why the last replica failed, and whether the manager is still trying."""
    line = f"{status.name}: last failure: {status.last_failure}"
    if status.removing:  # e.g. a stored spec a restarted manager refused
        return line + "\n  its replicas are being stopped; `atomr deploy` a corrected spec to deploy it again"
    if status.failed:
        return line + (
            f"\n  will recur: stopped after {status.start_failures} tries; fix the spec and "
            f"`atomr deploy` it again (the same spec retries)"
        )
    retry = f", next try in {status.next_start_in_s:.0f}s" if status.next_start_in_s else ""
    kind = "transient" if status.failure_kind == "transient" else "retrying"
    return line + f"\n  {kind}: the manager keeps retrying with backoff{retry}"


def kv_cache(row: dict[str, Any]) -> str:
    """'1.00 GiB, 43.7k tokens': the engine's KV cache (its memory, when set, and capacity)."""
    size, tokens = row.get("kv_cache_bytes"), row.get("kv_cache_tokens")
    parts = [f"{size / (1 << 30):.2f} GiB" if size else "", f"{tokens / 1000:.1f}k tokens" if tokens else ""]
    return ", ".join(p for p in parts if p) or "-"


def shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")
