"""A cluster-sized run on this machine: the whole Azure conv trace on 16 replicas at 16x load.

Usage: python experiments/benchmarks/cluster_speed.py [--replicas 16] [--rate-scale 16] [--router NAME ...] [overrides...]
For each router (default: every registered one) prints the wall and CPU seconds of the whole
run (trace load, simulation, metrics), the simulated requests per wall-clock second, the peak
memory of the process so far, and the accounting: every trace row finished, rejected (with its
reason) or unfinished, their sum checked against the trace's rows.
"""
from __future__ import annotations

import argparse
import platform
import resource
import time

from hydra import compose, initialize_config_dir

from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.plugins import load_routers
from testbed.app.assembly.run import simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--rate-scale", type=float, default=16.0)
    ap.add_argument("--trace", default="azure_conv")
    ap.add_argument("--router", nargs="*", help="routers to time (default: every registered one)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. policy=sarathi")
    args = ap.parse_args()
    routers = args.router or sorted(load_routers())
    print(f"{platform.processor() or platform.machine()}, python {platform.python_version()}; trace={args.trace} "
          f"replicas={args.replicas} rate_scale={args.rate_scale} {' '.join(args.overrides)}")
    print("| router | requests | finished | rejected | unfinished | engine steps | wall s | CPU s | requests/s (wall) "
          "| peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in routers:
        with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
            cfg = compose("config", overrides=[f"trace={args.trace}", f"backend.replicas={args.replicas}",
                                               f"trace.rate_scale={args.rate_scale}", f"router={name}",
                                               *args.overrides])
        t0, c0 = time.perf_counter(), time.process_time()
        r = simulate(cfg)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = r.summary
        outcomes = r.requests.outcome.value_counts()
        done, rejected, unfinished = (int(outcomes.get(k, 0)) for k in ("finished", "rejected", "unfinished"))
        if done + rejected + unfinished != s["num_requests"] or r.requests.id.duplicated().any():
            raise SystemExit(f"router={name}: accounting broke: {done} + {rejected} + {unfinished} outcomes "
                             f"for {s['num_requests']} rows")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"| {name} | {s['num_requests']} | {done} | {rejected} | {unfinished} | {s['num_steps']} | {wall:.1f} "
              f"| {cpu:.1f} | {s['num_requests'] / wall:,.0f} | {peak:.0f} |", flush=True)


if __name__ == "__main__":
    main()
