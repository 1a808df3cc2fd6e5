"""One table for a whole multirun, with every job's status, however the sweep ends.

Each job writes its own results, so a failed job loses nothing but itself. The callback
records, in each job's folder, why a job failed (`failed.json`: the exception, or the signal
that killed its process; see `app/entry/isolated.py`), and gathers every job folder, with the
overrides that made it and its status (ok / failed: why / interrupted / stalled), into
`sweep_summary.csv` (and `.parquet`) at the sweep's root, and prints the headline columns in one
table (rich, one format per column, within 120 columns). While the jobs run, the command shows a bar
across them and one line per job as it ends (`app/reports/sweep_progress.py`); a job prints no table of its own.

Hydra calls `on_multirun_end` only when every job succeeded: when one failed, its sweeper
raises after the batch has run (and exits 1). So the table is also written when the process
exits, if it has not been written by then: after a failed job, or a second Ctrl-C of the sweep.
A sweep stopped by SIGINT or SIGTERM (`app/entry/sweep_signals.py`) ends normally: its running jobs
write what they had, marked interrupted, the jobs not started yet are listed as such.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import logging
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from testbed.app.analysis.results import FAILED, RunNotComplete, arrow_leaves_signals_alone, record_failure, run_status
from testbed.app.entry.stop import signal_name

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
    from testbed.app.entry.sweep_signals import stopped

    signum = stopped(root)
    return pd.DataFrame([folder_row(root, job, signum) for job in _job_folders(root)])


def folder_row(root: Path, job: Path, signum: int | None = None) -> dict:
    """One job folder's row of the table, read from its files (`signum`: the signal that stopped the sweep,
    if one did)."""
    status = run_status(job)
    if status is None:
        status = (("interrupted" if json.loads((job / "capacity.json").read_text()).get("interrupted") else "ok")
                  if (job / "capacity.json").exists() else
                  f"interrupted: not started (the sweep was stopped by {signal_name(signum)})" if signum else
                  "failed: no results (its process ended early)")
    overrides = job / ".hydra" / "overrides.yaml"
    config = job / "config.yaml" if (job / "config.yaml").exists() else job / ".hydra" / "config.yaml"
    summary = job / "capacity.json" if (job / "capacity.json").exists() else job / "summary.json"
    return job_row(_relative(job, root), status,
                   yaml.safe_load(overrides.read_text()) or [] if overrides.exists() else None,
                   yaml.safe_load(config.read_text()) or {} if config.exists() else None,
                   json.loads(summary.read_text()) if summary.exists() else None)


def _relative(job: Path, root: Path) -> str:
    try:
        return job.relative_to(root).as_posix()
    except ValueError:  # (a record's absolute folder, a relative sweep folder)
        try:
            return job.resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            return job.as_posix()


_TRACE_NAME = re.compile(r"^\$\{trace_name:([^,}]+)")


def trace_name(trace: dict) -> str | None:
    """The trace's name in a job's config. A job that failed before writing its resolved config.yaml left
    only Hydra's unresolved `.hydra/config.yaml`, whose name is the `${trace_name:<group's name>,${.path},..}`
    interpolation (conf/trace/*.yaml): resolved here as the run would have (testbed.app.assembly.config.trace_name),
    or, where that fails (the file's own error), the group's configured name."""
    name = trace.get("name")
    if not isinstance(name, str) or "${" not in name:
        return name
    from omegaconf import OmegaConf

    from testbed.app.assembly.config import trace_name as resolve

    if not OmegaConf.has_resolver("trace_name"):
        OmegaConf.register_new_resolver("trace_name", resolve)
    try:
        return str(OmegaConf.create({"trace": trace}).trace.name)
    except Exception:  # an interpolation this node cannot resolve alone, or the trace's own error
        match = _TRACE_NAME.match(name)
        return match.group(1).strip() if match else name


def job_row(job: str, status: str, overrides: list[str] | None, config: dict | None, summary: dict | None) -> dict:
    """One job's row of the sweep table: its folder, status and overrides, what its config ran (a job that
    failed before writing a summary still says), and its summary's scalars. The Python API's sweep
    (testbed/api.py) builds its rows here too, so that both tables have the same columns."""
    row = {"job": job, "status": status}
    if overrides is not None:
        row["overrides"] = " ".join(overrides)
    if config is not None:
        row.update(policy=config.get("policy", {}).get("name"), trace=trace_name(config.get("trace", {})),
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


# The printed table's columns (the full table is sweep_summary.csv): (summary key, header, format)
_SHOWN = [("status", "status", None), ("completed", "done", "{:,.0f}"), ("median_ttft_ms", "TTFT p50", "{:,.1f}"),
          ("p99_ttft_ms", "TTFT p99", "{:,.1f}"), ("p99_tpot_ms", "TPOT p99", "{:,.1f}"),
          ("p99_e2el_ms", "E2E p99", "{:,.0f}"), ("request_throughput", "req/s", "{:,.2f}"),
          ("request_goodput", "goodput", "{:,.2f}"), ("slo_attainment", "SLO met", "{:.1%}"),
          ("max_rate_scale", "max load x", "{:,.3g}"), ("max_request_rate", "max req/s", "{:,.2f}")]
_CAPTION = "latencies in ms, throughput (req/s) and goodput in requests/s"
WIDTH = 120  # the printed table's width where the output is not a terminal (a log, CI)
STATUS_CHARS = 28  # a longer status is cut in the table; the lines below it give it whole


def format_sweep(df: pd.DataFrame, swept: list[str] | None = None, width: int | None = None) -> str:
    """The sweep's table as printed: the job number, one column per swept key (its values), the status and
    the headline metrics, each column in one format, within `width` columns (rich)."""
    import io

    import pandas as pd
    from rich import box
    from rich.console import Console
    from rich.table import Table

    keys = swept if swept else [k for k in ("policy", "trace", "rate_scale") if k in df.columns]
    rows = df.assign(_num=[_job_number(j) for j in df["job"]]).sort_values(["_num", "job"], kind="stable")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True,
                  caption=_CAPTION if "median_ttft_ms" in rows.columns else None, caption_justify="left")
    table.add_column("#", justify="right")
    for key in keys:
        table.add_column(key.rsplit(".", 1)[-1], overflow="ellipsis", max_width=24)
    shown = [(k, h, f) for k, h, f in _SHOWN if k in rows.columns and rows[k].notna().any()]
    for key, header, fmt in shown:
        table.add_column(header, justify="left" if fmt is None else "right", overflow="ellipsis",
                         max_width=STATUS_CHARS if fmt is None else None, no_wrap=True)
    for _, row in rows.iterrows():
        values = _override_values(row.get("overrides"))
        cells = [str(row["_num"]) if row["_num"] >= 0 else row["job"]]
        cells += [values.get(k, "" if pd.isna(row.get(k)) else str(row.get(k))) for k in keys]
        for key, _, fmt in shown:
            v = row.get(key)
            cells.append("" if v is None or (not isinstance(v, str) and pd.isna(v)) else
                         " ".join(str(v).split()) if fmt is None else fmt.format(v))  # (one line per row)
        table.add_row(*cells)
    out = io.StringIO()
    Console(file=out, width=width or WIDTH, color_system=None, highlight=False, soft_wrap=False).print(table)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()).strip("\n")


def _job_number(job: str) -> int:
    match = re.match(r"(\d+)(?:_|$)", str(job))
    return int(match.group(1)) if match else -1


def _override_values(overrides) -> dict[str, str]:
    """key -> value of a job's overrides ("policy=vllm trace.rate_scale=2")."""
    if not isinstance(overrides, str):
        return {}
    return {k.lstrip("+~"): v for k, _, v in (o.partition("=") for o in overrides.split(" ")) if k}


# the sweep's reaction to SIGINT and SIGTERM during its launch, and its progress (here, not in the callback,
# which Hydra pickles to each job)
_SIGNALS = contextlib.ExitStack()
_WATCH: list = []  # the command's sweep_progress.Watch while the sweep runs


def _describe(job: Path) -> tuple[str, dict]:
    """A finished job's status and summary, as its row of the table has them."""
    row = folder_row(job.parent, job)
    return row["status"], row


class MergeSweepTable(Callback):
    def __init__(self) -> None:
        self._pending: Path | None = None  # the sweep whose table is still to be written
        self._swept: list[str] | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from testbed.app.reports.sweep_progress import Watch, plan_sweep, write_plan
        from testbed.app.entry.sweep_signals import sweeping

        self._pending = Path(config.hydra.sweep.dir)
        plan = plan_sweep(list(config.hydra.overrides.task), config.hydra.sweeper.get("params"),
                          str(config.hydra.sweeper.get("_target_", "")).endswith(".BasicSweeper"),
                          config.hydra.runtime.choices.get("experiment"))
        self._swept = plan.swept
        write_plan(self._pending, plan)
        _SIGNALS.enter_context(sweeping(self._pending))
        import pandas  # noqa: F401  (now: the table written at exit cannot import it then, whose
        # import registers an atexit hook of its own, refused once the interpreter is shutting down)

        _WATCH.append(Watch(self._pending, plan, _describe, bar=config.output.get("progress") is not False))
        atexit.register(self._write_table)  # the sweep ended early: a job failed, or Ctrl-C

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        self._pending = Path(config.hydra.sweep.dir)
        self._write_table()

    def _write_table(self) -> None:
        _SIGNALS.close()
        while _WATCH:
            _WATCH.pop().close()
        sweep_dir, self._pending = self._pending, None
        if sweep_dir is None:
            return
        df = write_sweep_table(sweep_dir)
        if df.empty:
            return
        bad = df[df.status != "ok"]
        print(f"\nsweep: {len(df)} jobs" + (f", {len(bad)} not ok" if len(bad) else "") +
              f" -> {sweep_dir / 'sweep_summary.csv'} (every column; .parquet alike)")
        print(format_sweep(df, self._swept))
        for _, row in bad.iterrows():
            print(f"job {row.job} ({row.get('overrides', '')}): {row.status}")
        from testbed.app.reports.wandb_log import offline_runs, sync_hint

        runs = offline_runs(sweep_dir)
        if runs:
            print(sync_hint(runs, sweep_dir))
        sys.stdout.flush()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs) -> None:
        error = job_return._return_value  # `return_value` re-raises a failed job's exception
        if job_return.status == JobStatus.FAILED and not isinstance(error, RunNotComplete):
            record_failure(config.output.dir, f"{type(error).__name__}: {error}")
        if config.hydra.mode == RunMode.MULTIRUN:  # the command's progress: this job has ended
            from testbed.app.reports.sweep_progress import record_job_end

            skipped = isinstance(error, dict) and bool(error.get("skipped"))
            record_job_end(config.hydra.sweep.dir, config.hydra.job.num, config.output.dir,
                           list(config.hydra.overrides.task), skipped)
