"""One table for a whole multirun, with every job's status, however the sweep ends.

Each job writes its own results, so a failed job loses nothing but itself. The callback
records, in each job's folder, why a job failed (`failed.json`: the exception, or the signal
that killed its process; see `app/isolated.py`), and gathers every job folder, with the
overrides that made it and its status (ok / failed: why / interrupted / stalled), into
`sweep_summary.csv` (and `.parquet`) at the sweep's root, and prints the headline columns.

Hydra calls `on_multirun_end` only when every job succeeded: when one failed, its sweeper
raises after the batch has run (and exits 1). So the table is also written when the process
exits, if it has not been written by then: after a failed job, or a second Ctrl-C of the sweep.
A sweep stopped by SIGINT or SIGTERM (`app/sweep_signals.py`) ends normally: its running jobs
write what they had, marked interrupted, the jobs not started yet are listed as such.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from testbed.app.results import FAILED, RunNotComplete, arrow_leaves_signals_alone, record_failure, run_status
from testbed.app.stop import signal_name

if TYPE_CHECKING:  # the callback is built by every run (conf/config.yaml): tables are a sweep's end only
    import pandas as pd

log = logging.getLogger(__name__)

HEADLINE = ["policy", "trace", "rate_scale", "status", "max_rate_scale", "max_request_rate", "offered_request_rate",
            "completed", "rejected", "unfinished", "request_throughput",
            "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
            "p99_itl_ms", "p99_e2el_ms", "num_preemptions", "request_goodput", "slo_attainment", "router",
            "routed_max_share"]
_JOB_FILES = ("summary.json", "capacity.json", FAILED, ".hydra")  # .hydra: Hydra started the job


def collect(sweep_dir: str | Path) -> pd.DataFrame:
    """Every job folder under `sweep_dir`, one row each: its status, overrides and summary."""
    import pandas as pd

    root = Path(sweep_dir)
    rows = []
    from testbed.app.sweep_signals import stopped

    signum = stopped(root)
    for job in _job_folders(root):
        status = run_status(job)
        if status is None:
            status = (("interrupted" if json.loads((job / "capacity.json").read_text()).get("interrupted") else "ok")
                      if (job / "capacity.json").exists() else
                      f"interrupted: not started (the sweep was stopped by {signal_name(signum)})" if signum else
                      "failed: no results (its process ended early)")
        overrides = job / ".hydra" / "overrides.yaml"
        config = job / "config.yaml" if (job / "config.yaml").exists() else job / ".hydra" / "config.yaml"
        summary = job / "capacity.json" if (job / "capacity.json").exists() else job / "summary.json"
        rows.append(job_row(job.relative_to(root).as_posix(), status,
                            yaml.safe_load(overrides.read_text()) or [] if overrides.exists() else None,
                            yaml.safe_load(config.read_text()) or {} if config.exists() else None,
                            json.loads(summary.read_text()) if summary.exists() else None))
    return pd.DataFrame(rows)


def job_row(job: str, status: str, overrides: list[str] | None, config: dict | None, summary: dict | None) -> dict:
    """One job's row of the sweep table: its folder, status and overrides, what its config ran (a job that
    failed before writing a summary still says), and its summary's scalars. The Python API's sweep
    (testbed/api.py) builds its rows here too, so that both tables have the same columns."""
    row = {"job": job, "status": status}
    if overrides is not None:
        row["overrides"] = " ".join(overrides)
    if config is not None:
        row.update(policy=config.get("policy", {}).get("name"), trace=config.get("trace", {}).get("name"),
                   rate_scale=config.get("trace", {}).get("rate_scale"))
    if summary is not None:
        row.update({k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
    return row


def _job_folders(root: Path) -> list[Path]:
    """The folders below `root` that a job wrote, sorted. Each job has its own folder directly in the sweep
    folder (conf/config.yaml: hydra.sweep.subdir); deeper ones are found too, where a `hydra.sweep.subdir` of
    one's own nests them (a '/' in it, or the raw `${hydra.job.override_dirname}` of a file-valued override),
    so that the table still lists every job. A job's folder is not searched further, nor hidden ones
    (`.submitit`), nor links (a loop)."""
    if not root.is_dir():
        return []
    jobs, todo = [], [root]
    while todo:
        for d in todo.pop().iterdir():
            if d.name.startswith(".") or d.is_symlink() or not d.is_dir():
                continue
            if any((d / f).exists() for f in _JOB_FILES):
                jobs.append(d)
            else:
                todo.append(d)
    return sorted(jobs)


def write_sweep_table(sweep_dir: str | Path) -> pd.DataFrame:
    df = collect(sweep_dir)
    if df.empty:
        log.warning("no job under %s left a folder", sweep_dir)
        return df
    df = df.sort_values([c for c in ("policy", "trace", "rate_scale", "job") if c in df.columns], kind="stable")
    df.to_csv(Path(sweep_dir) / "sweep_summary.csv", index=False)
    arrow_leaves_signals_alone()
    df.to_parquet(Path(sweep_dir) / "sweep_summary.parquet", index=False)
    return df


def format_sweep(df: pd.DataFrame) -> str:
    cols = [c for c in HEADLINE if c in df.columns]
    return df[cols].to_string(index=False, float_format=lambda x: f"{x:.4g}")


# the sweep's reaction to SIGINT and SIGTERM during its launch (here, not in the callback, which Hydra
# pickles to each job)
_SIGNALS = contextlib.ExitStack()


class MergeSweepTable(Callback):
    def __init__(self) -> None:
        self._pending: Path | None = None  # the sweep whose table is still to be written

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from testbed.app.sweep_signals import sweeping

        self._pending = Path(config.hydra.sweep.dir)
        _SIGNALS.enter_context(sweeping(self._pending))
        import pandas  # noqa: F401  (now: the table written at exit cannot import it then, whose
        # import registers an atexit hook of its own, refused once the interpreter is shutting down)

        atexit.register(self._write_table)  # the sweep ended early: a job failed, or Ctrl-C

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        self._pending = Path(config.hydra.sweep.dir)
        self._write_table()

    def _write_table(self) -> None:
        _SIGNALS.close()
        sweep_dir, self._pending = self._pending, None
        if sweep_dir is None:
            return
        df = write_sweep_table(sweep_dir)
        if df.empty:
            return
        bad = df[df.status != "ok"]
        print(f"\nsweep: {len(df)} jobs" + (f", {len(bad)} not ok" if len(bad) else "") +
              f" -> {sweep_dir / 'sweep_summary.csv'}")
        print(format_sweep(df))
        for _, row in bad.iterrows():
            print(f"job {row.job} ({row.get('overrides', '')}): {row.status}")

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs) -> None:
        error = job_return._return_value  # `return_value` re-raises a failed job's exception
        if job_return.status == JobStatus.FAILED and not isinstance(error, RunNotComplete):
            record_failure(config.output.dir, f"{type(error).__name__}: {error}")
