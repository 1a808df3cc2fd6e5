"""Issue 25's acceptance, on the wall clock: every console script, sent SIGINT at 3 s and at 15 s, exits
130 with what it had; sent SIGTERM at 3 s, exits 143; no process of its session outlives it.

The unit tests (tests/test_signals.py, tests/test_robust_runs.py) signal at events, never after a delay,
so that they hold on a busy machine; this script is the user's view, with fixed delays, and prints a
table. SIGINT goes to the command's process group, as a terminal's Ctrl-C does; SIGTERM to its process
alone, as `kill` or a batch system's time limit does. A command that finished before its signal says
so (exit 0). Run from the repository root:

    python experiments/signals/at_3s_and_15s.py [--vllm-python PATH]   # PATH: a python with vLLM, for the referee
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT.parent / "shared/calibration/vllm_h100_runs"  # the real H100 runs beside the checkout
RUNS2 = ROOT.parent / "shared/calibration/blis_trainval_runs"


def workloads(tmp: Path, vllm_python: str | None) -> dict[str, list[str]]:
    """Per console script, a job that runs well past 15 s here (a whole trace, a search, a profile)."""
    py = [sys.executable, "-c"]

    def script(name: str, module: str, function: str, *args: str, python: list[str] = py) -> list[str]:
        return [*python, f"import sys; sys.argv[0] = {name!r}; from {module} import {function}; sys.exit({function}())",
                *args]

    sweep = tmp / "sweep_for_report"
    jobs = {
        "testbed-sim": script("testbed-sim", "testbed.app.entry.commands", "sim", "trace.rate_scale=4"),
        "testbed-sim -m (sweep)": script("testbed-sim", "testbed.app.entry.commands", "sim", "-m",
                                         "policy=vllm,sarathi,static", "trace.rate_scale=4",
                                         "hydra/launcher=local_parallel"),
        "testbed-capacity": script("testbed-capacity", "testbed.app.entry.commands", "capacity"),
        "testbed-disagg-search": script("testbed-disagg-search", "testbed.app.entry.commands", "disagg_search"),
        "testbed-profile": script("testbed-profile", "testbed.app.entry.commands", "profile", "model=tiny_llama",
                                  "backend.device=cpu"),
        "testbed-fidelity": script("testbed-fidelity", "testbed.app.entry.commands", "fidelity", "model=tiny_llama",
                                   "backend.device=cpu"),
        "testbed-validate": script("testbed-validate", "testbed.app.entry.commands", "validate", f"validate.runs=[{RUNS},{RUNS2}]"),
        "testbed-traces": script("testbed-traces", "testbed.app.entry.commands", "traces", "describe", "-m",
                                 "trace=azure_conv,azure_code", "trace.rate_scale=1,2,4"),
        "testbed-report": script("testbed-report", "testbed.app.entry.commands", "report", str(sweep)),
    }
    if vllm_python:
        jobs["testbed-referee (native)"] = script("testbed-referee", "testbed.app.entry.commands", "referee",
                                                  "referee.reference=vllm_native", python=[vllm_python, "-c"])
        jobs["testbed-referee (real)"] = script(  # real vLLM running a tiny model on this CPU
            "testbed-referee", "testbed.app.entry.commands", "referee", "model=tiny_llama", "model.head_dim=32",
            "trace.max_requests=400", "trace.max_prompt_len=512", "trace.max_output_len=48",
            "scheduler.max_model_len=1024", python=[vllm_python, "-c"])
    return jobs


def run_once(cmd: list[str], sig: int, at: float, cwd: Path) -> tuple[str, int | None, float, int]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=at)
        return "finished first", proc.returncode, time.monotonic() - started, 0
    except subprocess.TimeoutExpired:
        pass
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # a terminal's Ctrl-C: the foreground process group
    else:
        proc.send_signal(sig)  # kill PID
    try:
        out, _ = proc.communicate(timeout=300)  # to EOF: every process holding its output has ended
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return "hung", None, time.monotonic() - started, -1
    deadline = time.monotonic() + 5  # a killed process leaves /proc a moment after it closed its output
    while _session_left(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = _session_left(proc.pid)
    if left:
        for pid in _session_pids(proc.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
            except OSError:
                continue
            print(f"  left 5 s after: {pid} {cmd}", flush=True)
    text = out.decode(errors="replace")
    kept = "Traceback" not in text
    if not kept:
        print(text[text.index("Traceback"):][-3000:], flush=True)
    return ("clean" if kept else "traceback"), proc.returncode, time.monotonic() - started, left


def _kept(cwd: Path) -> str:
    """What the command left: its result files (Hydra's own .hydra and logs aside), and whether a summary says interrupted."""
    files = [p for p in cwd.rglob("*") if p.is_file() and ".hydra" not in p.parts and p.suffix != ".log"]
    marked = sum("interrupted" in p.read_text(errors="replace") for p in files if p.suffix in (".json", ".csv", ".md"))
    return f"{len(files)} files kept, {marked} saying interrupted"


def _session_pids(sid: int) -> list[int]:
    """The live processes of session `sid` (every descendant that did not start a session of its own)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _session_left(sid: int) -> int:
    return len(_session_pids(sid))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python")
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-m", "testbed", "-m", "policy=vllm,static", "trace.max_requests=200",
                        f"hydra.sweep.dir={tmp / 'sweep_for_report'}"], cwd=tmp, env=env, capture_output=True)
        print(f"{'command':26} {'signal':8} {'at':>4} {'outcome':15} {'exit':>5} {'ended at':>9} {'left 5s':>7}  kept")
        for i, (name, cmd) in enumerate(workloads(tmp, args.vllm_python).items()):
            if args.only and name not in args.only:
                continue
            for sig, at in ((signal.SIGINT, 3.0), (signal.SIGINT, 15.0), (signal.SIGTERM, 3.0)):
                cwd = tmp / f"{i}_{name.split()[0]}_{sig.name}_{at:g}"
                cwd.mkdir()
                outcome, code, ended, left = run_once(cmd, sig, at, cwd)
                print(f"{name:26} {sig.name:8} {at:4g} {outcome:15} {code!s:>5} {ended:8.1f}s {left:7d}  "
                      f"{_kept(cwd)}", flush=True)


if __name__ == "__main__":
    main()
