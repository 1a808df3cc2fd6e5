"""Time, on a GPU, the GEMMs the kernel tables do not measure (candidate 8) beside the tables' own price.

Why: the H100 GEMM tables have no n and no k between 16,384 and 65,536, and the widest layers of the
models users run fall there (Qwen2.5-7B's gate_up n = 37,888 and down k = 18,944; the gate_up of
Llama-3.x and Mistral-Nemo, n = 28,672; large-vocabulary LM heads, n = 128-152k, past the last row). The
one shape measured inside the gap (vLLM 0.24.0's n = 51,200) sits 0.84-1.22x from the interpolation
(`gemm_gap.py`). This times each such shape with torch's linear (what vLLM's unquantised layers call),
bf16, at decode sizes, CUDA events over back-to-back launches (median of --iters), beside the latency
`cost_model=kernels` reads for it (testbed.sim.kernel_db, the vLLM 0.14.0 tables), and the grid
neighbours it interpolates between, measured the same way: a ratio measured/table near 1 at the
neighbours and far from it in the gap says the gap, not the timing method, is off.

Run (device): python experiments/kernel_physics/gemm_gpu_bench.py --out gemm_gap.csv
Smoke test (CPU): python experiments/kernel_physics/gemm_gpu_bench.py --device cpu --small --out /tmp/g.csv
"""
from __future__ import annotations

import argparse
import csv
import statistics
import time

import torch

# (model, layer, n, k) per GPU at TP1; each gap shape is followed by the grid rows it is interpolated from
SHAPES = [
    ("qwen2.5-7b", "gate_up", 37888, 3584), ("grid", "n below", 16384, 3584), ("grid", "n above", 65536, 3584),
    ("qwen2.5-7b", "down", 3584, 18944), ("grid", "k below", 3584, 16384), ("grid", "k above", 3584, 65536),
    ("qwen2.5-7b", "lm_head", 152064, 3584),
    ("llama-3.1-8b", "gate_up", 28672, 4096), ("grid", "n below", 16384, 4096), ("grid", "n above", 65536, 4096),
    ("llama-3.1-8b", "down", 4096, 14336), ("llama-3.1-8b", "lm_head", 128256, 4096),
    ("llama-2-7b", "gate_up", 22016, 4096), ("llama-2-7b", "down", 4096, 11008),
    ("mistral-nemo-12b", "gate_up", 28672, 5120), ("mistral-nemo-12b", "lm_head", 131072, 5120),
]
MS = (1, 8, 16, 32, 64, 128)


def time_linear(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype, iters: int) -> float:
    """Median seconds of one F.linear(x[m, k], w[n, k])."""
    x = torch.randn(m, k, device=device, dtype=dtype)
    w = torch.randn(n, k, device=device, dtype=dtype)
    f = torch.nn.functional.linear
    for _ in range(3):
        f(x, w)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            f(x, w)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            f(x, w)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def table_price(n: int, k: int, m: int) -> float | None:
    """What cost_model=kernels reads for this GEMM on the H100 (None without the testbed or its tables)."""
    try:
        import numpy as np

        from testbed.sim.cost_models import shared_kernel_db  # one KernelDB per process

        db = shared_kernel_db("h100_sxm", "vllm", None, None, "0.15.1")
        return float(db.gemm_over_m(n, k, np.array([float(m)]))[0])
    except Exception:  # noqa: BLE001 - the timing is the point; the table column is a convenience
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--small", action="store_true", help="shapes / 64, float32: a CPU smoke run")
    ap.add_argument("--out", default="gemm_gap.csv")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.float32 if args.small else torch.bfloat16
    scale = 64 if args.small else 1
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    rows = []
    for model, layer, n, k in SHAPES:
        for m in MS[:2] if args.small else MS:
            t = time_linear(m, n // scale, k // scale, device, dtype, 3 if args.small else args.iters)
            table = None if args.small else table_price(n, k, m)
            rows.append(dict(device=name, model=model, layer=layer, m=m, n=n // scale, k=k // scale,
                             measured_us=round(t * 1e6, 2), table_us=round(table * 1e6, 2) if table else "",
                             measured_over_table=round(t / table, 3) if table else "",
                             tb_per_s=round((n // scale) * (k // scale) * (4 if args.small else 2) / t / 1e12, 3)))
            print(rows[-1], flush=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}: {len(rows)} rows")


if __name__ == "__main__":
    main()
