"""How long a large trace takes to load, and how much memory it takes, per container.

Usage: python experiments/benchmarks/trace_load.py [--rows 1000000] [--keep DIR]

Writes a trace of `--rows` Azure-schema rows (TIMESTAMP with 7 fractional digits,
ContextTokens, GeneratedTokens; arrivals ~0.2 s apart) into a temporary folder as CSV,
gzip-compressed CSV, zstd-compressed CSV and Parquet, a CSV whose every 1000th row has a
field too many or too few (loaded leniently), and JSON lines in Mooncake's shape (integer
milliseconds, no hashes), then loads each one (`testbed.traces.load_azure`; `load_table`
for the JSONL) in a fresh Python process and prints the file's size, the
load's wall time, and the process's resident memory (Linux /proc/self/status) before the
load (imports done), at its peak (VmHWM, reset just before), and after it (what the
TraceLoad itself holds: a million `Request` objects). A fresh process per load keeps one
load's peak from hiding the next. Figures depend on the machine; nothing is asserted.
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
import pyarrow.csv as pcsv
import pyarrow.parquet as pq


def write_traces(folder: Path, rows: int) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    gaps = rng.exponential(0.2e9, rows).astype(np.int64)  # ns
    ns = np.datetime64("2023-11-16T18:15:46", "ns") + np.cumsum(gaps).astype("timedelta64[ns]")
    stamps = np.char.replace(ns.astype(str), "T", " ")
    stamps = np.array([s[:-2] for s in stamps.tolist()])  # 7 fractional digits, as Azure writes them
    table = pa.table({"TIMESTAMP": pa.array(stamps, pa.string()),
                      "ContextTokens": rng.integers(1, 8000, rows), "GeneratedTokens": rng.integers(1, 800, rows)})
    files = {"csv": folder / "trace.csv", "csv.gz": folder / "trace.csv.gz", "csv.zst": folder / "trace.csv.zst",
             "parquet": folder / "trace.parquet"}
    pcsv.write_csv(table, files["csv"], pcsv.WriteOptions(quoting_style="none"))
    for key, codec in (("csv.gz", "gzip"), ("csv.zst", "zstd")):
        with pa.CompressedOutputStream(str(files[key]), codec) as out:
            out.write(files["csv"].read_bytes())
    pq.write_table(table, files["parquet"])
    lines = files["csv"].read_bytes().split(b"\n")
    for k in range(1, len(lines) - 1, 1000):  # every 1000th row one field too many or too few
        lines[k] = lines[k] + b",x" if k % 2000 == 1 else lines[k].rsplit(b",", 1)[0]
    files["csv ragged"] = folder / "ragged.csv"
    files["csv ragged"].write_bytes(b"\n".join(lines))
    ms = (np.cumsum(gaps) // 1_000_000).tolist()  # Mooncake's shape: integer milliseconds
    files["jsonl"] = folder / "trace.jsonl"
    rows = zip(ms, table["ContextTokens"].to_pylist(), table["GeneratedTokens"].to_pylist())
    files["jsonl"].write_text("".join(f'{{"timestamp": {t}, "input_length": {p}, "output_length": {o}}}\n'
                                      for t, p, o in rows))
    return files


def _status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(path: Path, lenient: bool) -> dict:
    """Run in a child process: load `path`, report time and memory (Linux: /proc/self/status)."""
    from testbed import traces

    Path("/proc/self/clear_refs").write_text("5")  # restart the peak (VmHWM) from the current size
    before = _status_mib("VmRSS")
    t = time.perf_counter()
    if path.suffix == ".jsonl":
        load = traces.load_table(path, columns={"arrival": "timestamp", "prompt_len": "input_length",
                                                "output_len": "output_length"}, time_unit="ms", lenient=lenient)
    else:
        load = traces.load_azure(path, lenient=lenient)
    wall = time.perf_counter() - t
    peak = _status_mib("VmHWM")
    return {"rows": load.rows, "requests": len(load.requests), "rejected": len(load.rejected), "wall_s": wall,
            "before_mib": before,
            "peak_mib": peak, "load_mib": peak - before, "kept_mib": _status_mib("VmRSS") - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, help="write the traces here and keep them (default: a temporary folder)")
    ap.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # the child process's job
    ap.add_argument("--lenient", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.lenient)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        t = time.perf_counter()
        files = write_traces(folder, args.rows)
        print(f"{platform.processor() or platform.machine()}, python {platform.python_version()}, "
              f"pyarrow {pa.__version__}; {args.rows:,} rows written in {time.perf_counter() - t:.1f} s")
        print(f"{'container':<11} {'file MiB':>9} {'load s':>8} {'RSS before':>11} {'peak':>7} {'peak-before':>12} "
              f"{'after-before':>13}   (MiB)")
        for key, path in files.items():
            lenient = ["--lenient"] if key == "csv ragged" else []
            out = subprocess.run([sys.executable, __file__, "--measure", str(path), *lenient], capture_output=True,
                                 text=True)
            if out.returncode:
                print(f"{key:<11} failed: {out.stderr.strip().splitlines()[-1]}")
                continue
            m = json.loads(out.stdout)
            assert m["rows"] == m["requests"] + m["rejected"] == args.rows and bool(m["rejected"]) == bool(lenient), m
            print(f"{key:<11} {path.stat().st_size / 2**20:>9.1f} {m['wall_s']:>8.2f} {m['before_mib']:>11.0f} "
                  f"{m['peak_mib']:>7.0f} {m['load_mib']:>12.0f} {m['kept_mib']:>13.0f}")


if __name__ == "__main__":
    main()
