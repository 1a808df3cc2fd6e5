"""From a resolved config to written results: the one path every entry point takes.

It prepares the run (`testbed.app.assembly.run_setup`: requests, cost model, KV blocks, policy), runs the chosen
backend (the simulator, one pool or disaggregated pools, or the engine on the wall clock), and turns what
the loop recorded into the per-request table and the summary.
"""
from __future__ import annotations

import platform
import time
from typing import Callable

import numpy as np
import pandas as pd
from omegaconf import DictConfig

from testbed.app.assembly.frontend import to_engine_queue
from testbed.app.assembly.run_setup import (RunResult, Setup, async_scheduling, build_router, check_memory, finish, log,
                                   prepare, progress_bar, resolve_model_spec)
from testbed.app.assembly.spec_decode import drafter_factory
from testbed.core.request import Request
from testbed.core.specs import ModelSpec
from testbed.sim.sessions import SESSION_REPLAYS, ClosedLoopSessions
from testbed.core.event_run import gc_paused
from testbed.sim.simulation import Simulation
from testbed.vllm_backend.native_sim import NATIVE_POLICY


def simulate(cfg: DictConfig, stop: Callable[[], bool] | None = None, model: ModelSpec | None = None,
             requests: list[Request] | None = None) -> RunResult:
    """Simulate the config's run; `stop()` turning true ends it early (interrupted) between steps.
    `model` and `requests` replace the config's model and trace (see `prepare`)."""
    t0 = time.perf_counter()
    if cfg.backend.name != "sim":
        raise ValueError(f"backend.name={cfg.backend.name!r}: simulate() runs backend=sim")
    if cfg.get("disagg") is not None and cfg.disagg.enabled:  # a prefill pool and a decode pool
        if cfg.trace.get("session_replay", "open") != "open":
            raise ValueError("trace.session_replay=closed: the disaggregated simulation (disagg.enabled=true) "
                             "replays open-loop only; use trace.session_replay=open")
        from testbed.app.assembly.disagg import simulate_disagg  # (here: a co-located run needs none of it)

        return simulate_disagg(cfg, stop, model, requests)
    if cfg.policy.name == NATIVE_POLICY:  # vLLM's own scheduler in simulated time
        from testbed.app.assembly.vllm_native_run import simulate_native

        return simulate_native(cfg, stop, model, requests)
    model = model or resolve_model_spec(cfg.model)
    check_memory(cfg, model, num_requests=None if requests is None else len(requests))  # before anything is built
    setup = prepare(cfg, model=model, requests=requests)
    check_memory(cfg, setup.model, [("backend.replicas", cfg.backend.replicas, setup.device_blocks)],
                 len(setup.requests))  # a file's requests, now counted
    engine_requests, clock = to_engine_queue(setup.requests, setup.frontend)  # the front end delays arrivals
    sessions = closed_loop_sessions(cfg, setup)
    with progress_bar(cfg, engine_requests) as progress:
        sim = Simulation(engine_requests, lambda: setup.make_loop(cfg), setup.cost, cfg.backend.replicas,
                         build_router(cfg), cfg.backend.horizon_s, cfg.backend.fast_forward, progress,
                         async_scheduling(cfg), sessions)
        with gc_paused():
            t_run = time.perf_counter()
            outcome = sim.run(stop)
            run_s = time.perf_counter() - t_run
            if sessions is not None:  # a turn's arrival is when it was released, not its timestamp
                clock.arrival_s.update((s.req.id, s.req.arrival) for loop in outcome.loops for s in loop.states)
                clock.arrival_s.update((r.id, r.arrival) for r in outcome.not_arrived)
            result = finish(cfg, setup, outcome, "sim", t0, clock)
    for loop in outcome.loops:  # done: freed as soon as the result is returned, not by the cyclic GC
        loop.view.close()
    result.run_s = run_s
    return result


def closed_loop_sessions(cfg: DictConfig, setup: Setup):
    """The turns to hold until their parents finish (trace.session_replay=closed), or None (open)."""
    mode = cfg.trace.get("session_replay", "open")
    if mode not in SESSION_REPLAYS:
        raise ValueError(f"trace.session_replay={mode!r}: expected one of {', '.join(SESSION_REPLAYS)}")
    if mode == "open":
        return None
    if not setup.frontend.is_off:
        raise ValueError(f"trace.session_replay=closed with frontend={setup.frontend.name}: a turn's release would "
                         f"need the front end's delays on both sides of the user; use frontend=none")
    return ClosedLoopSessions(setup.requests, cfg.trace.get("think_time_s"))


def replay_on_engine(cfg: DictConfig, stop: Callable[[], bool] | None = None) -> RunResult:
    """Replay the trace in real time on the engine (torch + transformers, paged KV); `stop()`
    turning true ends it early (interrupted) between steps."""
    from testbed.engine.setup import build_engine

    t0 = time.perf_counter()
    if drafter_factory(cfg) is not None:  # check_config refuses it first; a direct call must too
        raise ValueError(f"spec_decode.method={cfg.spec_decode.method}: speculative decoding is the simulator's only")
    spec = resolve_model_spec(cfg.model)
    engine = build_engine(cfg, spec, threads=True)
    setup = prepare(cfg, model=engine.spec, device_blocks=engine.num_blocks)
    replay = engine.replay(setup.requests, setup.make_loop(cfg, engine.num_blocks), cfg.backend.horizon_s, cfg.seed)
    log.info("engine ready on %s (%d KV blocks): replaying %d requests on the wall clock",
             engine.device_name, engine.num_blocks, len(setup.requests))
    result = finish(cfg, setup, replay.run(stop), "engine", t0)
    result.summary.update(device=engine.device_name, dtype=str(engine.dtype).removeprefix("torch."))
    if engine.cpu_threads is not None:  # the step times depend on them (backend.threads)
        result.summary["cpu_threads"] = engine.cpu_threads
    return result


def run_info(result: RunResult) -> dict:
    """What varies between two runs of one config, the testbed's commit among it (a report's header names it)."""
    import simpy

    from testbed.engine.machine import testbed_commit

    return {"wall_s": result.wall_s, "run_s": result.run_s, "python": platform.python_version(), "simpy": simpy.__version__,
            "numpy": np.__version__, "pandas": pd.__version__, "host": platform.node(), "commit": testbed_commit()}
