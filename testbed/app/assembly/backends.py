"""A checked config's run on its backend: the one call both doors make.

`testbed-sim` (testbed/app/entry/cli.py) composes the config with Hydra, checks it
(`testbed.app.assembly.validate.check_config`), then calls `run` and writes what it returns
(`testbed.app.analysis.results.write_results`); the Python API composes and checks the same way and
calls the same `run`. Here, above the backends' modules, so that the simulator's (`run.py`) never
imports the vLLM replay, which builds on it.
"""
from __future__ import annotations

from typing import Callable

from omegaconf import DictConfig

from testbed.app.assembly.run_setup import RunResult


def run(cfg: DictConfig, stop: Callable[[], bool] | None = None) -> RunResult:
    """The run on `backend.name`'s backend; `stop()` turning true ends it at the next step's end."""
    from testbed.app.assembly.run import replay_on_engine, simulate

    if cfg.backend.name == "sim":
        return simulate(cfg, stop)
    if cfg.backend.name == "engine":
        return replay_on_engine(cfg, stop)
    if cfg.backend.name == "vllm":
        from testbed.app.assembly.vllm_run import replay_on_vllm

        return replay_on_vllm(cfg, stop)
    raise ValueError(f"backend.name={cfg.backend.name!r}: expected sim, engine or vllm")
