"""The report's HTML: a jinja2 template shipped with the package (templates/report.html.j2), filled with
the header, the figures and a table cut to the columns a reader compares, rounded.

The template escapes every value (autoescape), so a policy or trace name cannot break the page; only the
figures' own SVG is inserted as markup.
"""
from __future__ import annotations

import math

import pandas as pd
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup

from testbed.app.reports.report_style import Style
from testbed.app.reports.report_sweep import SweepFacts

# (column, heading, kind): what the table shows where the sweep has it; sweep_summary.csv holds the rest
TABLE = [("series", "series", "text"), ("trace", "trace", "text"), ("rate_scale", "load ×", "num"),
         ("offered_request_rate", "offered req/s", "num"), ("completed", "done", "int"),
         ("median_ttft_ms", "p50 TTFT ms", "ms"), ("p99_ttft_ms", "p99 TTFT ms", "ms"),
         ("median_tpot_ms", "p50 TPOT ms", "ms"), ("p99_tpot_ms", "p99 TPOT ms", "ms"),
         ("request_goodput", "goodput req/s", "num"), ("slo_attainment", "SLO met", "pct"),
         ("num_preemptions", "preempt.", "int"), ("prefix_cache_hit_rate", "prefix hits", "pct"),
         ("routed_max_share", "busiest replica", "pct"), ("max_rate_scale", "max load ×", "num"),
         ("max_request_rate", "max req/s", "num")]


def fmt(value, kind: str) -> str:
    """Rounded to what a comparison needs: ms to whole numbers from 10 up, rates to 3 figures, shares in %."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if kind == "text":
        return str(value)
    v = float(value)
    if kind == "int":
        return f"{v:,.0f}"
    if kind == "pct":
        return f"{100 * v:.1f}%" if v == 0 or abs(v) >= 0.001 else f"{100 * v:.2g}%"
    if kind == "ms":
        return f"{v:,.0f}" if abs(v) >= 10 else f"{v:.2f}"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def table(df: pd.DataFrame, style: dict[str, Style]) -> tuple[list[str], list[dict]]:
    """(headings, rows) of the jobs table: the columns that say something (a constant trace, an all-zero
    share are left to the header and the CSV), rows by series, trace and load."""
    cols = [(c, h, k) for c, h, k in TABLE if c in df and df[c].notna().any()]
    cols = [(c, h, k) for c, h, k in cols if not (c in ("trace", "rate_scale") and df[c].nunique() == 1)
            and not (c in ("prefix_cache_hit_rate", "routed_max_share", "num_preemptions")
                     and not df[c].fillna(0).any())]
    order = {s: i for i, s in enumerate(style)}
    df = df.assign(_o=df["series"].map(order)).sort_values(
        ["_o"] + [c for c in ("trace", "rate_scale", "offered_request_rate") if c in df], kind="stable")
    rows = [{"color": style[r["series"]].color, "cells": [(fmt(r[c], k), k) for c, _, k in cols]}
            for _, r in df.iterrows()]
    return [h for _, h, _ in cols], rows


def render_page(name: str, df: pd.DataFrame, not_ok: pd.DataFrame, facts: SweepFacts, style: dict[str, Style],
                key: str | None, images: list[tuple[str, str, str, int]], interactive: str | None,
                notes: list[str]) -> str:
    env = Environment(loader=PackageLoader("testbed.app.reports", "templates"), autoescape=select_autoescape(["j2", "html"]),
                      trim_blocks=True, lstrip_blocks=True)
    headings, rows = table(df, style)
    kind = {"policy": "policies", "router": "routers"}.get(key or "policy", f"values of {key}")
    failed = [{"job": r.get("job", "?"), "status": r.get("status", "?")} for _, r in not_ok.iterrows()]
    return env.get_template("report.html.j2").render(
        name=name, jobs=len(df), kind=kind, key=key, header=facts.header, slo=facts.slo,
        swept=[k for k in facts.swept], constants=facts.constants,
        series=[{"label": s, "color": st.color, "dash": st.linestyle != "-", "n": i}
                for i, (s, st) in enumerate(style.items())],
        traces=sorted(df["trace"].unique()), images=images,
        interactive=Markup(interactive) if interactive else None, headings=headings, rows=rows, failed=failed,
        notes=notes)
