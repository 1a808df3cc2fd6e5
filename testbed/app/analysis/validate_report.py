"""`testbed-validate`'s tables: every stage and whole run, real beside simulated, and the errors summed up.

Why: the figures a reader checks a simulator by are the client's means, its tails (p90, p99) and its
per-token times, per stage, over the whole run and per model; each group gets one table, so that none
of them is a column lost in a wide one. Written to `output.dir`: validate.csv (one row per run and
stage, `stage` empty for a whole run), validate.md (the tables), validate.json (the report).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.app.analysis.validate_replay import FIT_METRICS, ITL, LABELS, METRICS, TAILS, StageResult, median_abs_errors, scored
from testbed.app.analysis.tables import markdown_table


def results_frame(results: list[StageResult]) -> pd.DataFrame:
    rows = []
    for r in results:
        row = {"run": r.run, "model": r.model, "stage": r.stage if r.stage is not None else pd.NA, "rate": r.rate,
               "overloaded": r.overloaded, "sim_overloaded": r.sim_overloaded,
               "messages_per_token": r.messages_per_token if r.messages_per_token is not None else pd.NA}
        for m in METRICS:
            row[f"real_{m}_ms"] = r.real.get(m, math.nan) * 1e3
            row[f"sim_{m}_ms"] = r.sim.get(m, math.nan) * 1e3
            row[f"{m}_error"] = r.error(m)
        rows.append(row)
    return pd.DataFrame(rows)


def by_model(results: list[StageResult]) -> dict:
    """Per model, the median |error| of each metric over its scored stages; then over the models, the
    median of those medians and the worst (largest) one with its model."""
    models = sorted({r.model for r in scored(results)})
    per = {m: median_abs_errors([r for r in results if r.model == m]) for m in models}
    median, worst = {}, {}
    for metric in METRICS:
        have = [(v[metric], m) for m, v in per.items() if not math.isnan(v[metric])]
        median[metric] = float(np.median([v for v, _ in have])) if have else math.nan
        worst[metric] = dict(zip(("error", "model"), max(have))) if have else {"error": math.nan, "model": None}
    return {"per_model": per, "median_of_models": median, "worst_model": worst}


def write(out_dir: str, stages: list[StageResult], wholes: list[StageResult], report: dict) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df = results_frame(stages + wholes)
    df.to_csv(out / "validate.csv", index=False)
    (out / "validate.json").write_text(json.dumps(report, indent=2, default=_json_default))
    md = (markdown(results_frame(stages), results_frame(wholes), report) if stages else  # (stopped before any)
          f"**interrupted**: {report.get('interrupted', 'no stage replayed')}\n")
    (out / "validate.md").write_text(md)
    print(md)


def _json_default(v):
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    raise TypeError(f"not JSON serialisable: {v!r}")


def _ms(v: float) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1f}"


def _ms3(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def _pct(v: float) -> str:
    return "n/a" if v is None or math.isnan(v) else f"{v:+.1%}"


def _abs(v: float) -> str:
    return "n/a" if v is None or math.isnan(v) else f"{v:.1%}"


def _table(df: pd.DataFrame, metrics: tuple[str, ...], fmt=_ms, stage_cols: bool = True) -> list[str]:
    head = ["run"] + (["stage", "rate"] if stage_cols else [])
    for m in metrics:
        head += [f"real {LABELS[m]} ms", "sim", "err"]
    rows = []
    for _, r in df.iterrows():
        note = " (overloaded" + (", sim too)" if r["sim_overloaded"] else ", sim not)") if r["overloaded"] else ""
        cells = [f"{r['run']}{note}"] + ([str(r["stage"]), f"{r['rate']:g}"] if stage_cols else [])
        for m in metrics:
            cells += [fmt(r[f"real_{m}_ms"]), fmt(r[f"sim_{m}_ms"]), _pct(r[f"{m}_error"])]
        rows.append(cells)
    return [markdown_table(head, rows)]


def markdown(df: pd.DataFrame, whole: pd.DataFrame, report: dict) -> str:
    lines = [f"**interrupted**: {report['interrupted']}", ""] if report.get("interrupted") else []
    lines += ["### Per stage: mean TTFT, E2E and TPOT ((E2E - TTFT) / (output tokens - 1))", ""]
    lines += _table(df, FIT_METRICS)
    lines += ["", "### Per stage: the client's p50, p90 and p99", ""]
    lines += _table(df, TAILS)
    lines += ["", "### Per stage: inter-token latency as the load generator defines it "
              "(every gap between stamped stream messages, testbed/app/analysis/inference_perf.py)", ""]
    itl = df[df["real_itl_ms"].notna()]
    if len(itl):
        lines += _table(itl, ITL, fmt=_ms3)
        per = sorted({int(v) for v in itl["messages_per_token"].dropna()})
        lines += ["", f"stamped messages per token, read off each stage's means: {', '.join(map(str, per)) or 'n/a'}"]
    missing = sorted(set(df["run"]) - set(itl["run"]))
    if missing:
        lines += ["", f"not available (the run reports no inter_token_latency): {', '.join(missing)}"]
    lines += ["", "### Whole runs (summary_lifecycle_metrics.json: every stage's requests together)", ""]
    if len(whole):
        lines += _table(whole, ("ttft", "ttft_p99", "e2e", "e2e_p99", "itl"), fmt=_ms3, stage_cols=False)
    if report.get("whole_runs_missing"):
        lines += ["", "not available (no summary_lifecycle_metrics.json): " + ", ".join(report["whole_runs_missing"])]
    lines += ["", "### Median absolute error", ""]
    which = "leave-one-model-out " if "leave_one_model_out_median_abs_error" in report else ""
    rows = [(f"{which}scored stages", report["scored_stages"], report["median_abs_error"]),
            ("whole runs (not overloaded)", report["whole_runs_scored"], report["whole_run_median_abs_error"])]
    if "in_sample_median_abs_error" in report:
        rows.append(("in-sample stages (fitted on all models)", report["scored_stages"],
                     report["in_sample_median_abs_error"]))
    lines.append(markdown_table(["over", "n", *(LABELS[m] for m in METRICS)],
                                [(name, n, *(_abs(med.get(m)) for m in METRICS)) for name, n, med in rows]))
    lines += ["", f"{which}median absolute error over {report['scored_stages']} scored stages "
              f"({report['overloaded_stages']} overloaded, not scored): "
              + ", ".join(f"{LABELS[m]} {_abs(report['median_abs_error'][m])}" for m in FIT_METRICS + ("e2e_p99",))]
    bm = report["by_model"]
    rows = [(model, *(_abs(med[m]) for m in METRICS)) for model, med in bm["per_model"].items()]
    rows.append(("**median of models**", *(_abs(bm["median_of_models"][m]) for m in METRICS)))
    rows.append(("**worst model**", *(f"{_abs(w['error'])} ({w['model']})" if w["model"] else "n/a"
                                      for w in (bm["worst_model"][m] for m in METRICS))))
    lines += ["", f"### By model ({which}median |error| of each model's scored stages)", "",
              markdown_table(["model", *(LABELS[m] for m in METRICS)], rows)]
    if "fitted_on_all_models" in report:
        lines += ["", "fitted on all models: " + ", ".join(f"{k}={v:.4g}" for k, v in report["fitted_on_all_models"].items())]
        for model, values in report.get("fitted_without_model", {}).items():
            lines.append(f"fitted without {model}: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items()))
        ins = report["in_sample_median_abs_error"]
        lines.append("in-sample median absolute error: " + ", ".join(f"{LABELS[m]} {_abs(ins[m])}" for m in FIT_METRICS))
    if "replays" in report:
        rp = report["replays"]
        lines.append(f"replays: {rp['simulated']} simulated for {rp['asked']} asked; wall {report['wall_s']:.0f} s")
    return "\n".join(lines) + "\n"
