"""PLACEHOLDER until the api helper's testbed/api.py is merged: the four names of the Python API
contract with their signatures and docstrings, so that the docs' API reference builds. Every call
raises NotImplementedError.

Runs and sweeps from Python take the command line's override strings, so a study written as a script
and one written as shell commands are the same configuration, validated by the same rules.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration the command line would refuse (an unknown key, a value out of its range), with
    the command line's one-line message: scripts fail on the same rules as commands."""


class Results:
    """One run's results, as the files of a run folder hold them.

    Attributes:
        requests: one row per request (pandas DataFrame; the columns of `requests.parquet`).
        steps: one row per engine step (may be empty).
        replicas: the per-replica table.
        summary: the run's summary metrics, the keys of `summary.json`.
        config: the resolved OmegaConf DictConfig.
        output_dir: where the files were written, or None.
    """

    requests: Any
    steps: Any
    replicas: Any
    summary: dict
    config: Any
    output_dir: Path | None


def simulate(overrides: list[str] | None = None, *, config_name: str = "config",
             output_dir: str | Path | None = None, quiet: bool = True) -> Results:
    """Run one simulation from the CLI's override strings, e.g. `["policy=sarathi", "trace.rate_scale=2"]`.

    Composes the same config groups as `testbed-sim` and applies the same validation: an unknown key
    such as `+scheduler.max_num_seq=10` raises `ConfigError` with the CLI's message. Writes files only
    when `output_dir` is given.
    """
    raise NotImplementedError("testbed.api is a placeholder on this branch")


def sweep(grid: dict[str, list], *, overrides: list[str] | None = None, output_dir: str | Path | None = None,
          n_jobs: int = 1):
    """Run the cartesian product of `grid` (override key -> values), one row per job.

    Returns a pandas DataFrame whose columns are the swept keys and the summary metrics, the columns
    of the CLI sweep's `sweep_summary.csv` where they overlap.
    """
    raise NotImplementedError("testbed.api is a placeholder on this branch")


def load(path: str | Path):
    """Read saved results: a run folder gives `Results`, a sweep folder gives the sweep table."""
    raise NotImplementedError("testbed.api is a placeholder on this branch")
