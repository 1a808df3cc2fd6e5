"""Held-out error of cost_model=kernels' interpolation, measured against the kernel tables themselves.

For each op a seeded fraction of the interior measured points (those whose adjacent grid points
along every interpolated axis were measured too) is removed, the interpolator rebuilt from the
rest, and the removed points predicted. Prints the median and p95 absolute percentage error per
op and overall. Needs aiconfigurator-core (pip install 'llm-sched-testbed[kernels]').

    python experiments/benchmarks/kernel_interpolation.py [--gpu h100_sxm] [--framework vllm] [--frac 0.1] [--seed 0]
"""
from __future__ import annotations

import argparse

import numpy as np

from testbed.sim.kernel_db import KernelDB, LogGrid


def _groups(db: KernelDB, op: str):
    """(axes columns, latency in s, work exponents) per independent table slice of an op."""
    if op == "gemm":
        df = db._read("gemm", ["m", "n", "k"], [("gemm_dtype", "==", "bfloat16")], source="gemm")
        df = df.groupby(["m", "n", "k"], as_index=False).latency.median()
        yield [df.m.values, df.n.values, df.k.values], df.latency.values * 1e-3, (1, 1, 1)
    elif op in ("context_attention", "generation_attention"):
        df = db._context_rows if op == "context_attention" else db._generation_rows
        df = df.assign(length=df.isl + df.step)
        for _, g in df.groupby(["num_heads", "num_key_value_heads", "head_dim"]):
            g = g.groupby(["batch_size", "length"], as_index=False).latency.median()
            yield [g.batch_size.values, g.length.values], g.latency.values * 1e-3, \
                (1, 2 if op == "context_attention" else 1)
    elif op == "moe":
        df = db._moe_rows
        for _, g in df.groupby(["hidden_size", "inter_size", "topk", "num_experts", "moe_tp_size"]):
            g = g.groupby("num_tokens", as_index=False).latency.median()
            yield [g.num_tokens.values], g.latency.values * 1e-3, (1,)
    elif op == "allreduce":
        df = db._read("allreduce", ["num_gpus", "message_size"], [("backend", "==", db.sources["allreduce_backend"]),
                                                                  ("allreduce_dtype", "==", "bfloat16")])
        for _, g in df.groupby("num_gpus"):
            g = g.groupby("message_size", as_index=False).latency.median()
            yield [g.message_size.values], g.latency.values * 1e-3, (1,)


def _dense(cols, latency):
    axes = [np.unique(c) for c in cols]
    vals = np.full([len(a) for a in axes], np.nan)
    vals[tuple(np.searchsorted(a, c) for a, c in zip(axes, cols))] = latency
    return axes, vals


def _interior(vals: np.ndarray) -> np.ndarray:
    """Measured cells whose neighbours on both sides along every axis were measured."""
    ok = ~np.isnan(vals)
    keep = ok.copy()
    for d in range(vals.ndim):
        n = vals.shape[d]
        if n < 3:
            return np.zeros_like(ok)
        lo = np.take(ok, range(0, n - 2), axis=d)
        hi = np.take(ok, range(2, n), axis=d)
        inner = np.zeros_like(ok)
        sl = [slice(None)] * vals.ndim
        sl[d] = slice(1, n - 1)
        inner[tuple(sl)] = lo & hi
        keep &= inner
    return keep


def held_out_errors(db: KernelDB, op: str, frac: float, rng: np.random.Generator) -> np.ndarray:
    groups = [(*_dense(cols, lat), up) for cols, lat, up in _groups(db, op)]
    eligible = [(gi, idx) for gi, (_, vals, _) in enumerate(groups) for idx in zip(*np.nonzero(_interior(vals)))]
    if not eligible:
        return np.empty(0)
    pick = rng.choice(len(eligible), size=max(1, round(frac * len(eligible))), replace=False)
    by_group: dict[int, list] = {}
    for i in pick:
        gi, idx = eligible[i]
        by_group.setdefault(gi, []).append(idx)
    errors = []
    for gi, cells in by_group.items():
        axes, vals, up = groups[gi]
        holed = vals.copy()
        for idx in cells:
            holed[idx] = np.nan
        grid = LogGrid(axes, holed, up)
        for idx in cells:
            pred = grid(*(a[i] for a, i in zip(axes, idx)))
            errors.append(abs(pred / vals[idx] - 1) * 100)
    return np.asarray(errors)


def heads_stand_in_errors(db: KernelDB, phase: str) -> np.ndarray:
    """The heads rule checked on the table itself: every measured (heads, kv heads) slice predicted from
    the largest measured slice with the same query-per-kv-head ratio and fewer kv heads, its batch
    scaled by the heads ratio (testbed.sim.kernel_db.match_heads), at the measured (batch, length)."""
    df = db._context_rows if phase == "context" else db._generation_rows
    df = df.assign(length=df.isl + df.step)
    errors = []
    for hd, g in df.groupby("head_dim"):
        pairs = sorted(set(map(tuple, g[["num_heads", "num_key_value_heads"]].values.tolist())))
        for h, kv in pairs:
            smaller = [(h2, kv2) for h2, kv2 in pairs if kv2 < kv and h2 * kv == h * kv2]
            if not smaller:
                continue
            h2, kv2 = max(smaller, key=lambda p: p[1])
            ref = g[(g.num_heads == h2) & (g.num_key_value_heads == kv2)]
            ref = ref.groupby(["batch_size", "length"], as_index=False).latency.median()
            grid = LogGrid.from_rows([ref.batch_size.values, ref.length.values], ref.latency.values,
                                     up=(1, 2 if phase == "context" else 1))
            rows = g[(g.num_heads == h) & (g.num_key_value_heads == kv)]
            rows = rows.groupby(["batch_size", "length"], as_index=False).latency.median()
            for b, n, lat in rows[["batch_size", "length", "latency"]].itertuples(index=False):
                errors.append(abs(grid(b * h / h2, n) / lat - 1) * 100)
    return np.asarray(errors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h100_sxm")
    ap.add_argument("--framework", default="vllm")
    ap.add_argument("--frac", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    db = KernelDB(args.gpu, args.framework)
    rng = np.random.default_rng(args.seed)
    print(f"held-out {args.frac:.0%} of interior points, {args.gpu} {args.framework}")
    print(f"{'op':22s} {'points':>7s} {'median APE %':>13s} {'p95 APE %':>10s}")
    everything = []
    for op in ("gemm", "context_attention", "generation_attention", "moe", "allreduce"):
        err = held_out_errors(db, op, args.frac, rng)
        everything.append(err)
        print(f"{op:22s} {len(err):7d} {np.median(err):13.2f} {np.percentile(err, 95):10.2f}")
    err = np.concatenate(everything)
    print(f"{'overall':22s} {len(err):7d} {np.median(err):13.2f} {np.percentile(err, 95):10.2f}")
    print("heads stand-in (a slice predicted from one with fewer kv heads at the same ratio, batch scaled):")
    for phase in ("context", "generation"):
        err = heads_stand_in_errors(db, phase)
        print(f"{phase + '_attention':22s} {len(err):7d} {np.median(err):13.2f} {np.percentile(err, 95):10.2f}")
    print("versions:", db.versions)


if __name__ == "__main__":
    main()
