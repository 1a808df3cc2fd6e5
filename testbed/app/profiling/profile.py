"""`testbed-profile`: profile the engine over a grid of batch shapes and fit a cost model to it.

Usage:
    testbed-profile model=tiny_llama backend.device=cpu profile.grid=quick profile.threads=1 \
        profile.out=testbed/profiles/cpu_tiny_llama.csv      # the CPU profile shipped in testbed/profiles/
    testbed-profile model=llama3_8b profile.grid=full profile.out=profiles/h100_llama3_8b.csv
    testbed-profile backend=vllm ... trace.start_s=600   # real vLLM: fitted from a calibration replay
(`python -m testbed.app.profiling.profile ...` is the same; `backend=vllm` is `testbed.app.profiling.vllm_profile`.) The grid and the file format are described in
`testbed.engine.profile`; this module adds the host-share points (the step loop with a policy, no
model), which need a policy and so belong to the application.
"""
from __future__ import annotations

import os
import sys
import time
from array import array
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import hydra
import numpy as np
from omegaconf import DictConfig

from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.frontend import without_frontend
from testbed.app.assembly.plugins import make_policy
from testbed.app.assembly.validate import check_config
from testbed.core.cost import BatchShape
from testbed.core.kv import BlockManager
from testbed.core.loop import SchedulerLimits, StepLoop
from testbed.core.request import Request, RequestState
from testbed.engine.machine import system_busy_s
from testbed.engine.profile import _measure, grid_points, header_of, time_point, write_profile
from testbed.engine.profile_config import ProfileConfig, resolve


def time_host(policy_name: str, knobs: dict, n: int, limits: SchedulerLimits, block_size: int,
              pc: ProfileConfig, retries: int, prompt: int = 0, prefix_caching: bool = False) -> tuple[BatchShape, dict]:
    """The step loop's cost per step with N running decodes: `plan` (the policy, validation, KV
    allocation, the batch shape) + the replay's token bookkeeping + `complete`; no model.

    With `prompt` > 0, a request of that many prompt tokens also arrives before every step and is
    admitted and prefilled in it (its first token is its last, so it leaves in `complete`): the
    host work a replay's prefill steps add (the arrival, the admission's KV allocation and, with
    prefix caching, its block keys, the prompt's token list, the finish), which decode rows lack."""
    repeats, warmup = max(pc.repeats, 20), max(pc.warmup, 5)
    out_len = (warmup + 10 * repeats) * (1 + retries) + 8  # nobody finishes while timed
    blocks = n * -(-(16 + out_len) // block_size) + 2 * -(-prompt // block_size) + 8
    limits = SchedulerLimits(max(limits.max_num_batched_tokens, 16 * n, prompt + n), max(limits.max_num_seqs, n + 1),
                             max(limits.max_model_len, 16 + out_len, prompt + 1))
    loop = StepLoop(make_policy(policy_name, **knobs), BlockManager(blocks, block_size, prefix_caching), limits)
    tokens = {}
    for i in range(n):
        loop.arrive(Request(i, 0.0, 16, out_len), 0.0)
        tokens[i] = [1] * 16
    clock = [0.0]
    while len(loop.running) < n or not all(s.num_generated for s in loop.running):  # prefill everyone
        batch = loop.plan(clock[0])
        clock[0] += 1e-3
        loop.complete(batch, clock[0])
    items = [(s, 1) for s in loop.running]
    if prompt:
        probe = RequestState(Request(-1, 0.0, prompt, 1))
        items.append((probe, prompt))
    shape = loop.shape_of(items)
    drawn = array("i", [1] * prompt)  # a prompt's token ids as the replay holds them until its arrival
    next_id = [n]

    def step():
        if prompt:
            rid = next_id[0]
            next_id[0] += 1
            loop.arrive(Request(rid, clock[0], prompt, 1), clock[0])
            tokens[rid] = drawn.tolist()
        batch = loop.plan(clock[0])
        sampled = {s.req.id: 7 for s, k in batch.items}  # what execute() hands back
        for rid, tok in sampled.items():
            tokens[rid].append(tok)
        clock[0] += 1e-3
        loop.complete(batch, clock[0])
        if prompt:
            tokens.pop(next_id[0] - 1)  # finished: the replay moves its tokens to the results
        if batch.shape.num_decode_seqs != n or batch.shape.num_prefill_tokens != prompt:
            raise RuntimeError(f"host profile: the {policy_name} policy ran {batch.shape.num_decode_seqs} of {n} decodes "
                               f"and {batch.shape.num_prefill_tokens} of {prompt} prompt tokens")

    return shape, _measure(step, repeats, warmup, pc.min_time_s, retries)


def run_profile(cfg: DictConfig, out: str | Path | None = None, stop: Callable[[], bool] | None = None) -> Path:
    """Profile the engine the config describes (model, device, dtype, block size) over `cfg.profile`'s
    grid and write the profile file; returns its path."""
    import torch

    from testbed.engine.setup import build_engine
    from testbed.app.assembly.run_setup import resolve_model_spec

    pc = resolve(cfg.get("profile"))
    if pc.threads:
        torch.set_num_threads(pc.threads)
    engine = build_engine(cfg, resolve_model_spec(cfg.model))
    spec, runner = engine.spec, engine.runner
    bs = cfg.kv.block_size
    max_len = cfg.scheduler.max_model_len or spec.max_model_len
    points, skipped = grid_points(pc, max_len, engine.num_blocks, bs)
    kv = BlockManager(engine.num_blocks, bs, enable_prefix_caching=False)
    limits = SchedulerLimits(cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs, max_len)

    shape_loop = StepLoop(make_policy("vllm"), kv, limits)  # only for its BatchShape arithmetic
    knobs = {}
    if cfg.policy.name == pc.host_policy:
        knobs = {k: v for k, v in dict(cfg.policy).items() if k != "name"}
    show = pc.progress
    if show is None:
        show = sys.stderr.isatty() and not os.environ.get("CI")
    from tqdm import tqdm

    retries = pc.retries if engine.device.type == "cpu" else 0  # CPU time says nothing of a GPU's
    # Measured in a shuffled (seeded) order, so that a slow spell of the machine spreads over the
    # grid instead of biasing one region of it; written in grid order.
    order = np.random.default_rng(cfg.seed).permutation(len(points))
    rows: list[dict | None] = [None] * len(points)
    b0, c0, t0 = system_busy_s(), time.process_time(), time.perf_counter()
    for i in tqdm(order, desc=f"profile {spec.name} on {engine.device_name}", unit="pt", disable=not show,
                  leave=False):
        if stop is not None and stop():  # a signal (app/entry/stop.py) ends the grid between points: those measured are written
            break
        p = points[i]
        if p.kind == "host":
            prompt = sum(c for c, _ in p.chunks)
            shape, m = time_host(pc.host_policy, knobs, p.decode_batch, limits, bs, pc, retries, prompt,
                                 bool(cfg.kv.enable_prefix_caching))
        else:
            shape, m = time_point(runner, kv, shape_loop.shape_of, p, pc, spec.vocab_size, retries)
        if engine.device.type != "cpu":
            m["cpu_s"], m["contended"] = float("nan"), 0
        rows[i] = {"kind": p.kind, **asdict(shape), **m}
    interrupted = any(r is None for r in rows)
    rows = [r for r in rows if r is not None]
    header = header_of(engine, cfg, pc, len(rows), skipped)
    if interrupted:
        header["interrupted"] = f"{len(rows)} of {len(points)} points measured"
    header["contended_points"] = sum(r["contended"] for r in rows)
    wall, b1 = time.perf_counter() - t0, system_busy_s()
    header["wall_s"] = round(wall, 1)
    if b0 is not None and b1 is not None:  # cores other processes kept busy meanwhile (engine/machine.py)
        header["others_cores"] = round(max(0.0, b1 - b0 - (time.process_time() - c0)) / wall, 2)
    path = Path(out or pc.out or Path(cfg.output.dir) / "profile.csv")
    return write_profile(path, header, rows)


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> str:
    from testbed.sim.fitted_cost import ProfileCostModel, read_profile

    cfg = without_frontend(cfg, "testbed-profile")  # it measures steps: no HTTP front end on either backend
    if cfg.backend.name == "vllm":  # real vLLM: step records of a calibration replay (app/profiling/vllm_profile.py)
        from testbed.app.profiling.vllm_profile import run_vllm_profile

        check_config(cfg)
        path = run_vllm_profile(cfg)
    else:
        from testbed.app.entry.stop import stop_on_signals

        check_config(cfg, backend="engine")  # it profiles the engine, whatever backend.name says
        with stop_on_signals() as stop:  # a signal ends the grid between points; the points measured are written
            path = run_profile(cfg, stop=stop)
    header, _ = read_profile(path)
    if "interrupted" in header:
        print(f"profile: {path}  (interrupted: {header['interrupted']}; no cost model fitted)")
        return str(path)
    beside = f", other processes busy on {header['others_cores']} cores meanwhile" if "others_cores" in header else ""
    print(f"profile: {path}  ({header.get('points')} points in {header.get('wall_s')} s, "
          f"{header.get('contended_points')} disturbed by other processes{beside})")
    try:
        fit = ProfileCostModel.from_file(path)
    except ValueError as e:
        print(f"no cost model fitted: {e}")
    else:
        h = fit.holdout
        print(f"fitted cost model {fit.name}: held-out error (every {fit.holdout_every}th row, {h['rows']} rows) "
              f"median {h['median_ape']:.1%}, p95 {h['p95_ape']:.1%}; use it with "
              f"cost_model=profile cost_model.profile={path}")
    return str(path)


if __name__ == "__main__":
    main()
