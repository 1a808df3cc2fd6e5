"""How far a GEMM shape between the tables' grid points can sit from the interpolation (candidate 8).

The H100 GEMM tables of vLLM 0.14.0 (the ones `version_near: 0.15.1` reads) have no n and no k between
16,384 and 65,536, yet that gap holds the widest layers of the models users run: Qwen2.5-7B's gate_up
(n = 37,888) and down (k = 18,944) projections, 87% of its layer weight bytes; Llama-3.x's and Mistral-Nemo's
gate_up (n = 28,672), Llama-2-7B's (n = 22,016). vLLM 0.24.0's tables add one point inside it, 51,200: the
one measured check of what the log-log interpolation between 16,384 and 65,536 (testbed/sim/kernel_db.py)
gives there. Printed: measured / interpolated latency at decode-size m, per dimension.

    python experiments/kernel_physics/gemm_gap.py
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

TABLE = Path(__file__).resolve().parents[2] / "testbed/sim/kernel_data/h100_sxm/gemm/vllm/0.24.0/gemm_perf.parquet"
LO, MID, HI = 16384, 51200, 65536


def main() -> None:
    df = pd.read_parquet(TABLE)
    df = df[df.gemm_dtype == "bfloat16"]
    lat = {(r.m, r.n, r.k): r.latency for r in df.itertuples()}
    frac = np.log(MID / LO) / np.log(HI / LO)
    rows = []
    for m in (1, 2, 4, 8, 16, 32, 64, 128):
        for other in (3584, 4096, 5120, 8192):
            for dim, key in (("n", lambda x: (m, x, other)), ("k", lambda x: (m, other, x))):
                if all(key(x) in lat for x in (LO, MID, HI)):
                    lo, mid, hi = (lat[key(x)] for x in (LO, MID, HI))
                    rows.append((dim, m, other, mid / np.exp(np.log(lo) + frac * np.log(hi / lo))))
    r = pd.DataFrame(rows, columns=["dim", "m", "other", "measured_over_interpolated"])
    print(r.pivot_table(index="m", columns=["dim", "other"], values="measured_over_interpolated").round(2))
    print(r.groupby("dim").measured_over_interpolated.describe().round(3))


if __name__ == "__main__":
    main()
