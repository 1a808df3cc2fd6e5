"""Split a GPU fidelity run's decode-step error into padding and the rest (testbed/engine/bench_h100.md).

Why: the engine's reference attention pads every decode row to the batch's longest context, and its profile
grid gives every row the same context, so the profile cannot price that padding. The real run records each
step's batch only as sums; the longest context is rebuilt from the requests (a request decodes in the steps
between its first token and its finish, its k-th at context prompt + k + 1), checked against the recorded sums.

Usage: python experiments/gpu/decode_padding.py [experiments/gpu/results_h100/fidelity_llama3_1_8b]
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

GRAPH_MAX_TOKENS = 262_144  # backend.cuda_graph_max_tokens of the run (batch x context above it runs eagerly)


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
    t = pd.DataFrame({"seqs": scored.num_decode_seqs, "ratio": scored.measured_s / scored.predicted_s,
                      "padding": scored.num_decode_seqs * longest / np.maximum(scored.decode_kv_tokens, 1),
                      "padded": scored.num_decode_seqs * longest, "measured": scored.measured_s,
                      "predicted": scored.predicted_s})[dec]
    t["eager"] = t.padded > GRAPH_MAX_TOKENS
    print(t.groupby(["eager", pd.cut(t.seqs, [0, 8, 32, 64, 128, 256])], observed=True)
          [["measured", "predicted", "ratio", "padding"]].median().round(3).to_string())
    x = np.c_[np.ones(len(t)), t.predicted, t.padded / 1e6, t.eager.astype(float)]
    coef = np.linalg.lstsq(x, t.measured, rcond=None)[0]
    print(f"least squares: measured = {coef[0]:.4f} s + {coef[1]:.3f} x predicted + {coef[2]:.4f} s per million "
          f"padded tokens + {coef[3]:.4f} s when eager")


if __name__ == "__main__":
    main()
