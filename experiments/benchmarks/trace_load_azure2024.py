"""Bounded-memory load of a week-scale Azure 2024 trace: time and peak memory, whole file and a window.

Usage: python experiments/benchmarks/trace_load_azure2024.py [--rows 10000000] [--window 600]

Writes `--rows` rows in the Azure LLM inference 2024 format (TIMESTAMP with a UTC offset,
a fractional part (ms) except on whole seconds (~1 row in 40), as the published files mix
them; arrivals 25-175 ms apart) into a temporary folder, then loads it with
`testbed.traces.load_azure_2024` in a fresh Python process each time (as trace_load.py:
VmHWM reset just before the load): the whole file, a `--window`-second window in its
middle, and the first 1000 requests. The window's peak shows what streaming bounds (it
does not grow with the rows outside the selection); the whole file's is O(rows) for the
`Request`s it returns. Figures depend on the machine; nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_load import _status_mib  # noqa: E402


def write_trace(path: Path, rows: int, chunk: int = 1_000_000) -> float:
    """Returns the trace's span in seconds."""
    rng = np.random.default_rng(0)
    t = np.datetime64("2024-05-10T00:00:00", "ms")
    with open(path, "w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for lo in range(0, rows, chunk):
            k = min(chunk, rows - lo)
            stamps = t + np.cumsum(rng.integers(1, 8, k) * 25).astype("timedelta64[ms]")
            t = stamps[-1]
            text = np.char.replace(stamps.astype(str), "T", " ")
            whole = stamps.astype(np.int64) % 1000 == 0  # a whole second: written without a fraction, as Azure does
            text[whole] = np.char.partition(text[whole], ".")[:, 0]
            prompt, output = rng.integers(1, 8000, k), rng.integers(1, 800, k)
            f.write("".join(f"{s}+00:00,{p},{o}\n" for s, p, o in zip(text.tolist(), prompt.tolist(),
                                                                       output.tolist())))
    return float((t - np.datetime64("2024-05-10T00:00:00", "ms")) / np.timedelta64(1, "s"))


def measure(path: Path, start: float | None, end: float | None, max_requests: int | None) -> dict:
    from testbed import traces

    Path("/proc/self/clear_refs").write_text("5")
    before = _status_mib("VmRSS")
    t = time.perf_counter()
    load = traces.load_azure_2024(path, start_s=start, end_s=end, max_requests=max_requests)
    wall = time.perf_counter() - t
    peak = _status_mib("VmHWM")
    return {"requests": len(load.requests), "wall_s": wall, "before_mib": before, "peak_mib": peak,
            "load_mib": peak - before, "kept_mib": _status_mib("VmRSS") - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--window", type=float, default=600.0)
    ap.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--select", type=str, default="null", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, *json.loads(args.select))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "azure2024.csv"
        t = time.perf_counter()
        span = write_trace(path, args.rows)
        print(f"{platform.processor() or platform.machine()}, python {platform.python_version()}, "
              f"pyarrow {pa.__version__}; {args.rows:,} rows ({path.stat().st_size / 2**20:.0f} MiB, "
              f"{span / 3600:.1f} h) written in {time.perf_counter() - t:.0f} s")
        print(f"{'selection':<26} {'requests':>10} {'load s':>8} {'RSS before':>11} {'peak':>7} {'peak-before':>12} "
              f"{'after-before':>13}   (MiB)")
        mid = span / 2
        for label, sel in (("whole file", [None, None, None]),
                           (f"window {args.window:g} s (middle)", [mid, mid + args.window, None]),
                           ("first 1000", [None, None, 1000])):
            out = subprocess.run([sys.executable, __file__, "--measure", str(path), "--select", json.dumps(sel)],
                                 capture_output=True, text=True)
            if out.returncode:
                print(f"{label:<26} failed: {out.stderr.strip().splitlines()[-1]}")
                continue
            m = json.loads(out.stdout)
            print(f"{label:<26} {m['requests']:>10,} {m['wall_s']:>8.2f} {m['before_mib']:>11.0f} {m['peak_mib']:>7.0f} "
                  f"{m['load_mib']:>12.0f} {m['kept_mib']:>13.0f}")


if __name__ == "__main__":
    main()
