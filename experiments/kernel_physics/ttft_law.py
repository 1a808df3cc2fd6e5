"""Where the mean-TTFT errors come from: the first token's path in decode steps, real against simulated.

    python experiments/kernel_physics/ttft_law.py [experiments/validation_h100/validate.csv]

At low load a request's TTFT is the API server's fixed work plus a number of engine steps (the step it
arrives in, the one already queued under async scheduling, its own), so over the stages at 10 req/s or
less, mean TTFT = a + b x mean TPOT (least squares), for the real runs and for the simulated ones. Left out:
Qwen2.5-7B (another tokenizer and API path, its TPOT already 10% short) and Mixtral's first stages, whose
mean TTFT carries seconds-long warm-up stalls (median 53-56 ms against means 61-64, max 1.2-2.0 s; its
warm second stage: mean = median). Prints both fits and each stage's residual.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

RUNS = Path(__file__).resolve().parents[2].parent / "shared" / "calibration"


def fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, np.ndarray]:
    a, b = np.linalg.lstsq(np.c_[np.ones(len(x)), x], y, rcond=None)[0]
    return float(a), float(b), (a + b * x) / y - 1


def warm_up_tails() -> pd.DataFrame:
    """Each real stage's TTFT mean, median, p99 and max (ms) from the load generator's files."""
    rows = []
    for f in sorted(RUNS.glob("*/*/results/stage_*_lifecycle_metrics.json")):
        t = json.loads(f.read_text())["successes"]["latency"]["time_to_first_token"]
        if not all(k in t for k in ("mean", "median", "p99", "max")):
            continue
        rows.append({"run": f.parents[1].name, "stage": int(f.stem.split("_")[1]),
                     **{k: 1e3 * t[k] for k in ("mean", "median", "p99", "max")}})
    return pd.DataFrame(rows)


def main(path: str = "experiments/validation_h100/validate.csv") -> None:
    d = pd.read_csv(path)
    d = d[d.stage.notna() & ~d.overloaded.astype(bool)]
    low = d[(d.rate <= 10) & ~d.model.str.contains("Qwen") & ~(d.model.str.contains("Mixtral") & (d.stage == 0))]
    for side in ("real", "sim"):
        a, b, resid = fit(low[f"{side}_tpot_ms"].values, low[f"{side}_ttft_ms"].values)
        print(f"{side}: mean TTFT = {a:.2f} ms + {b:.3f} x mean TPOT over {len(low)} stages "
              f"(|residual| at most {np.abs(resid).max():.1%})")
    a, b, _ = fit(low.real_tpot_ms.values, low.real_ttft_ms.values)
    out = low[["run", "stage", "rate", "real_ttft_ms", "real_tpot_ms", "sim_ttft_ms"]].copy()
    out["law_ms"] = a + b * out.real_tpot_ms
    print(out.round(2).to_string(index=False))
    if RUNS.is_dir():
        tails = warm_up_tails()
        print("\nMixtral's stages: the warm-up tail in the first stage's mean")
        print(tails[tails.run.str.contains("mixtral")].round(1).to_string(index=False))


if __name__ == "__main__":
    main(*sys.argv[1:])
