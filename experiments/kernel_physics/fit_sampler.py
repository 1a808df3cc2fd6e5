"""Fit t(B, V) = t0 + c * B * V to the published sort-path timings in sampler_published.csv.

Why: the simulator needs a cost for vLLM 0.15.1's sort-based top-k/top-p sampler (issue 23),
and the only figures available are other people's microbenchmarks (see SAMPLER.md). This
script makes every fitted constant in SAMPLER.md reproducible from the CSV: it prints the fit,
each point's residual, and the bytes per logit the slope implies at the GPU's HBM bandwidth.

Run: python experiments/kernel_physics/fit_sampler.py
"""

import csv
from pathlib import Path

import numpy as np

HERE = Path(__file__).parent
# Datasheet HBM bandwidths (TB/s) used only to turn a slope into bytes per logit.
BANDWIDTH_TBS = {"H100": 3.35, "B200": 8.0, "H200": 4.8, "RTX 4070 SUPER": 0.504}
SORT_OPS = {"topp_sort", "topp_sort_partial", "topk_topp_sort"}


def rows() -> list[dict]:
    with open(HERE / "sampler_published.csv", newline="") as f:
        return list(csv.DictReader(f))


def fit(points: list[tuple[int, int, float]], label: str, gpu: str | None) -> None:
    """Least squares t = t0 + c*n with n = B*V; prints constants and per-point residuals."""
    n = np.array([b * v for b, v, _ in points], dtype=float)
    t = np.array([ms for _, _, ms in points])
    a = np.stack([np.ones_like(n), n], axis=1)
    (t0, c), *_ = np.linalg.lstsq(a, t, rcond=None)
    pred = t0 + c * n
    rel = (t - pred) / t
    print(f"\n== {label}: {len(points)} points")
    print(f"t0 = {t0 * 1e3:.1f} us, c = {c * 1e9:.1f} ps per logit")
    if gpu in BANDWIDTH_TBS:
        print(f"implied {c * 1e-3 * BANDWIDTH_TBS[gpu] * 1e12:.0f} bytes/logit at {gpu} {BANDWIDTH_TBS[gpu]} TB/s")
    print(f"residuals: rms {np.sqrt(np.mean(rel ** 2)) * 100:.1f}%, max |{np.max(np.abs(rel)) * 100:.1f}|%")
    for (b, v, ms), p, r in zip(points, pred, rel):
        print(f"  B={b:5d} V={v:6d} measured {ms:7.3f} ms  fit {p:7.3f} ms  ({r * 100:+.1f}%)")


def select(data, source: str, ops, bmin=1, bmax=10**9, drop_outliers=True):
    out = []
    for r in data:
        if source not in r["source_url"] or r["op"] not in ops:
            continue
        b, v = int(r["batch"]), int(r["vocab"])
        if not bmin <= b <= bmax:
            continue
        if drop_outliers and ("outlier" in r["note"] or "suspect" in r["note"] or "noise" in r["note"]):
            continue
        out.append((b, v, float(r["ms_pytorch"])))
    return out


def main() -> None:
    data = rows()
    fit(select(data, "pull/42191", SORT_OPS, bmax=4), "H100 #42191, B<=4 (single/full-sort regime)", "H100")
    large = select(data, "pull/33538", SORT_OPS, bmin=48) + select(data, "pull/32558", SORT_OPS)
    large += select(data, "pull/42191", {"mixed_sort"}, bmin=2048)
    fit(large, "#33538 + #32558 + H100 #42191 B=2048, B>=48 (GPU of #33538/#32558 unstated)", "H100")
    fit(select(data, "pull/33538", SORT_OPS, bmin=512), "#33538 only, B>=512", "H100")
    fit(select(data, "pull/40376", SORT_OPS | {"topk_sort"}, bmin=64), "#40376 (B200?), B>=64", "B200")
    fit(select(data, "pull/51507", SORT_OPS | {"topk_sort"}, bmin=128), "#51507 (H200 or MI350X), B>=128", "H200")
    fit(select(data, "nano-vllm", {"temperature_sample_compiled"}), "temperature-only, compiled, RTX 4070 SUPER", "RTX 4070 SUPER")
    fit(select(data, "pull/171143", {"temperature_sample_eager"}), "temperature-only, eager, GPU unstated", None)


if __name__ == "__main__":
    main()
