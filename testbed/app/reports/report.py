"""`testbed-report <sweep dir>`: one self-contained HTML page comparing the series of a sweep.

For people who do not want W&B, and for a paper: latency percentiles, goodput and SLO attainment against
the offered request rate (a panel per trace, and per family of policies beyond eight series, with the
SLO's thresholds drawn), latency CDFs at one load, an interactive latency-vs-load figure with a series
selector, and a table that fits the page. The header names what produced the numbers (model, GPU, cost
model, trace, SLO, commit: app/reports/report_sweep.py) and the overrides every job shared, so that the labels
name only what was swept. PNGs are written beside the page and embedded in it, so the page can be mailed
or opened from anywhere.

A folder holding only a `sweep_summary.csv` (a sweep's table committed without its job folders, as under
experiments/) makes a report too, without the figures that need per-request results.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from testbed.app.reports.report_page import render_page  # noqa: E402
from testbed.app.reports.report_style import CONTEXT, Style, log_axis, panels, styles  # noqa: E402
from testbed.app.reports.report_sweep import BadSweep, SweepFacts, label_keys, parse_overrides, sweep_facts  # noqa: E402
from testbed.app.entry.stop import stop_on_signals  # noqa: E402
from testbed.app.reports.sweep import write_sweep_table  # noqa: E402

VS_RATE = [("p50_ttft_ms", "p50 TTFT (ms)"), ("p99_ttft_ms", "p99 TTFT (ms)"), ("p50_tpot_ms", "p50 TPOT (ms)"),
           ("p99_tpot_ms", "p99 TPOT (ms)"), ("request_goodput", "goodput (req/s)"),
           ("slo_attainment", "SLO attainment")]
# drawn only where a sweep has them: several replicas (the busiest one's share), prefix reuse
WHERE_PRESENT = [("prefix_cache_hit_rate", "prefix cache hit rate"), ("routed_max_share", "busiest replica's share")]
INTERACTIVE = "p99_ttft_ms"  # the one figure also drawn as SVG with a series selector
SLO_KEY = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}
SLO_COLOR = "#444444"
DPI = 100


def series_components(df: pd.DataFrame, keys: list[str]) -> list[tuple[tuple[str, str], ...]]:
    """Each job's series as (key, value) pairs of the swept keys only; the policy (by its config name, so that
    sglang_lpm is not sglang) where nothing but load and trace was swept."""
    names = df["policy_config"].fillna(df["policy"]) if "policy_config" in df else df["policy"]
    overrides = df["overrides"].fillna("") if "overrides" in df else pd.Series([""] * len(df), index=df.index)
    out = []
    for name, ov in zip(names, overrides):
        given = parse_overrides(ov)
        comps = tuple((k, str(name) if k == "policy" else given.get(k, "?")) for k in keys)
        out.append(comps or (("policy", str(name)),))
    return out


def series_label(comps: tuple[tuple[str, str], ...]) -> str:
    """One swept key: its value alone (the legend's title names the key); several: `value, key=value`."""
    if len(comps) == 1:
        return comps[0][1]
    return ", ".join(v if k in ("policy", "router") else f"{k.rsplit('.', 1)[-1]}={v}" for k, v in comps)


def _slo_line(ax, metric: str, slo: dict, axis: str = "y") -> None:
    """The SLO's threshold for this metric, dashed, with what it is written on it."""
    if metric == "slo_attainment":
        value, text = slo.get("attainment_target"), "target {:.0%}"
    else:
        key = next((v for k, v in SLO_KEY.items() if k in metric), None)
        value, text = slo.get(key) if key else None, f"SLO p{slo.get('percentile', 99):g} ≤ {{:g}} ms"
    if value is None:
        return
    line = (ax.axhline if axis == "y" else ax.axvline)(value, color=SLO_COLOR, linestyle=(0, (4, 3)), linewidth=1.1,
                                                       zorder=1)
    line.set_gid("slo")
    kw = dict(xy=(0.01, value), xycoords=("axes fraction", "data")) if axis == "y" else dict(
        xy=(value, 0.02), xycoords=("data", "axes fraction"), rotation=90)
    ax.annotate(text.format(value), fontsize=7, color=SLO_COLOR, va="bottom", ha="left", **kw)


def _series_lines(ax, sub: pd.DataFrame, x: str, y: str, style: dict[str, Style], own: list[str],
                  gid: str = "") -> list:
    """Every series of `sub`, those of other panels in grey behind this panel's own; the handles of its own."""
    handles = []
    for label in [s for s in style if s not in own] + own:
        g = sub[sub["series"] == label].sort_values(x)
        if g.empty:
            continue
        if label in own:
            (line,) = ax.plot(g[x], g[y], label=label, markersize=4.5, linewidth=1.6, zorder=3, **style[label].kw())
            if gid:  # the selector's handle: series-<n>-<panel>
                line.set_gid(f"series-{list(style).index(label)}-{gid}")
            handles.append(line)
        else:
            ax.plot(g[x], g[y], color=CONTEXT, linewidth=1.0, zorder=2)
    return handles


def _legend(fig, axes, handles_by_col, title: str | None) -> None:
    if len(handles_by_col) == 1:  # one legend right of the figure: never over the data
        fig.legend(handles=handles_by_col[0], loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
                   title=title, title_fontsize=8, frameon=False)
        return
    for ax, handles in zip(axes[-1], handles_by_col):  # small multiples: each family's key under its column
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.28), fontsize=8, ncol=2,
                  title=title, title_fontsize=8, frameon=False)


def vs_rate_figure(df: pd.DataFrame, metric: str, ylabel: str, style: dict[str, Style], slo: dict,
                   title: str | None = None):
    """`metric` against the offered rate: a panel per trace, and per family beyond eight series."""
    traces = sorted(df["trace"].unique())
    pans = panels(style)
    rows, cols = (1, len(traces)) if len(pans) == 1 else (len(traces), len(pans))
    fig, axes = plt.subplots(rows, cols, figsize=(max(4.6 * cols, 5.0), 3.3 * rows + (0.9 if len(pans) > 1 else 0)),
                             squeeze=False)
    handles_by_col = []
    for i, trace in enumerate(traces):
        sub = df[df["trace"] == trace]
        for j, (family, own) in enumerate(pans):
            ax = axes[0][i] if len(pans) == 1 else axes[i][j]
            handles = _series_lines(ax, sub, "offered_request_rate", metric, style, own)
            if i == (0 if len(pans) == 1 else len(traces) - 1):
                handles_by_col.append(handles)
            if slo:
                _slo_line(ax, metric, slo)
            ax.set_title(f"{trace}: {family}" if family else trace, fontsize=10)
            ax.set_xlabel("offered load (requests/s)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3, which="major")
            log_axis(ax, "x")
            if metric.endswith("_ms"):
                log_axis(ax, "y")
    _legend(fig, axes, handles_by_col if len(pans) > 1 else handles_by_col[:1], title)
    fig.tight_layout()
    return fig


def cdf_figure(sweep: Path, df: pd.DataFrame, style: dict[str, Style], slo: dict, title: str | None):
    """Latency CDFs of each series at one load: a row per trace (and family beyond eight series)."""
    cols = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2el_ms", "E2E latency (ms)"))
    data = {}
    for _, row in df.iterrows():
        req = sweep / row["job"] / "requests.parquet"
        if req.exists():
            data[row["job"]] = pd.read_parquet(req, columns=[c for c, _ in cols])
    if not data:
        return None
    pans = panels(style)
    rows = [(t, fam, own) for t in sorted(df["trace"].unique()) for fam, own in pans]
    fig, axes = plt.subplots(len(rows), 3, figsize=(14, 3.3 * len(rows)), squeeze=False)
    for r, (trace, family, own) in enumerate(rows):
        sub = df[(df["trace"] == trace) & df["job"].isin(list(data))]
        handles = []
        for k, (col, xlabel) in enumerate(cols):
            ax = axes[r][k]
            for label in [s for s in style if s not in own] + own:
                for job in sub.loc[sub["series"] == label, "job"]:
                    v = np.sort(data[job][col].dropna().to_numpy())
                    if not v.size:
                        continue
                    y = np.arange(1, v.size + 1) / v.size
                    if label in own:
                        (line,) = ax.plot(v, y, label=label, linewidth=1.6, zorder=3, color=style[label].color,
                                          linestyle=style[label].linestyle)
                        handles += [line] if k == 0 else []
                    else:
                        ax.plot(v, y, color=CONTEXT, linewidth=1.0, zorder=2)
            if slo:
                _slo_line(ax, col, slo, axis="x")
                if any(slo.get(key) is not None for key in SLO_KEY.values()):
                    ax.axhline(slo.get("percentile", 99) / 100, color=SLO_COLOR, linewidth=0.8, linestyle=":")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"{trace}: {family}" if family else trace, fontsize=10)
            ax.grid(alpha=0.3)
            log_axis(ax, "x")
        axes[r][-1].legend(handles=handles, loc="center left", bbox_to_anchor=(1.02, 0.5), fontsize=8, title=title,
                           title_fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def capacity_figure(sweep: Path, df: pd.DataFrame, style: dict[str, Style], title: str | None):
    """The attainment curve each capacity search walked (where its capacity.json is here), and the maximum
    load it found."""
    curves = {row["series"]: sweep / row["job"] / "capacity.json" for _, row in df.iterrows()
              if (sweep / row["job"] / "capacity.json").is_file()}
    fig, axes = plt.subplots(1, 2 if curves else 1, figsize=(13 if curves else 7, 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]} if curves else None)
    target = df["attainment_target"].dropna().iloc[0] if "attainment_target" in df and df[
        "attainment_target"].notna().any() else None
    if curves:
        left = axes[0][0]
        for label in style:
            if label not in curves:
                continue
            res = json.loads(curves[label].read_text())
            curve = sorted((p["rate_scale"], p["slo_attainment"]) for p in res["curve"])
            left.plot([x for x, _ in curve], [a for _, a in curve], label=label, markersize=4, **style[label].kw())
        if target is not None:
            left.axhline(target, color=SLO_COLOR, linestyle=(0, (4, 3)), linewidth=1.1, gid="slo")
        left.set_xlabel("load (x the trace's own rate)")
        left.set_ylabel("SLO attainment")
        left.grid(alpha=0.3)
        log_axis(left, "x")
        left.legend(fontsize=7, ncol=2, title=title, title_fontsize=7)
    right = axes[0][-1]
    best = df.dropna(subset=["max_rate_scale"]).sort_values("max_rate_scale")
    right.barh(best["series"], best["max_rate_scale"], color=[style[s].color for s in best["series"]],
               edgecolor="white")
    for y, v in enumerate(best["max_rate_scale"]):
        right.annotate(f"{v:.2f}", xy=(v, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
    right.set_xlabel(f"max load (x trace) meeting the SLO for {target:.0%} of requests" if target else "max load")
    right.grid(alpha=0.3, axis="x")
    right.margins(x=0.12)
    fig.tight_layout()
    return fig


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return path


def _svg(fig) -> str:
    buf = io.StringIO()
    with plt.rc_context({"svg.hashsalt": "testbed-report", "svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def interactive_figure(df: pd.DataFrame, metric: str, ylabel: str, style: dict[str, Style], slo: dict) -> str:
    """`metric` against load, every series in one panel per trace, as inline SVG whose lines the page's
    selector shows and hides (ids `series-<n>-...`): no extra dependency, and the page stays one file."""
    traces = sorted(df["trace"].unique())
    fig, axes = plt.subplots(1, len(traces), figsize=(max(5.2 * len(traces), 6), 3.8), squeeze=False)
    for i, (ax, trace) in enumerate(zip(axes[0], traces)):
        _series_lines(ax, df[df["trace"] == trace], "offered_request_rate", metric, style, list(style),
                      gid=f"t{i}")
        if slo:
            _slo_line(ax, metric, slo)
        ax.set_title(trace, fontsize=10)
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        log_axis(ax, "x")
        log_axis(ax, "y")
    fig.tight_layout()
    return _svg(fig)


def _load(sweep: Path) -> tuple[pd.DataFrame, bool]:
    """The merged table, and whether the jobs' own folders are here (else the committed table alone)."""
    if not sweep.is_dir():
        raise BadSweep(f"{sweep}: no such folder (give a multirun folder, or one holding a sweep_summary.csv)")
    has_jobs = any(sweep.rglob("summary.json")) or any(sweep.rglob("capacity.json"))
    if has_jobs:
        return write_sweep_table(sweep), True
    if (sweep / "sweep_summary.csv").is_file():
        return pd.read_csv(sweep / "sweep_summary.csv"), False
    raise BadSweep(f"no job under {sweep} has a summary.json, nor is there a sweep_summary.csv: is this a multirun "
                   "folder?")


def build_report(sweep_dir: str | Path, rate_scale: float | None = None, out: str | Path | None = None) -> Path:
    """The page (a few seconds): under a stop block, so that a signal lets it finish its files (none is
    left half-written) and then ends the command with 128 + the signal (app/entry/stop.py)."""
    with stop_on_signals():
        return _build_report(sweep_dir, rate_scale, out)


def _build_report(sweep_dir: str | Path, rate_scale: float | None, out: str | Path | None) -> Path:
    sweep = Path(sweep_dir)
    df, has_jobs = _load(sweep)
    not_ok = df[df["status"] != "ok"] if "status" in df else df.iloc[0:0]
    if "status" in df:  # failed, interrupted and stalled jobs are listed, not plotted
        df = df[df["status"] == "ok"]
    if df.empty:
        raise BadSweep(f"no job under {sweep} has a summary.json: is this a multirun folder?")
    df = df.copy()
    facts: SweepFacts = sweep_facts(sweep, df)
    keys = label_keys(facts.swept)
    comps = series_components(df, keys)
    df["series"] = [series_label(c) for c in comps]
    style = styles(dict(zip(df["series"], comps)))
    style = {k: style[k] for k in sorted(style, key=lambda s: style[s].order)}
    title = keys[0] if len(keys) == 1 else None
    out = Path(out) if out else sweep / "report.html"
    figs = out.parent / "report_figures"
    figs.mkdir(parents=True, exist_ok=True)
    images, interactive = [], None
    capacity = "max_rate_scale" in df and (df["max_rate_scale"].notna().any() or "p99_ttft_ms" not in df)
    if capacity:
        images.append(("maximum load under the SLO", _save(capacity_figure(sweep, df, style, title),
                                                           figs / "capacity.png")))
        rate_scale = -1.0  # no per-load CDFs for a capacity sweep
    else:
        plots = [(m, label) for m, label in VS_RATE if m in df] + [
            (m, label) for m, label in WHERE_PRESENT if m in df and df[m].fillna(0).any()]
        for m, label in plots:
            images.append((f"{label} against load", _save(vs_rate_figure(df, m, label, style, facts.slo, title),
                                                          figs / f"{m}_vs_rate.png")))
        if INTERACTIVE in df:
            interactive = interactive_figure(df, INTERACTIVE, "p99 TTFT (ms)", style, facts.slo)
    if rate_scale is None and "rate_scale" in df:
        scales = sorted(df["rate_scale"].dropna().unique())
        rate_scale = float(scales[len(scales) // 2]) if scales else None
    notes = []
    if rate_scale is not None and rate_scale >= 0:
        at = df[np.isclose(df["rate_scale"].astype(float), rate_scale)] if "rate_scale" in df else df.iloc[0:0]
        fig = cdf_figure(sweep, at, style, facts.slo, title) if not at.empty else None
        if fig is not None:
            images.append((f"latency CDFs at {rate_scale:g}x the trace's load", _save(fig, figs / "cdfs.png")))
    if not has_jobs:
        notes.append("Built from the committed sweep_summary.csv alone: the per-request latency CDFs (and a "
                     "capacity search's attainment curves) need the jobs' folders, which are not committed.")
    page = render_page(sweep.name, df, not_ok, facts, style, title,
                       [(label, base64.b64encode(p.read_bytes()).decode(), p.name,
                         int.from_bytes(p.read_bytes()[16:20], "big")) for label, p in images],  # its width (IHDR)
                       interactive, notes)
    out.write_text(page)
    return out


def main() -> int | None:
    ap = argparse.ArgumentParser(description="Write an HTML report for a multirun folder.")
    ap.add_argument("sweep_dir")
    ap.add_argument("--rate-scale", type=float, default=None, help="the load whose CDFs to plot (default: the median)")
    ap.add_argument("--out", default=None, help="the HTML file (default: <sweep_dir>/report.html)")
    args = ap.parse_args()
    try:
        print(build_report(args.sweep_dir, args.rate_scale, args.out))
    except BadSweep as e:
        print(f"testbed-report: {e}", file=sys.stderr)
        return 2
    return None


if __name__ == "__main__":
    sys.exit(main())
