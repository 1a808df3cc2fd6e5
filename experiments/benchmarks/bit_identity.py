"""Prove a speed change left every result bit-identical, on the whole traces.

Usage:
    python experiments/benchmarks/bit_identity.py --record hashes.json [--max-requests N] [--only SUBSTR ...]
    python experiments/benchmarks/bit_identity.py --check experiments/benchmarks/bit_identity.json

Runs each of `testbed.app.analysis.fingerprint.identity_configs` (every policy at 1x and 4x, sixteen replicas at
16x, Mooncake with prefix ids, sessions, disaggregation, ...) and hashes its summary, per-request and
per-step tables (`testbed.app.analysis.fingerprint`). `--record` writes the hashes; `--check` recomputes them
and exits 1 naming every configuration and table that differs. The committed
`bit_identity.json` was re-recorded on 2026-11-28 (at 6bbd355): against the record before it (cfdf3f3's
hashes, kernels_70b_tp4 re-recorded at 8dfc14e) every request and step table was the same but
mooncake_sglang's, which issue 24's SGLang radix eviction (8053899, matching SGLang's scheduler step by
step) moved on purpose (bisected at 3,000 requests: 8dfc14e differs, 3866720 and 9108ebc agree), and 40
summaries moved with the SLO check's rule (a2f94a9: requests longer than the context left out; on edf_1x,
run at both commits, `slo_checks` and `slo_pass` are the only keys that differ).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

from hydra import compose, initialize_config_dir

from testbed.app.entry.cli import CONF_DIR
from testbed.app.analysis.fingerprint import identity_configs, result_hashes
from testbed.app.assembly.run import simulate


def run_hashes(overrides: list[str]) -> dict[str, str]:
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["logger=none", "output.progress=false", *overrides])
    r = simulate(cfg)
    return result_hashes(r.summary, r.requests, r.steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", metavar="FILE")
    mode.add_argument("--check", metavar="FILE")
    ap.add_argument("--max-requests", type=int, default=None, help="cut every trace (default: whole traces)")
    ap.add_argument("--only", nargs="*", default=[], help="run only configurations whose name contains one of these")
    args = ap.parse_args()
    configs = identity_configs(tempfile.mkdtemp(prefix="bit_identity_"), args.max_requests)
    if args.only:
        configs = {n: o for n, o in configs.items() if any(x in n for x in args.only)}
    expected = json.load(open(args.check)) if args.check else {}
    got, bad = {}, []
    for name, overrides in configs.items():
        t0 = time.perf_counter()
        got[name] = run_hashes(overrides)
        diff = [k for k, v in got[name].items() if name in expected and expected[name].get(k) != v]
        missing = args.check and name not in expected
        status = "no reference" if missing else ("DIFFERS: " + ", ".join(diff)) if diff else "ok"
        if diff:
            bad.append(name)
        print(f"{name:40s} {time.perf_counter() - t0:7.1f} s  {status}", flush=True)
    if args.record:
        with open(args.record, "w") as f:
            json.dump(got, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"recorded {len(got)} configurations in {args.record}")
    elif bad:
        print(f"{len(bad)} of {len(got)} configurations differ: {' '.join(bad)}")
        sys.exit(1)
    else:
        print(f"all {len(got)} configurations bit-identical")


if __name__ == "__main__":
    main()
