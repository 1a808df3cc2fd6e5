"""One table for a whole multirun, written by a Hydra callback when the sweep ends.

Each job writes its own `summary.json`, so a failed job loses nothing but itself; the
callback gathers whatever jobs finished, with the overrides that made each one, into
`sweep_summary.csv` (and `.parquet`) at the sweep's root, and prints the headline columns.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pandas as pd
import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)

HEADLINE = ["policy", "trace", "rate_scale", "max_rate_scale", "max_request_rate", "offered_request_rate", "completed", "rejected", "unfinished", "request_throughput",
            "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
            "p99_itl_ms", "p99_e2el_ms", "num_preemptions", "request_goodput", "slo_attainment"]


def collect(sweep_dir: str | Path) -> pd.DataFrame:
    """Every finished job's summary under `sweep_dir`, one row each, with its overrides."""
    rows = []
    jobs = {p.parent: p for p in Path(sweep_dir).glob("*/capacity.json")}  # testbed-capacity jobs
    jobs.update({p.parent: p for p in Path(sweep_dir).glob("*/summary.json")})
    for path in sorted(jobs.values()):
        summary = json.loads(path.read_text())
        row = {"job": path.parent.name}
        overrides = path.parent / ".hydra" / "overrides.yaml"
        if overrides.exists():
            row["overrides"] = " ".join(yaml.safe_load(overrides.read_text()) or [])
        config = path.parent / "config.yaml"
        if config.exists():
            cfg = yaml.safe_load(config.read_text())
            row["rate_scale"] = cfg.get("trace", {}).get("rate_scale")
        row.update({k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
        rows.append(row)
    return pd.DataFrame(rows)


def write_sweep_table(sweep_dir: str | Path) -> pd.DataFrame:
    df = collect(sweep_dir)
    if df.empty:
        log.warning("no job under %s wrote a summary.json", sweep_dir)
        return df
    df = df.sort_values([c for c in ("policy", "trace", "rate_scale", "job") if c in df.columns], kind="stable")
    df.to_csv(Path(sweep_dir) / "sweep_summary.csv", index=False)
    df.to_parquet(Path(sweep_dir) / "sweep_summary.parquet", index=False)
    return df


def format_sweep(df: pd.DataFrame) -> str:
    cols = [c for c in HEADLINE if c in df.columns]
    return df[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}")


class MergeSweepTable(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        df = write_sweep_table(sweep_dir)
        if not df.empty:
            print(f"\nsweep: {len(df)} jobs -> {sweep_dir / 'sweep_summary.csv'}")
            print(format_sweep(df))
