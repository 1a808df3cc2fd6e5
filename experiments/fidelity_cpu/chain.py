"""The engine fidelity chain as a benchmark: profile this machine now, replay 100 Azure conv requests on
the engine and in the simulator calibrated from that fresh profile, and print each latency's error
against the targets (issue 23: every p50 within 5%, every p99 within 10%).

    python experiments/fidelity_cpu/chain.py [out_dir] [--repeats N]

Wall-clock latencies measure the machine as much as the simulator (on this shared 2-core machine the
same decode step took 2.4-4.4 ms between runs), so these bounds live here, printed, and not in a unit
test (tests/test_calibration.py checks the chain's structure, the engine's decisions against the simulator's
on the cost model's clock, and a 3x broken-chain bound on each step's CPU time). Each
repeat is a fresh profile + replay; the replay's share of its core is printed beside its errors.
"""
from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pandas as pd

TARGETS = {"median": 0.05, "p99": 0.10}
TRACE = ["trace.max_requests=100", "trace.rate_scale=20", "trace.max_prompt_len=256", "trace.max_output_len=32"]
BASE = ["model=tiny_llama", "backend.device=cpu", "profile.threads=1"]


def chain(out: Path) -> pd.DataFrame:
    out.mkdir(parents=True, exist_ok=True)
    profile = out / "profile.csv"
    subprocess.run(["testbed-profile", *BASE, f"profile.out={profile}"], check=True)
    subprocess.run(["testbed-fidelity", *BASE, "cost_model=profile", f"cost_model.profile={profile}", *TRACE,
                    f"hydra.run.dir={out / 'fidelity'}"], check=True)
    return pd.read_csv(out / "fidelity" / "fidelity.csv")


def verdict(table: pd.DataFrame) -> pd.DataFrame:
    t = table[["key", "real", "sim", "rel_error"]].copy()
    t["target"] = t.key.map(lambda k: next((v for p, v in TARGETS.items() if k.startswith(p)), None))
    t["within"] = [None if pd.isna(b) else abs(e) < b for e, b in zip(t.rel_error, t.target)]
    return t


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="fidelity_chain")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    for i in range(args.repeats):
        run = Path(args.out) / f"run{i}"
        t = verdict(chain(run))
        steps = pd.read_csv(run / "fidelity" / "steps.csv")
        print(f"\n# repeat {i}: {run}  ({len(steps)} steps)")
        print(t.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
        held = t.dropna(subset=["target"])
        print(f"within target: {int(held.within.sum())} of {len(held)} latencies")


if __name__ == "__main__":
    main()
