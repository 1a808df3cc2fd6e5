"""The command's view of a running sweep: one progress bar across its jobs, one line per job as it ends.

A job ends wherever its launcher ran it: in one of joblib's workers, submitit's or Ray's processes,
or in the command's own process (Hydra's basic launcher, one job after another). So the job's end
(`sweep.MergeSweepTable.on_job_end`, which Hydra calls where the job ran) leaves a small record in the
sweep folder (`.jobs/<num>.json`), and a thread of the command's process (`Watch`) turns each new
record into one line above the bar. Files, not a queue back to the command: every launcher already
shares the sweep folder with the command (on a cluster, its shared filesystem), and nothing else.

The sweep's plan (`.sweep.json`: how many jobs, which keys are swept, the experiment's name) is written
by the command before the launch, from the same overrides Hydra's BasicSweeper expands
(hydra/_internal/core_plugins/basic_sweeper.py, `sweep`: `hydra.sweeper.params` then the command
line), so the jobs can name themselves by their swept values only (W&B's run names).
"""
from __future__ import annotations

import json
import os
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

PLAN = ".sweep.json"
JOBS = ".jobs"  # hidden: sweep.py's job search skips it


@dataclass
class SweepPlan:
    jobs: int | None  # None: a sweeper other than Hydra's basic one decides as it goes
    swept: list[str] = field(default_factory=list)  # the keys whose values differ between jobs
    experiment: str | None = None


def plan_sweep(task_overrides: Sequence[str], sweeper_params: dict | None, basic_sweeper: bool,
               experiment: str | None = None) -> SweepPlan:
    """What the sweep will run, as Hydra's BasicSweeper expands it (its `sweep`, lines 147-160)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    arguments = [f"{k}={v}" for k, v in (sweeper_params or {}).items()] + list(task_overrides)
    parsed = OverridesParser.create().parse_overrides(arguments)
    swept = [o.get_key_element() for o in parsed if o.is_sweep_override()]
    jobs = len(BasicSweeper.split_arguments(parsed, None)[0]) if basic_sweeper else None
    return SweepPlan(jobs, list(dict.fromkeys(swept)), experiment)


def write_plan(sweep_dir: str | Path, plan: SweepPlan) -> None:
    root = Path(sweep_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / PLAN).write_text(json.dumps(asdict(plan)) + "\n")
    jobs = root / JOBS
    if jobs.is_dir():  # an earlier run of this sweep: its jobs' records are not this run's
        for old in jobs.glob("*.json"):
            old.unlink(missing_ok=True)


def read_plan(sweep_dir: str | Path) -> SweepPlan | None:
    try:
        return SweepPlan(**json.loads((Path(sweep_dir) / PLAN).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def swept_values(overrides: Sequence[str], swept: Sequence[str] | None) -> str:
    """The job's overrides of swept keys ("policy=vllm trace.rate_scale=2"); all of them where the swept
    keys are not known."""
    keep = [o for o in overrides if swept is None or _key(o) in swept]
    return " ".join(keep)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def record_job_end(sweep_dir: str | Path, num: int, job_dir: str | Path, overrides: Sequence[str],
                   skipped: bool) -> None:
    """The job's side: its record, written whole (a rename) so the watcher never reads half of one."""
    folder = Path(sweep_dir) / JOBS
    folder.mkdir(parents=True, exist_ok=True)
    record = {"num": int(num), "dir": str(job_dir), "overrides": list(overrides), "skipped": bool(skipped)}
    tmp = folder / f".{num}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, folder / f"{num}.json")


def job_line(record: dict, done: int, total: int | None, swept: Sequence[str] | None, status: str,
             summary: dict) -> str:
    """One line for one finished job: its place, its swept values, its status and its headline metrics."""
    width = len(str(total)) if total else 1
    place = f"[{done:>{width}}/{total}]" if total else f"[{done}]"
    what = swept_values(record.get("overrides", []), swept) or "(no overrides)"
    status = " ".join(status.split())  # one line, whatever the error's message held
    if record.get("skipped") and status == "ok":
        status = "skipped: its results were already there"
    line = f"{place} #{record['num']} {what}: {status}"
    return line + ("  " + metrics_text(summary) if status == "ok" or status.startswith("skipped") else "")


def metrics_text(summary: dict) -> str:
    """The headline metrics of a job's summary (a simulation's, or a capacity search's), fixed formats."""
    if "max_rate_scale" in summary:
        best = summary.get("max_rate_scale")
        return "max load " + ("none" if best is None else f"{best:.3g}x")
    parts = []
    if summary.get("num_requests") is not None:
        parts.append(f"{summary.get('completed', 0)}/{summary['num_requests']} done")
    for key, label in (("p99_ttft_ms", "p99 TTFT"), ("p99_tpot_ms", "p99 TPOT")):
        if isinstance(summary.get(key), (int, float)):
            parts.append(f"{label} {summary[key]:,.1f} ms")
    if isinstance(summary.get("request_goodput"), (int, float)):
        parts.append(f"goodput {summary['request_goodput']:.2f} req/s")
    if isinstance(summary.get("slo_attainment"), (int, float)):
        parts.append(f"SLO {summary['slo_attainment']:.1%}")
    return "  ".join(parts)


class Watch:
    """The command's thread: a tqdm bar over the jobs and a line per job, from the jobs' records.

    `describe(job_dir)` gives a finished job's (status, summary), read from its folder as the
    sweep's table reads it, so the line and the table agree."""

    def __init__(self, sweep_dir: str | Path, plan: SweepPlan | None, describe: Callable[[Path], tuple[str, dict]],
                 bar: bool = True, interval_s: float = 0.2) -> None:
        from tqdm import tqdm

        self.root, self.plan, self.describe, self.interval_s = Path(sweep_dir), plan, describe, interval_s
        self.seen: set[str] = set()
        self.bar = tqdm(total=plan.jobs if plan else None, desc="sweep", unit="job", file=sys.stderr,
                        disable=not bar, dynamic_ncols=True, leave=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sweep-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def poll(self) -> None:
        folder = self.root / JOBS
        if not folder.is_dir():
            return
        for path in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns if p.exists() else 0):
            if path.name in self.seen:
                continue
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            self.seen.add(path.name)
            try:
                status, summary = self.describe(Path(record["dir"]))
            except Exception as e:  # a line must never stop the sweep
                status, summary = f"(its folder could not be read: {e})", {}
            self.bar.update(1)
            self.bar.write(job_line(record, len(self.seen), self.plan.jobs if self.plan else None,
                                    self.plan.swept if self.plan else None, status, summary), file=sys.stdout)

    def close(self) -> None:
        """The last records, then the bar's last state (called once the launch has returned or stopped)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self.poll()
        self.bar.close()
        sys.stdout.flush()
