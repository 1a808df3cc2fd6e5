"""A Hydra Launcher that runs each job of a sweep as one Ray task, on a Ray instance of its own (started
here, on this machine) or on an existing cluster (`address`).

Shaped as Hydra's joblib and submitit launchers are (hydra_plugins/hydra_joblib_launcher/_core.py,
`execute_job` and `launch`; hydra_submitit_launcher/submitit_launcher.py, `BaseSubmititLauncher.__call__`):
each job loads its own sweep config from its overrides, takes Hydra's singletons from the command, and runs
Hydra's `run_job`, which writes its folder and calls the callbacks where the job runs; the JobReturns come
back in the order of the jobs. This module imports Ray only when a sweep is launched: Hydra imports every
plugin module at start, and Ray is an optional extra.
"""
# (no `from __future__ import annotations`: Hydra executes plugin modules outside sys.modules, where a
# dataclass cannot resolve string annotations)

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


@dataclass
class RayLauncherConf:
    _target_: str = "hydra_plugins.testbed_ray_launcher.ray_launcher.RayLauncher"
    # null: a Ray instance of the sweep's own on this machine, ended with the sweep; "auto": the one running
    # here (`ray start --head`); "ray://head:10001": a cluster's
    address: Optional[str] = None
    # more keyword arguments of ray.init (num_cpus, include_dashboard, runtime_env, ...)
    init: Dict[str, Any] = field(default_factory=lambda: {"include_dashboard": False})
    # options of each job's task (ray.remote): num_cpus, num_gpus, memory, max_retries, ...
    remote: Dict[str, Any] = field(default_factory=lambda: {"num_cpus": 1, "max_retries": 0})


ConfigStore.instance().store(group="hydra/launcher", name="testbed_ray", node=RayLauncherConf, provider="testbed")


def execute_job(idx: int, overrides: Sequence[str], hydra_context: HydraContext, config: DictConfig,
                task_function: TaskFunction, singleton_state: Dict[Any, Any], cwd: str) -> JobReturn:
    """One job, in a Ray worker: the command's working directory where it exists here (a relative
    `hydra.sweep.dir` then means the same folder), its sweep config, then Hydra's run_job."""
    if os.path.isdir(cwd):
        os.chdir(cwd)
    setup_globals()
    Singleton.set_state(singleton_state)
    sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
    with open_dict(sweep_config):
        sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{idx}"
        sweep_config.hydra.job.num = idx
    HydraConfig.instance().set_config(sweep_config)
    return run_job(hydra_context=hydra_context, config=sweep_config, task_function=task_function,
                   job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")


class RayLauncher(Launcher):
    def __init__(self, address: Optional[str] = None, init: Optional[Dict[str, Any]] = None,
                 remote: Optional[Dict[str, Any]] = None) -> None:
        self.address = address
        self.init = _plain(init)
        self.remote = _plain(remote)
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.task_function, self.hydra_context = config, task_function, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        try:
            import ray
        except ImportError as e:
            raise ImportError("hydra/launcher=ray needs Ray: pip install -e '.[ray]' (or pip install 'ray>=2.9')") from e
        assert self.config is not None and self.task_function is not None and self.hydra_context is not None
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        started = not ray.is_initialized()
        if started:
            ray.init(address=self.address or None, **self.init)
        log.info("Ray (%s) is launching %d jobs, sweep output dir: %s",
                 self.address or "a local instance", len(job_overrides), sweep_dir)
        for idx, overrides in enumerate(job_overrides):
            log.info("\t#%d : %s", initial_job_idx + idx, " ".join(filter_overrides(overrides)))
        task = ray.remote(**self.remote)(execute_job) if self.remote else ray.remote(execute_job)
        state = Singleton.get_state()
        try:
            refs = [task.remote(initial_job_idx + idx, list(overrides), self.hydra_context, self.config,
                                self.task_function, state, os.getcwd())
                    for idx, overrides in enumerate(job_overrides)]
            runs = ray.get(refs)  # in the jobs' order, whatever order they finished in
        finally:
            if started and self.address is None:  # the sweep's own instance ends with it
                ray.shutdown()
        assert all(isinstance(run, JobReturn) for run in runs)
        return runs


def _plain(options: Any) -> Dict[str, Any]:
    """Hydra hands the config's dicts over as DictConfig; Ray wants plain values."""
    if options is None:
        return {}
    if isinstance(options, DictConfig):
        return OmegaConf.to_container(options, resolve=True)  # type: ignore[return-value]
    return dict(options)
