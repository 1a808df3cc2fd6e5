"""This CPU's single-thread Python speed, in a form a reader can compare with a GPU server's host CPU.

Runs five pyperformance benchmarks (nbody, richards, float, deepcopy, json_dumps: pure-Python
arithmetic, method calls, object allocation, object-graph copying and dict/list serialisation, the
kinds of work vLLM's scheduler and output processing do) directly with pyperf in `--fast` mode, under
the exclusive quiet lock, and records /proc/cpuinfo and lscpu. Run the same command with the same
pyperformance version on another host, and the ratio of the times is the factor by which host-side
figures measured here scale there (to first order: the vLLM figures here are Python and small-array
numpy work, single-threaded).

    python -m venv /work/venvs/pyperf && /work/venvs/pyperf/bin/pip install pyperformance==1.14.0
    /work/venvs/pyperf/bin/python experiments/host_overhead/cpu_speed.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import QUIET, cpu_model, loadavg, write_csv  # noqa: E402

HERE = Path(__file__).resolve().parent
BENCHMARKS = ("nbody", "richards", "float", "deepcopy", "json_dumps")


def main() -> None:
    import pyperf
    import pyperformance

    out = HERE / "results"
    out.mkdir(exist_ok=True)
    data = Path(pyperformance.__file__).parent / "data-files" / "benchmarks"
    rows = []
    tmp = Path("/tmp/host_overhead_pyperf")
    tmp.mkdir(exist_ok=True)
    for bm in BENCHMARKS:
        script = data / f"bm_{bm}" / "run_benchmark.py"
        res = tmp / f"{bm}.json"
        res.unlink(missing_ok=True)
        with QUIET():
            subprocess.run([sys.executable, str(script), "--fast", "-o", str(res)], check=True,
                           stdout=subprocess.DEVNULL)
        for b in pyperf.BenchmarkSuite.load(str(res)).get_benchmarks():
            rows.append(dict(benchmark=b.get_name(), mean_ms=round(b.mean() * 1e3, 3), stdev_ms=round(b.stdev() * 1e3, 3),
                             values=len(b.get_values())))
            print(rows[-1], flush=True)
    name, mhz = cpu_model()
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    meta = dict(cpu=name, cpu_mhz=mhz, lscpu=lscpu.splitlines(), python=sys.version.split()[0],
                pyperformance=pyperformance.__version__, pyperf=pyperf.__version__, loads=QUIET.summary(),
                load_at_end=loadavg(), command=" ".join([sys.executable] + sys.argv))
    write_csv(str(out / "cpu_speed.csv"), rows)
    (out / "cpu_speed.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(QUIET.summary())


if __name__ == "__main__":
    main()
