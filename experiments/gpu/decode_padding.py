"""Split a GPU fidelity run's decode-step error into padding and the rest (testbed/engine/bench_h100.md).

Why: the engine's decode attention gathers every row's KV padded (to its CUDA graph's context bucket, or eagerly
to the batch's longest context) and a step whose graph would exceed `backend.cuda_graph_max_tokens` runs
eagerly, while the profile grid gives every row the same context: it can price neither. The real run records each
step's batch only as sums; the longest context is rebuilt from the requests (a request decodes in the steps
between its first token and its finish, its k-th at context prompt + k + 1), checked against the recorded sums.

Usage: python experiments/gpu/decode_padding.py [experiments/gpu/results_h100/fidelity_llama3_1_8b]
"""
from __future__ import annotations

import bisect
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.engine.decode_graphs import BATCH_LADDER, BLOCK_LADDER, ladder

# the run's settings (experiments/gpu/run.sh): backend.cuda_graph_max_tokens, scheduler.max_num_seqs and
# max_model_len, kv.block_size
GRAPH_MAX_TOKENS, MAX_SEQS, MAX_LEN, BLOCK = 262_144, 256, 8192, 16
BATCHES, BLOCKS = ladder(BATCH_LADDER, MAX_SEQS), ladder(BLOCK_LADDER, -(-MAX_LEN // BLOCK))


def graph_tokens(seqs: int, longest: int) -> int | None:
    """The KV tokens a decode step's CUDA graph gathers (its padded batch x context bucket,
    `DecodeGraphs.shape_for`); None where it runs eagerly."""
    i, j = bisect.bisect_left(BATCHES, seqs), bisect.bisect_left(BLOCKS, -(-int(longest) // BLOCK))
    if i == len(BATCHES) or j == len(BLOCKS):
        return None
    n = BATCHES[i] * BLOCKS[j] * BLOCK
    return n if n <= GRAPH_MAX_TOKENS else None


def main() -> None:
    d = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results_h100" / "fidelity_llama3_1_8b")
    steps, reqs, scored = (pd.read_parquet(d / "real" / "steps.parquet"), pd.read_parquet(d / "real" / "requests.parquet"),
                           pd.read_csv(d / "steps.csv"))
    starts = steps.start.to_numpy()
    longest, kv, seqs = np.zeros(len(steps)), np.zeros(len(steps)), np.zeros(len(steps), int)
    for r in reqs.itertuples():
        if not np.isfinite(r.first_token_s):
            continue
        at = np.flatnonzero((starts >= r.first_token_s - 1e-9) & (starts < r.finish_s - 1e-9))
        ctx = r.prompt_len + 1 + np.arange(len(at))
        longest[at] = np.maximum(longest[at], ctx)
        kv[at] += ctx
        seqs[at] += 1
    dec = (scored.kind == "decode").to_numpy()
    same = (seqs[dec] == scored.num_decode_seqs[dec]) & (kv[dec] == scored.decode_kv_tokens[dec])
    print(f"rebuilt batches equal the recorded ones at {same.sum()} of {dec.sum()} decode steps")
    graph = [graph_tokens(b, m) for b, m in zip(scored.num_decode_seqs, longest)]
    t = pd.DataFrame({"seqs": scored.num_decode_seqs, "ratio": scored.measured_s / scored.predicted_s,
                      "padded": [g if g else b * m for g, b, m in zip(graph, scored.num_decode_seqs, longest)],
                      "eager": [g is None for g in graph], "measured": scored.measured_s,
                      "predicted": scored.predicted_s, "kv": scored.decode_kv_tokens})[dec]
    t["padding"] = t.padded / t.kv  # graph: its bucket; eager: every row to the longest
    print(t.groupby(["eager", pd.cut(t.seqs, [0, 8, 32, 64, 128, 256])], observed=True)
          .agg(steps=("ratio", "size"), ratio=("ratio", "median"), padding=("padding", "median")).round(2).to_string())
    x = np.c_[np.ones(len(t)), t.predicted, t.padded / 1e6, t.eager.astype(float)]
    coef = np.linalg.lstsq(x, t.measured, rcond=None)[0]
    print(f"least squares: measured = {coef[0]:.4f} s + {coef[1]:.3f} x predicted + {coef[2]:.4f} s per million "
          f"padded tokens + {coef[3]:.4f} s when eager")


if __name__ == "__main__":
    main()
