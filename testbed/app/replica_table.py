"""One row per replica, from a run's request and step tables.

Why: a run's summary pools every replica, so a router that piles work onto one replica, or one
replica that preempts while the others idle, is invisible in it. The row per replica is computed
from the two tables a run writes (`requests.parquet`, `steps.parquet`), not recorded beside them,
so that a run folder written before this table existed gives it too (`testbed.load`).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

COLUMNS = ("replica", "requests", "finished", "unfinished", "preemptions", "output_tokens", "mean_ttft_ms",
           "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "steps", "busy_s", "utilization")


def replica_table(requests: pd.DataFrame, steps: pd.DataFrame, duration_s: float | None = None) -> pd.DataFrame:
    """Per replica: the requests routed to it and how they ended, their tokens and latencies (finished
    requests), its engine steps and busy time, and that time over the run's `duration_s` (None: unknown).
    Requests that reached no replica (rejected before routing, never arrived: replica -1) are in no row."""
    served = requests[requests["replica"] >= 0] if "replica" in requests else requests.iloc[0:0]
    ids = sorted(set(served["replica"].tolist()) | (set(steps["replica"].tolist()) if "replica" in steps else set()))
    rows = []
    for r in ids:
        mine = served[served["replica"] == r]
        done = mine[mine["outcome"] == "finished"]
        ran = steps[steps["replica"] == r] if "replica" in steps else steps.iloc[0:0]
        busy = float(ran["duration"].sum()) if len(ran) else 0.0
        rows.append({"replica": int(r), "requests": len(mine), "finished": len(done),
                     "unfinished": int((mine["outcome"] == "unfinished").sum()),
                     "preemptions": int(mine["preemptions"].sum()), "output_tokens": int(mine["generated"].sum()),
                     **_latency(done, "ttft_ms"), **_latency(done, "tpot_ms"),
                     "steps": int(ran["steps"].sum()) if len(ran) else 0, "busy_s": busy,
                     "utilization": busy / duration_s if duration_s else float("nan")})
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _latency(done: pd.DataFrame, column: str) -> dict:
    """Mean and p99 of a latency column over the finished requests that have it (NaN where none has)."""
    values = done[column].to_numpy(dtype=float) if column in done else np.empty(0)
    values = values[np.isfinite(values)]
    name = column.removesuffix("_ms")
    if not values.size:
        return {f"mean_{name}_ms": float("nan"), f"p99_{name}_ms": float("nan")}
    return {f"mean_{name}_ms": float(values.mean()), f"p99_{name}_ms": float(np.percentile(values, 99))}
