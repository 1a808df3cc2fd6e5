"""How fast the simulator replays a whole production trace (issue target: < 5 s on 2 cores).

Usage: python experiments/benchmarks/sim_speed.py [--repeats 3] [--policy vllm] [--trace azure_conv] [overrides...]
Prints, per repeat, the wall time of the whole run (trace load, simulation, metrics) and of
the simulation alone, and simulated requests and engine steps per wall-clock second.
"""
from __future__ import annotations

import argparse
import platform
import time

from hydra import compose, initialize_config_dir

from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.run import simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policy", default="vllm")
    ap.add_argument("--trace", default="azure_conv")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. backend.fast_forward=false")
    args = ap.parse_args()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"policy={args.policy}", f"trace={args.trace}", *args.overrides])
    print(f"{platform.processor() or platform.machine()}, python {platform.python_version()}; "
          f"policy={args.policy} trace={args.trace} {' '.join(args.overrides)}")
    for i in range(args.repeats):
        t0 = time.perf_counter()
        r = simulate(cfg)
        wall = time.perf_counter() - t0
        s = r.summary
        print(f"run {i + 1}: {s['num_requests']} requests ({s['completed']} finished), {s['num_steps']} engine steps "
              f"in {s['num_events']} events, {s['duration_s']:.0f} s simulated | wall {wall:.2f} s "
              f"-> {s['num_requests'] / wall:,.0f} requests/s, {s['num_steps'] / wall:,.0f} steps/s")


if __name__ == "__main__":
    main()
