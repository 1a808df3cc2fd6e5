"""The Python API: the command line's runs, from a notebook or a script.

Why a door of its own: composing a config with `hydra.compose` and calling the simulator directly
skipped the checks the command line makes (`+scheduler.max_num_seq=10` ran silently with 256
sequences), and left the caller to read parquet files back. Here a run takes the command line's
override strings, is composed from the same config groups and checked by the same function
(`testbed.app.validate.check_config`), runs through the same path as `testbed-sim`
(`testbed.app.cli.run_job`, which sets the summary's policy config too) and writes the same files
(only where asked), so a run in a notebook and on the command line give one summary.

    import testbed

    res = testbed.simulate(["policy=sarathi", "trace.max_requests=300"])
    table = testbed.sweep({"policy": ["vllm", "sarathi"], "trace.rate_scale": [1, 2]})
    again = testbed.load("outputs/2025-01-01/12-00-00_vllm_azure_conv")

Imported on first use of `testbed.simulate` (and the other names), so `import testbed` stays light.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from testbed.app.cli import CONF_DIR, incomplete, report_run, run_job, write_run
from testbed.app.validate import ConfigError, check_config

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["ConfigError", "Results", "load", "simulate", "sweep"]

_DIR_OVERRIDE = "output.dir="
_JOB_NAME = "cli"  # hydra.job.name of a `testbed-sim` run (Hydra names it after testbed/app/cli.py)


@dataclass(repr=False)
class Results:
    """One run's results, in memory: what a `testbed-sim` run writes to its folder.

    Attributes:
        requests: One row per trace row (`requests.parquet`): outcome, reason, latencies.
        steps: One row per engine step or decode run (`steps.parquet`); empty where none was recorded.
        replicas: One row per replica, computed from the two tables (`testbed.app.replica_table`).
        summary: The run's metrics, as in `summary.json` (non-finite values are None there and here).
        config: The resolved config the run used (`config.yaml`).
        output_dir: The folder the files were written to, or None where nothing was written.

    Example:
        >>> res = testbed.simulate(["trace.max_requests=100"])
        >>> res.summary["p99_ttft_ms"], len(res.requests)
    """

    requests: pd.DataFrame
    steps: pd.DataFrame
    replicas: pd.DataFrame
    summary: dict
    config: DictConfig
    output_dir: Path | None = None

    def __repr__(self) -> str:
        s = self.summary

        def ms(key: str) -> str:
            value = s.get(key)
            return "-" if value is None else f"{value:.1f} ms"

        where = str(self.output_dir) if self.output_dir is not None else "not written"
        state = " INTERRUPTED" if s.get("interrupted") else " STALLED" if s.get("stalled") else ""
        goodput = s.get("request_goodput")
        return (f"Results({s.get('policy')} on {s.get('trace')}{state}: {s.get('num_requests')} requests = "
                f"{s.get('completed')} finished + {s.get('rejected')} rejected + {s.get('unfinished')} unfinished; "
                f"p99 TTFT {ms('p99_ttft_ms')}, p99 TPOT {ms('p99_tpot_ms')}, goodput "
                f"{'-' if goodput is None else f'{goodput:.2f}'} req/s; {len(self.replicas)} replica(s); {where})")


def simulate(overrides: list[str] | None = None, *, config_name: str = "config",
             output_dir: str | Path | None = None, quiet: bool = True) -> Results:
    """Run one configuration, as `testbed-sim` with the same override strings would.

    The config is composed from the command line's config groups and checked by the same function
    before anything runs, so a key no schema declares, a value out of its range or a group choice
    that does not exist is refused with the command line's message. The backend is the config's
    (`backend=sim` unless an override says otherwise).

    Args:
        overrides: The command line's override strings, e.g. `["policy=sarathi", "trace.rate_scale=2"]`.
        config_name: The primary config (`testbed/conf/<name>.yaml`).
        output_dir: Where to write the run's files (`requests.parquet`, `steps.parquet`, `summary.json`,
            `config.yaml`, ...), as the command line's `output.dir`; it wins over an `output.dir=`
            override. None: nothing is written, unless the overrides set `output.dir`.
        quiet: False prints the command line's table after the run (and its progress bar on a terminal).

    Returns:
        The run's tables, summary and resolved config. A run that was interrupted (Ctrl-C, a kernel
        interrupt: the step under way finishes) or stalled returns what it has, its summary says
        so, and a RuntimeWarning says why.

    Raises:
        ConfigError: The config cannot run (a ValueError); the message is the command line's.

    Example:
        >>> import testbed
        >>> res = testbed.simulate(["policy=sarathi", "trace.max_requests=300"])
        >>> res.summary["p99_ttft_ms"]
        >>> res.requests.groupby("outcome").size()
    """
    overrides = _override_list(overrides, "overrides")
    full = compose(overrides, config_name)
    with as_hydra_job(full, output_dir, overrides) as cfg:
        return _run(full, cfg, quiet)


def sweep(grid: dict[str, list], *, overrides: list[str] | None = None, output_dir: str | Path | None = None,
          n_jobs: int = 1, config_name: str = "config") -> pd.DataFrame:
    """Run every combination of the grid's values: `testbed-sim -m key=a,b other=x,y` from Python.

    Every job's config is composed and checked before the first job runs, so a bad value stops the
    sweep at once, naming its job. A job that fails while running is a row whose `status` says why
    (`failed: ...`), as in the command line's sweep; the others go on. Ctrl-C ends the job under way
    (marked interrupted) and lists the rest as not started.

    Args:
        grid: Override key -> the values to sweep, e.g. `{"policy": ["vllm", "sarathi"], "trace.rate_scale": [1, 2]}`.
            Values are written as override strings (True -> `true`, None -> `null`).
        overrides: Overrides every job shares, e.g. `["trace.max_requests=300"]`.
        output_dir: The sweep's folder: one folder per job (named as the command line names them) and
            `sweep_summary.csv`/`.parquet`. None: nothing is written.
        n_jobs: Jobs run at once; above 1 in joblib's worker processes.
        config_name: The primary config (`testbed/conf/<name>.yaml`).

    Returns:
        One row per job, in the grid's order: the swept keys' values first (a key the command line's
        table already has, such as `policy`, keeps that table's value: the policy's name), then the
        columns of the command line's `sweep_summary.csv` (`job`, `status`, `overrides`, the summary's
        metrics).

    Raises:
        ConfigError: A job's config cannot run (the message names the job's overrides).

    Example:
        >>> import testbed
        >>> table = testbed.sweep({"policy": ["vllm", "sarathi"], "trace.rate_scale": [1, 2]},
        ...                       overrides=["trace.max_requests=300"])
        >>> table[["policy", "trace.rate_scale", "p99_ttft_ms"]]
    """
    import pandas as pd

    from testbed.app.stop import signal_name, stop_on_signals
    from testbed.app.sweep import job_row, write_sweep_table

    grid, shared = _grid_lists(grid), _override_list(overrides, "overrides")
    keys = list(grid)
    if not isinstance(n_jobs, int) or n_jobs < 1:
        raise ValueError(f"n_jobs={n_jobs!r}: expected a whole number >= 1")
    root = Path(output_dir).resolve() if output_dir is not None else None
    combos = list(itertools.product(*(grid[k] for k in keys)))
    jobs = []  # (overrides, composed config, folder name): all checked before any runs
    for num, combo in enumerate(combos):
        job = shared + [f"{k}={_override_value(v)}" for k, v in zip(keys, combo)]
        try:
            full = compose(job, config_name)
            name = _job_name(full, num)
            with as_hydra_job(full, root / name if root else None, job) as cfg:
                check_config(cfg)
        except ConfigError as e:
            raise ConfigError(f"sweep job {num} ({' '.join(job)}): {e}") from None
        jobs.append((job, full, name))
    with stop_on_signals() as stop:
        if n_jobs > 1 and len(jobs) > 1:
            from joblib import Parallel, delayed

            done = Parallel(n_jobs=n_jobs)(delayed(_sweep_job)(full, job, root / name if root else None)
                                           for job, full, name in jobs)
        else:
            done = []
            for job, full, name in jobs:
                if stop():
                    done.append((f"interrupted: not started (the sweep was stopped by {signal_name(stop.signum)})",
                                 None, None))
                    continue
                done.append(_sweep_job(full, job, root / name if root else None))
    rows = []
    for combo, (job, full, name), (status, config, summary) in zip(combos, jobs, done):
        row = job_row(name, status, list(full.hydra.overrides.task), config, summary)
        rows.append({**{k: row.pop(k, v) for k, v in zip(keys, combo)}, **row})  # the swept keys first
    if root is not None:
        write_sweep_table(root)
    return pd.DataFrame(rows)


def load(path: str | Path) -> Results | pd.DataFrame:
    """Read back what a run or a sweep wrote, from the command line or from this API.

    Args:
        path: A run's folder (it holds `summary.json`) or a sweep's folder (it holds
            `sweep_summary.csv`/`.parquet`, or job folders whose table was never written).

    Returns:
        A run folder: its Results. A sweep folder: its table, as the command line wrote it.

    Raises:
        FileNotFoundError: The folder is neither.

    Example:
        >>> import testbed
        >>> res = testbed.load("outputs/2025-01-01/12-00-00_vllm_azure_conv")
        >>> table = testbed.load("multirun/2025-01-01/12-00-00")
    """
    import pandas as pd

    from testbed.app.replica_table import replica_table
    from testbed.app.sweep import collect

    folder = Path(path)
    if (folder / "summary.json").is_file():
        summary = json.loads((folder / "summary.json").read_text())
        requests = pd.read_parquet(folder / "requests.parquet")
        steps = pd.read_parquet(folder / "steps.parquet") if (folder / "steps.parquet").is_file() else pd.DataFrame()
        config = OmegaConf.load(folder / "config.yaml") if (folder / "config.yaml").is_file() else OmegaConf.create()
        return Results(requests, steps, replica_table(requests, steps, summary.get("duration_s")), summary, config,
                       folder)
    if (folder / "sweep_summary.parquet").is_file():
        return pd.read_parquet(folder / "sweep_summary.parquet")
    if (folder / "sweep_summary.csv").is_file():
        return pd.read_csv(folder / "sweep_summary.csv")
    table = collect(folder) if folder.is_dir() else pd.DataFrame()
    if table.empty:
        raise FileNotFoundError(f"{folder}: neither a run folder (summary.json) nor a sweep folder "
                                "(sweep_summary.csv, or job folders)")
    return table


# --- composing and running ------------------------------------------------------------------------
def compose(overrides: Sequence[str], config_name: str = "config") -> DictConfig:
    """The config `testbed-sim <overrides>` composes, its `hydra` node included. Hydra's errors (a
    group choice that does not exist, a key a schema lacks, a value of the wrong type) become
    ConfigError, with the message the command line prints for them."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(str(CONF_DIR), job_name=_JOB_NAME, version_base="1.3"):
            return hydra_compose(config_name, overrides=list(overrides), return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_hydra_message(e)) from None


def _hydra_message(e: BaseException) -> str:
    """What Hydra's command line prints for a composition error: the error, and the OmegaConf error
    under it (hydra/_internal/utils.py:226-229, `run_and_report`)."""
    from hydra.errors import CompactHydraException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(e, CompactHydraException) and isinstance(e.__cause__, OmegaConfBaseException):
        return f"{e}\n{e.__cause__}"
    return str(e)


@contextlib.contextmanager
def as_hydra_job(full: DictConfig, output_dir: str | Path | None, overrides: Sequence[str]) -> Iterator[DictConfig]:
    """The run's config (without `hydra`) while Hydra's job state says what it says under `testbed-sim`
    (the run path reads the command line's overrides and group choices from it), restored after, as
    Hydra's own `run_job` sets it (hydra/core/utils.py:110-128). `output.dir`: `output_dir` where given,
    else an `output.dir=` override, else missing (`???`: nothing is written)."""
    from hydra.core.hydra_config import HydraConfig

    full = copy.deepcopy(full)
    if output_dir is not None:
        output_dir = str(Path(output_dir).resolve())
        with read_write(full.hydra.runtime), open_dict(full.hydra.runtime):
            full.hydra.runtime.output_dir = output_dir
    task = copy.deepcopy(full)
    with read_write(task), open_dict(task):
        del task["hydra"]
    if output_dir is not None:
        task.output.dir = output_dir
    elif not any(o.lstrip("+~").startswith(_DIR_OVERRIDE) for o in overrides):
        task.output.dir = "???"
    hydra = HydraConfig.instance()
    before = hydra.cfg
    hydra.set_config(full)
    try:
        yield task
    finally:
        hydra.cfg = before


def _run(full: DictConfig, cfg: DictConfig, quiet: bool) -> Results:
    """Check, run, write (where `output.dir` is set) and gather one run: `testbed-sim`'s main, without
    its rerun skip (a call always runs) and with the results kept in memory."""
    from testbed.app.inputs import forget_inputs, read_inputs, write_inputs
    from testbed.app.replica_table import replica_table
    from testbed.app.results import check_writable, summary_json
    from testbed.app.stop import stop_on_signals

    check_config(cfg)
    out = None if OmegaConf.is_missing(cfg.output, "dir") else Path(cfg.output.dir)
    if out is not None:
        check_writable(out)
        inputs = read_inputs(cfg)
        forget_inputs(out)
    run_cfg = cfg
    if quiet and cfg.output.progress is None:  # no bar: the config written still says null
        run_cfg = copy.deepcopy(cfg)
        run_cfg.output.progress = False
    with stop_on_signals() as stop:
        result = run_job(run_cfg, stop)
        if out is not None:
            write_run(cfg, result)
            _write_hydra_files(full, cfg, out)
    if out is not None:
        write_inputs(out, inputs)
    report_run(cfg, result, out, print_table=not quiet)
    why = incomplete(cfg, result.summary, stop.signum)
    if why is not None:
        warnings.warn(why[0], RuntimeWarning, stacklevel=3)
    summary = json.loads(summary_json(result.summary))  # as summary.json holds it: load() gives the same
    return Results(result.requests, result.steps, replica_table(result.requests, result.steps, summary.get("duration_s")),
                   summary, OmegaConf.create(OmegaConf.to_yaml(cfg, resolve=True)), out)


def _write_hydra_files(full: DictConfig, cfg: DictConfig, out: Path) -> None:
    """Hydra's record of the job (`hydra.output_subdir`, `.hydra/`): the overrides that made it, which a
    sweep's table lists, and the config as composed (hydra/core/utils.py:172-178)."""
    if full.hydra.output_subdir is None:
        return
    where = out / str(full.hydra.output_subdir)
    where.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, where / "config.yaml")
    OmegaConf.save(full.hydra.overrides.task, where / "overrides.yaml")


def _sweep_job(full: DictConfig, overrides: list[str], job_dir: Path | None) -> tuple[str, dict | None, dict | None]:
    """One sweep job: (status, the little of its config the table shows, its summary or None). A failure is
    its row's status, and `failed.json` in its folder, as a command line sweep records it."""
    from testbed.app.results import record_failure

    with as_hydra_job(full, job_dir, overrides) as cfg:
        config = {"policy": {"name": cfg.policy.name}, "trace": {"name": cfg.trace.name,
                                                                 "rate_scale": cfg.trace.rate_scale}}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # the status says it
                summary = _run(full, cfg, quiet=True).summary
        except Exception as e:  # noqa: BLE001  (the command line's sweep goes on past a failed job too)
            reason = f"{type(e).__name__}: {e}"
            if job_dir is not None:
                record_failure(job_dir, reason)
            return f"failed: {reason}", config, None
    status = "interrupted" if summary.get("interrupted") else "stalled" if summary.get("stalled") else "ok"
    return status, config, summary


def _job_name(full: DictConfig, num: int) -> str:
    """The job's folder name as a command line sweep names it (`hydra.sweep.subdir`, conf/config.yaml)."""
    named = copy.deepcopy(full)
    with read_write(named.hydra), open_dict(named.hydra):
        named.hydra.job.num = num
    return str(OmegaConf.select(named, "hydra.sweep.subdir"))


def _override_list(overrides: Any, what: str) -> list[str]:
    if overrides is None:
        return []
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        raise TypeError(f"{what}: expected a list of override strings such as ['policy=sarathi'], got {overrides!r}")
    return list(overrides)


def _grid_lists(grid: Any) -> dict[str, list]:
    if not isinstance(grid, dict) or not grid:
        raise TypeError(f"grid: expected a dict of override key -> list of values, got {grid!r}")
    out = {}
    for key, values in grid.items():
        if not isinstance(key, str) or isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise TypeError(f"grid[{key!r}]: expected a list of values, got {values!r}")
        out[key] = list(values)
        if not out[key]:
            raise TypeError(f"grid[{key!r}]: no values to sweep")
    return out


def _override_value(value: Any) -> str:
    """A Python value as the command line would write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{value!r}: a swept value must be finite")
    return str(value)
