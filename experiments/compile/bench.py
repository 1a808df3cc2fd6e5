"""Is the compiled build faster? Time the main command's simulation in source trees, alternating.

Usage:
    python experiments/compile/bench.py TREE [TREE ...] [--rounds 3] [-- hydra overrides...]

Each TREE is a checkout (one pure, one built with `TESTBED_COMPILE=cython python setup.py build_ext
--inplace`, ...). Every round runs each tree once, in its own process with PYTHONPATH=TREE, so the
machine's load drifts over all trees alike; the figure is the CPU time of `Simulation.run` alone (no
trace loading, no metrics) and the ratio of each tree to the first, round by round.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def time_simulation(overrides: list[str]) -> dict:
    """Run the main command's simulation once in this process; its seconds and what was compiled."""
    from hydra import compose, initialize_config_dir

    from testbed.app.assembly import run
    from testbed.app.entry.cli import CONF_DIR
    from testbed.sim import simulation

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", "output.progress=false", *overrides])
    setup = run.prepare(cfg)
    engine_requests, _ = run.to_engine_queue(setup.requests, setup.frontend)
    sim = simulation.Simulation(engine_requests, lambda: setup.make_loop(cfg), setup.cost, cfg.backend.replicas,
                                run.build_router(cfg), cfg.backend.horizon_s, cfg.backend.fast_forward, None,
                                run.async_scheduling(cfg), None)
    with run.gc_paused():
        t0, c0 = time.perf_counter(), time.process_time()
        outcome = sim.run(None)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    compiled = sorted(name for name, m in sys.modules.items()
                      if name.startswith("testbed.") and (getattr(m, "__file__", "") or "").endswith(".so"))
    return {"seconds": seconds, "cpu": cpu, "steps": sum(loop.num_steps for loop in outcome.loops), "compiled": compiled}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trees", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: time this process's tree
    args, overrides = ap.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    if args.one:
        print(json.dumps(time_simulation(overrides)))
        return
    seconds: dict[str, list[float]] = {t: [] for t in args.trees}  # CPU seconds: the 2 shared cores make wall noisy
    for r in range(args.rounds):
        for tree in args.trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS="1")
            out = subprocess.run([sys.executable, os.path.abspath(__file__), tree, "--one", *overrides], env=env,
                                 cwd=tree, check=True, capture_output=True, text=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            seconds[tree].append(got["cpu"])
            print(f"round {r + 1} {tree}: {got['cpu']:.2f} s CPU ({got['seconds']:.2f} s wall), {got['steps']} steps, "
                  f"{len(got['compiled'])} compiled modules", flush=True)
    base = seconds[args.trees[0]]
    for tree in args.trees:
        ratios = [b / s for b, s in zip(base, seconds[tree])]
        print(f"{tree}: median {statistics.median(seconds[tree]):.2f} s CPU; speed-up vs {args.trees[0]} "
              f"per round {' '.join(f'{x:.2f}x' for x in ratios)} (median {statistics.median(ratios):.2f}x)")


if __name__ == "__main__":
    main()
