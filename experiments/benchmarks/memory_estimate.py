"""Where a simulation's memory goes: the constants of `testbed.app.assembly.memory_budget`, measured.

Usage: python experiments/benchmarks/memory_estimate.py

tracemalloc counts the bytes Python allocates (objects, lists, dicts, numpy and pandas buffers), so each figure
is what the interpreter holds, not the allocator's slack; each is a slope between two sizes, so fixed costs
(modules, the cost model, the trace's file cache) drop out:

* per KV block: one replica's `BlockManager` at 20,000 and 200,000 blocks (its free queue, reference counts
  and cache tags are per block);
* per replica, past its KV blocks: `Setup.make_loop` (loop, policy, KV manager) at kv.num_blocks=16, 1, 10
  and 100 replicas;
* per replica in a whole run: a `Simulation` (its per-replica processes and the router's state with the
  loops) at kv.num_blocks=16, 10 and 200 replicas;
* per request: the peak of a whole `simulate` (the requests' states, the per-request table, the step
  series, summary) of the Azure conversation trace's first 250 and 2,000 requests, given as built (so the
  trace file's load drops out), one replica, steps recorded; plus one `Request` as a trace holds it.
"""
from __future__ import annotations

import dataclasses
import gc
import tracemalloc

from hydra import compose, initialize_config_dir

from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.run import simulate
from testbed.app.assembly.run_setup import build_requests, build_router, prepare
from testbed.sim.simulation import Simulation
from testbed.core.kv import BlockManager

BASE = ["logger=none", "output.progress=false", "cost_model=roofline"]


def cfg_for(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[*BASE, *overrides])


def held(build) -> tuple[int, object]:
    """Bytes still allocated after `build()` returns (what it holds), and its result."""
    gc.collect()
    tracemalloc.start()
    obj = build()
    cur, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return cur, obj


def peak(run) -> int:
    gc.collect()
    tracemalloc.start()
    run()
    _, top = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return top


def main() -> None:
    small, large = 20_000, 200_000
    a, _ = held(lambda: BlockManager(small, 16))
    b, _ = held(lambda: BlockManager(large, 16))
    per_block = (b - a) / (large - small)
    print(f"KV block: {per_block:.1f} B ({a} B at {small} blocks, {b} B at {large})")
    cfg = cfg_for("kv.num_blocks=16", "trace.max_requests=10")
    setup = prepare(cfg)
    for n in (1, 10, 100):
        total, _ = held(lambda: [setup.make_loop(cfg) for _ in range(n)])
        print(f"replica (16 KV blocks), {n} replicas: {total / n:,.0f} B each, "
              f"{total / n - 16 * per_block:,.0f} B past its blocks")
    few, many = 10, 200
    sims = {n: held(lambda: Simulation(setup.requests, lambda: setup.make_loop(cfg), setup.cost, n, build_router(cfg)))[0]
            for n in (few, many)}
    print(f"replica in a Simulation (16 KV blocks): {(sims[many] - sims[few]) / (many - few):,.0f} B "
          f"({sims[few]:,} B at {few}, {sims[many]:,} B at {many})")
    low, high = 250, 2000
    run = cfg_for(f"trace.max_requests={high}")
    reqs, _ = build_requests(run.trace, run.seed)
    objs = {n: held(lambda: [dataclasses.replace(r) for r in reqs[:n]])[0] for n in (low, high)}
    print(f"Request object: {(objs[high] - objs[low]) / (high - low):,.0f} B")
    p = {n: peak(lambda: simulate(run, requests=reqs[:n])) for n in (low, high)}
    print(f"request in a run: {(p[high] - p[low]) / (high - low):,.0f} B (peak {p[low]:,} B at {low}, "
          f"{p[high]:,} B at {high})")

if __name__ == "__main__":
    main()
