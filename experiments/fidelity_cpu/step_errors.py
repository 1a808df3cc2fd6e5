"""The cost model's per-step error along a real run, broken down: by step kind, and within each kind by
prefill tokens, decode batch, decode context, the idle wait before the step and the page faults its
execute() took. The evidence behind the fitted model's form (testbed/sim/fitted_cost.py).

    python experiments/fidelity_cpu/step_errors.py <testbed-fidelity output dir> [...]

Reads each dir's steps.csv (testbed-fidelity writes it). Error = predicted / measured - 1, for the whole
iteration (plan + execute + complete, what the simulator's step_time stands for), for execute() alone
(the engine part) and for the host part (iteration - execute, against the model's host_time).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd


def load(out: str | Path) -> pd.DataFrame:
    d = pd.read_csv(Path(out) / "steps.csv")
    d["err"] = d.predicted_s / d.measured_s - 1
    d["err_execute"] = d.predicted_execute_s / d.execute_s - 1
    d["host_ms"] = (d.measured_s - d.execute_s) * 1e3
    d["predicted_host_ms"] = (d.predicted_s - d.predicted_execute_s) * 1e3
    d["context"] = np.where(d.num_decode_seqs > 0, d.decode_kv_tokens / d.num_decode_seqs.clip(lower=1), np.nan)
    return d


def summary(d: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    return d.groupby(by, observed=True).agg(
        steps=("err", "size"), err_median=("err", "median"), err_execute_median=("err_execute", "median"),
        measured_ms=("measured_s", lambda x: 1e3 * x.median()), host_ms=("host_ms", "median"),
        predicted_host_ms=("predicted_host_ms", "median"),
        **({"faults_mean": ("minor_faults", "mean")} if "minor_faults" in d else {}))


def report(out: str | Path) -> str:
    d = load(out)
    parts = [f"## {out}", "", summary(d, ["kind"]).round(3).to_string(), ""]
    pre = d[d.num_prefill_seqs > 0].copy()
    if len(pre):
        pre["prefill tokens"] = pd.cut(pre.num_prefill_tokens, [0, 64, 128, 192, 255, 256, 10**6])
        parts += [summary(pre, ["kind", "prefill tokens"]).round(3).to_string(), ""]
    dec = d[d.num_decode_seqs > 0].copy()
    if len(dec):
        dec["decode batch"] = pd.cut(dec.num_decode_seqs, [0, 1, 2, 4, 8, 16, 10**6])
        parts += [summary(dec, ["kind", "decode batch"]).round(3).to_string(), ""]
        dec["context"] = pd.cut(dec.context, [0, 64, 128, 256, 512, 10**6])
        parts += [summary(dec, ["kind", "context"]).round(3).to_string(), ""]
    if "idle_before_s" in d:
        d["after idle"] = np.where(d.idle_before_s > 50e-6, "idle > 50 us before", "back to back")
        parts += [summary(d, ["kind", "after idle"]).round(3).to_string(), ""]
    if "minor_faults" in d:
        d["page faults"] = np.where(d.minor_faults > 8, "> 8", "<= 8")
        parts += [summary(d, ["kind", "page faults"]).round(3).to_string(), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    for out in sys.argv[1:]:
        print(report(out))
