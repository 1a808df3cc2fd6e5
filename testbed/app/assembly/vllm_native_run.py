"""`policy=vllm_native` in the simulator: vLLM's own scheduler deciding, the cost model timing.

The run is prepared as any simulation's (trace, front end, cost model, KV blocks from the hardware) and
ends as any's (`finish()`: the same files and metrics); only the step loop is vLLM's
(testbed/vllm_backend/native_sim.py). vLLM is an optional extra: without it the run stops with
the install command.
"""
from __future__ import annotations

import time
from typing import Callable

from omegaconf import DictConfig, OmegaConf

from testbed.app.assembly.frontend import to_engine_queue
from testbed.app.assembly.run_setup import RunResult, Setup, async_scheduling, finish, prepare, progress_bar
from testbed.core.request import Request
from testbed.core.specs import ModelSpec
from testbed.core.event_run import gc_paused
from testbed.vllm_backend.native_sim import NativeSettings, NativeSimulation, VLLMNativeKnobs


def scheduler_settings(cfg: DictConfig, setup: Setup) -> NativeSettings:
    """vLLM's scheduler settings from the config: the knobs, scheduler.*, kv.*, and the KV blocks the
    hardware holds (`setup.device_blocks`, as the simulator sizes the cache for any policy)."""
    knobs = VLLMNativeKnobs(**OmegaConf.to_container(cfg.policy, resolve=True))
    lim = setup.limits
    return NativeSettings(num_blocks=setup.device_blocks, block_size=cfg.kv.block_size,
                          max_model_len=lim.max_model_len, max_num_seqs=lim.max_num_seqs,
                          max_num_batched_tokens=lim.max_num_batched_tokens,
                          enable_prefix_caching=cfg.kv.enable_prefix_caching,
                          async_scheduling=async_scheduling(cfg), knobs=knobs)


def native_simulation(cfg: DictConfig, setup: Setup, requests: list[Request], on_step=None,
                      progress=None) -> NativeSimulation:
    """The simulation of `requests` (the trace after the front end) with vLLM's scheduler built from the config."""
    return NativeSimulation(requests, scheduler_settings(cfg, setup), setup.cost.step_time, cfg.backend.horizon_s,
                            cfg.output.record_token_times, on_step, progress)


def simulate_native(cfg: DictConfig, stop: Callable[[], bool] | None = None, model: ModelSpec | None = None,
                    requests: list[Request] | None = None) -> RunResult:
    """Simulate the config's run with vLLM's own scheduler (`simulate()` sends policy=vllm_native here)."""
    t0 = time.perf_counter()
    setup = prepare(cfg, model=model, requests=requests)
    engine_requests, clock = to_engine_queue(setup.requests, setup.frontend)
    with progress_bar(cfg, engine_requests) as progress:
        sim = native_simulation(cfg, setup, engine_requests, progress=progress)
        with gc_paused():
            t_run = time.perf_counter()
            outcome = sim.run(stop)
            run_s = time.perf_counter() - t_run
            result = finish(cfg, setup, outcome, "sim", t0, clock)
    result.run_s = run_s
    import vllm

    result.summary.update(vllm_version=vllm.__version__, vllm_scheduler=type(sim.sched).__qualname__)
    return result
