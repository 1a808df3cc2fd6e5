"""Writing a run's results: the same files for every backend, so reports never care.

`requests.parquet` (one row per trace row), `steps.parquet` (one row per engine step),
`summary.json` (deterministic: nothing in it depends on the wall clock) and
`config.yaml` (the resolved config), plus `run_info.json` for what does vary
(wall time, versions).
"""
from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from testbed.core.loop import TOO_LONG, StepSeries
from testbed.app.analysis.tables import text_table

if TYPE_CHECKING:  # imported where tables are built: a rerun's skip check and the CLI's table need no pandas
    import pandas as pd


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_clean(v) for v in x]
    return x


def summary_json(summary: dict) -> str:
    return json.dumps(_clean(summary), indent=2, sort_keys=True) + "\n"


def steps_frame(series_by_replica: list[StepSeries]) -> pd.DataFrame:
    import pandas as pd

    frames = []
    for replica, series in enumerate(series_by_replica):
        n = len(series.duration)  # a step planned but not completed (horizon) has no duration
        df = pd.DataFrame({f.name: _numeric_column(getattr(series, f.name), n) for f in fields(series)})
        df.insert(0, "replica", replica)
        frames.append(df)
    if len(frames) == 1:  # already indexed 0..n-1: concat would only copy it
        return frames[0]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _numeric_column(values, n: int):
    """The first `n` values as a numpy array, typed as pandas types a list of them (Python ints: int64,
    any float: float64) but without pandas' per-value inference; other values stay a list for pandas."""
    if n:
        column = np.array(values if len(values) == n else values[:n])
        if column.dtype in (np.int64, np.float64):
            return column
    return values[:n]


FAILED = "failed.json"  # a run that ended in an exception, or whose process was killed: why


class RunNotComplete(RuntimeError):
    """A run that was interrupted or stalled: its results are written and say so (no FAILED)."""


def record_failure(out_dir: str | Path, reason: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / FAILED).write_text(json.dumps({"status": "failed", "reason": reason}, indent=2) + "\n")


def clear_failure(out_dir: str | Path) -> None:
    (Path(out_dir) / FAILED).unlink(missing_ok=True)


def run_status(out_dir: str | Path) -> str | None:
    """What a run folder holds: "failed: <why>" (its FAILED record), "interrupted" or "stalled"
    (from its summary), "ok", or None when it holds no results. Only an "ok" folder may be
    skipped by a rerun: an interrupted or stalled run wrote results too, but they are partial,
    so the same command must redo it, as it redoes a failed one."""
    out = Path(out_dir)
    if (out / FAILED).exists():
        return "failed: " + json.loads((out / FAILED).read_text())["reason"]
    path = out / "summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    if summary.get("interrupted"):
        return "interrupted"
    if summary.get("stalled"):
        return "stalled"
    return "ok"


def check_writable(out_dir: str | Path, key: str = "output.dir") -> None:
    """Fail at the start, naming the key, where the results could not be written at the end (a whole run
    lost to an unwritable folder): the folder is made and a file written and removed in it."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-check-"):
            pass
    except OSError as e:
        raise OSError(f"{key}={out_dir}: the results cannot be written there ({e.strerror or e}); choose a "
                      "writable folder") from None


def arrow_leaves_signals_alone() -> None:
    """pyarrow takes SIGINT for itself while it writes a parquet file and cancels the write (ArrowCancelled):
    a sweep job stopped by Ctrl-C once lost its results so. The signal is the command's (app/entry/stop.py)."""
    import pyarrow

    pyarrow.enable_signal_handlers(False)


def write_results(out_dir: str | Path, requests: pd.DataFrame, steps: pd.DataFrame | None, summary: dict,
                  config_yaml: str, run_info: dict) -> Path:
    arrow_leaves_signals_alone()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    requests.to_parquet(out / "requests.parquet", index=False)
    if steps is not None:
        steps.to_parquet(out / "steps.parquet", index=False)
    (out / "summary.json").write_text(summary_json(summary))
    (out / "config.yaml").write_text(config_yaml)
    (out / "run_info.json").write_text(json.dumps(_clean(run_info), indent=2, sort_keys=True) + "\n")
    clear_failure(out)  # an earlier attempt's failure no longer holds
    return out


def format_table(summary: dict) -> str:
    """A short plain-text table of the headline metrics."""
    rows = [("requests", f"{summary['num_requests']} = {summary['completed']} finished + "
                         f"{summary['rejected']} rejected + {summary['unfinished']} unfinished")]
    if summary["reject_reasons"]:
        rows.append(("rejected by reason", ", ".join(f"{k}: {v}" for k, v in summary["reject_reasons"].items())))
    if "cost_model" in summary and summary.get("backend") == "sim":  # (a real backend's cost model only predicts)
        from testbed.app.assembly.provenance import table_row

        rows.append(table_row(summary))
    rows.append(("duration", f"{summary['duration_s']:.1f} s"))
    rows.append(("throughput", f"{summary['request_throughput']:.2f} req/s, {summary['output_throughput']:.0f} out tok/s, "
                               f"{summary['total_token_throughput']:.0f} tok/s"))
    frontend = summary.get("frontend", "none")
    if frontend != "none":  # the plain rows are the client's: say so, and show the engine's beside them
        delay = summary.get("mean_frontend_delay_ms")
        rows.append((f"front end {frontend}", (f"mean {delay:.1f} ms from the server to the engine's queue; "
                                               if delay is not None else "") + "unmarked latencies are the client's"))
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"), ("queue", "queueing")):
        for prefix in ("", "engine_") if frontend != "none" and key != "itl" else ("",):
            if summary.get(f"{prefix}mean_{key}_ms") is None:
                continue
            rows.append((f"{'engine ' if prefix else ''}{label} ms", "mean {:.1f}  p50 {:.1f}  p90 {:.1f}  p99 {:.1f}".format(
                *(summary[f"{prefix}{k}_{key}_ms"] for k in ("mean", "p50", "p90", "p99")))))
    rows.append(("preemptions", str(summary["num_preemptions"])))
    if summary.get("prefix_cache_hit_rate"):
        rows.append(("prefix cache hit rate", f"{summary['prefix_cache_hit_rate']:.1%}"))
    if "offload_hit_tokens" in summary:
        rows.append(("host KV tier", f"{summary['offload_hit_tokens']} tokens loaded, external hit rate "
                                     f"{summary['external_prefix_cache_hit_rate']:.1%}, total hit rate "
                                     f"{summary['total_prefix_hit_rate']:.1%}"))
    if summary.get("disagg"):
        rows.append(("pools", ", ".join(
            f"{pool} {summary[f'{pool}_replicas']} x {summary[f'{pool}_gpus'] // summary[f'{pool}_replicas']} GPU "
            f"({summary[f'{pool}_utilization']:.0%} busy)" for pool in ("prefill", "decode"))))
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        rows.append((f"KV {summary['kv_link']} ms", f"transfer mean {fmt(summary['mean_kv_transfer_ms'])} p99 "
                     f"{fmt(summary['p99_kv_transfer_ms'])}, decode KV wait mean {fmt(summary['mean_kv_wait_ms'])} "
                     f"p99 {fmt(summary['p99_kv_wait_ms'])}"))
    failed = [k for k, ok in summary["slo_checks"].items() if not ok]
    verdict = ("none" if not summary["slo_checks"] else "pass" if summary["slo_pass"]
               else "fail" + (f" ({', '.join(failed)})" if failed else ""))
    rows.append((f"SLO {summary['slo']}", f"goodput {summary['request_goodput']:.2f} req/s, attainment "
                                          f"{summary['slo_attainment']:.1%}, p{summary.get('slo_percentile', 99):g} "
                                          f"check: {verdict}"))
    rows.append(("SLO check", slo_check_line(summary)))
    return text_table(rows)


_CHECK = re.compile(r"p([\d.]+)_(ttft|tpot|e2el)_ms<=(.+)")
_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "e2el": "E2E latency"}


def slo_check_line(summary: dict) -> str:
    """What the check verdict above it checked, against what, and which requests it left out (metrics.summarize)."""
    limits = [f"p{m[1]} {_LABELS[m[2]]} <= {m[3]} ms" for k in summary["slo_checks"] if (m := _CHECK.fullmatch(k))]
    if not limits:
        return f"slo={summary['slo']} sets no latency limit: nothing to check"
    line = f"{' and '.join(limits)} over the finished requests, and every request finished"
    too_long = summary.get("reject_reasons", {}).get(TOO_LONG, 0)
    if too_long:
        line += (f"; {too_long} request{'s' if too_long != 1 else ''} rejected (longer than the context), "
                 "not counted")
    return line
