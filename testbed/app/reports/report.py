"""`testbed-report <sweep dir>`: one self-contained HTML page comparing the policies of a sweep.

For people who do not want W&B: latency percentiles, goodput and SLO attainment against
the offered request rate, one line per policy (a panel per trace), latency CDFs at one
load, and the merged table. PNGs are written beside the page and embedded in it, so the
page can be mailed or opened from anywhere.
"""
from __future__ import annotations

import argparse
import base64
import html
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from testbed.app.entry.stop import stop_on_signals  # noqa: E402
from testbed.app.reports.sweep import HEADLINE, write_sweep_table  # noqa: E402

VS_RATE = [("p50_ttft_ms", "p50 TTFT (ms)"), ("p99_ttft_ms", "p99 TTFT (ms)"), ("p50_tpot_ms", "p50 TPOT (ms)"),
           ("p99_tpot_ms", "p99 TPOT (ms)"), ("request_goodput", "goodput (req/s)"),
           ("slo_attainment", "SLO attainment")]
# drawn only where a sweep has them: several replicas (the busiest one's share), prefix reuse
WHERE_PRESENT = [("prefix_cache_hit_rate", "prefix cache hit rate"), ("routed_max_share", "busiest replica's share")]


def _series(overrides: str, policy: str) -> str:
    """The line a job belongs to: its policy, plus any swept knob other than load and trace."""
    keep = [o for o in overrides.split() if not o.startswith(("trace=", "trace.rate_scale=", "+experiment",
                                                               "policy=", "hydra.", "output."))]
    return " ".join([policy, *keep])


def _style(policies) -> dict:
    """A distinct colour and marker per policy, the same in every figure of a report."""
    cmap = plt.get_cmap("tab20")
    return {p: dict(color=cmap(i % 20), marker="osD^v<>ph*"[i % 10]) for i, p in enumerate(sorted(policies))}


def _vs_rate(df: pd.DataFrame, metric: str, label: str, path: Path) -> Path:
    traces = sorted(df["trace"].unique())
    style = _style(df["policy"].unique())
    fig, axes = plt.subplots(1, len(traces), figsize=(5 * len(traces), 3.6), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        sub = df[df["trace"] == trace]
        for policy, g in sub.groupby("policy"):
            g = g.sort_values("offered_request_rate")
            ax.plot(g["offered_request_rate"], g[metric], label=policy, **style[policy])
        ax.set_xlabel("offered load (requests/s)")
        ax.set_ylabel(label)
        ax.set_title(trace)
        if metric.endswith("_ms"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best", ncol=2 if len(style) > 8 else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _cdfs(sweep: Path, df: pd.DataFrame, rate_scale: float, path: Path) -> Path | None:
    rows = df[np.isclose(df["rate_scale"].astype(float), rate_scale)] if "rate_scale" in df else df.iloc[0:0]
    if rows.empty:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.6))
    for _, row in rows.iterrows():
        req = sweep / row["job"] / "requests.parquet"
        if not req.exists():
            continue
        table = pd.read_parquet(req, columns=["ttft_ms", "tpot_ms", "e2el_ms"])
        for ax, col in zip(axes, ("ttft_ms", "tpot_ms", "e2el_ms")):
            v = np.sort(table[col].dropna().to_numpy())
            if v.size:
                ax.plot(v, np.arange(1, v.size + 1) / v.size, label=f"{row['policy']} / {row['trace']}")
    for ax, col in zip(axes, ("TTFT (ms)", "TPOT (ms)", "E2E latency (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel(col)
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize=8)
    fig.suptitle(f"CDFs at rate scale {rate_scale:g}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _capacity(sweep: Path, df: pd.DataFrame, path: Path) -> Path:
    """The attainment curve each capacity search walked, and the maximum it found."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4), gridspec_kw={"width_ratios": [3, 2]})
    target = None
    style = _style(df["policy"].unique())
    for _, row in df.sort_values("policy").iterrows():
        res = json.loads((sweep / row["job"] / "capacity.json").read_text())
        target = res["attainment_target"]
        curve = sorted((p["rate_scale"], p["slo_attainment"]) for p in res["curve"])
        left.plot([x for x, _ in curve], [a for _, a in curve], label=row["policy"], markersize=4, **style[row["policy"]])
    if target is not None:
        left.axhline(target, color="grey", linestyle="--", linewidth=1)
    left.set_xscale("log")
    left.set_xlabel("load (x the trace's own rate)")
    left.set_ylabel("SLO attainment")
    left.grid(alpha=0.3)
    left.legend(fontsize=7, ncol=2)
    best = df.dropna(subset=["max_rate_scale"]).sort_values("max_rate_scale")
    right.barh(best["policy"], best["max_rate_scale"])
    right.set_xlabel(f"max load meeting the SLO for {target:.0%} of requests" if target else "max load")
    right.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build_report(sweep_dir: str | Path, rate_scale: float | None = None, out: str | Path | None = None) -> Path:
    """The page (a few seconds): under a stop block, so that a signal lets it finish its files (none is
    left half-written) and then ends the command with 128 + the signal (app/entry/stop.py)."""
    with stop_on_signals():
        return _build_report(sweep_dir, rate_scale, out)


def _build_report(sweep_dir: str | Path, rate_scale: float | None, out: str | Path | None) -> Path:
    sweep = Path(sweep_dir)
    df = write_sweep_table(sweep)
    if "status" in df:  # failed, interrupted and stalled jobs are listed in the table, not plotted
        df = df[df["status"] == "ok"]
    if df.empty:
        raise FileNotFoundError(f"no job under {sweep} has a summary.json: is this a multirun folder?")
    if "policy_config" in df:  # label variants of one policy (sglang_lpm, ...) by their config name
        df["policy"] = df["policy_config"].fillna(df["policy"])
    if "overrides" in df:  # a knob swept besides load and trace (policy.token_budget=...) makes its own series
        df["policy"] = [_series(o, p) for o, p in zip(df["overrides"].fillna(""), df["policy"])]
    figs = sweep / "report_figures"
    figs.mkdir(exist_ok=True)
    capacity = "max_rate_scale" in df and df["max_rate_scale"].notna().any() or (
        "max_rate_scale" in df and "p99_ttft_ms" not in df)
    if capacity:
        images = [("maximum load under the SLO", _capacity(sweep, df, figs / "capacity.png"))]
        rate_scale = -1.0  # no per-load CDFs for a capacity sweep
    else:
        images = [(label, _vs_rate(df, m, label, figs / f"{m}_vs_rate.png")) for m, label in VS_RATE if m in df]
        images += [(label, _vs_rate(df, m, label, figs / f"{m}_vs_rate.png")) for m, label in WHERE_PRESENT
                   if m in df and df[m].fillna(0).any()]
    if rate_scale is None and "rate_scale" in df:
        scales = sorted(df["rate_scale"].dropna().unique())
        rate_scale = float(scales[len(scales) // 2]) if scales else None
    if rate_scale is not None and rate_scale >= 0:
        cdf = _cdfs(sweep, df, rate_scale, figs / "cdfs.png")
        if cdf:
            images.append((f"latency CDFs at rate scale {rate_scale:g}", cdf))
    body = [f"<h1>Policy comparison: {html.escape(sweep.name)}</h1>",
            f"<p>{len(df)} jobs; policies: {html.escape(', '.join(sorted(df['policy'].unique())))}; traces: "
            f"{html.escape(', '.join(sorted(df['trace'].unique())))}; SLO: {html.escape(str(df['slo'].iloc[0]))}.</p>"]
    cols = [c for c in HEADLINE if c in df.columns and df[c].notna().any()]
    for label, path in images:
        data = base64.b64encode(path.read_bytes()).decode()
        body.append(f"<h2>{html.escape(label)}</h2><img alt='{html.escape(label)}' src='data:image/png;base64,{data}'>")
    body.append("<h2>All jobs</h2>" + df[cols].to_html(index=False, float_format=lambda x: f"{x:.4g}", border=0))
    page = ("<!doctype html><html><head><meta charset='utf-8'><title>testbed report</title><style>"
            "body{font-family:sans-serif;margin:2em;max-width:1600px} img{max-width:100%} "
            "table{border-collapse:collapse;font-size:12px} td,th{padding:2px 8px;border-bottom:1px solid #ddd}"
            "</style></head><body>" + "\n".join(body) + "</body></html>")
    out = Path(out) if out else sweep / "report.html"
    out.write_text(page)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description="Write an HTML report for a multirun folder.")
    ap.add_argument("sweep_dir")
    ap.add_argument("--rate-scale", type=float, default=None, help="the load whose CDFs to plot (default: the median)")
    ap.add_argument("--out", default=None, help="the HTML file (default: <sweep_dir>/report.html)")
    args = ap.parse_args()
    print(build_report(args.sweep_dir, args.rate_scale, args.out))


if __name__ == "__main__":
    main()
