"""The load generator's latency figures, computed from simulated token times as inference-perf computes them.

Why: the real runs' per-token figures are not vLLM's TPOT. inference-perf (kubernetes-sigs/inference-perf,
the code of the calibration runs' time: commit e60b98d, 2026-02-16) takes one `time.perf_counter()` stamp per
server-sent-event message it splits off the stream, whatever the message holds
(inference_perf/apis/completion.py:58-62: every `\\n\\n`-terminated message is stamped before its content is
looked at, so the usage message and `data: [DONE]` are stamped too), and from a request's stamps
(inference_perf/reportgen/base.py:279-294):

    TTFT                  = stamps[0] - start
    time_per_output_token = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    inter_token_latency   = every gap stamps[i+1] - stamps[i], of every successful request, pooled

and every figure's mean and percentiles are numpy's over the successes (base.py:39-50: np.mean,
np.percentile with its default linear interpolation). A streamed completion asks for the usage
(`stream_options.include_usage`, completion.py:48), so after the tokens come two more stamped messages: the
usage and `[DONE]` (`END_MESSAGES`).

What the runs say on top of the code: their stamps per request are 2 x output tokens + 2 in every run
(solve time_per_output_token = (E2E - TTFT) / (stamps - 1) on a stage's means: 496 for 247 tokens, 504
for 251, 2898 for 1448), and half of their inter-token gaps are a few microseconds (Llama-2-7B codegen
stage 0: p25 4.7 us, median 27 us, p75 7.19 ms = one decode step). So each token reaches the client as
two messages read together, and the client's `inter_token_latency` mean and `time_per_output_token` are
about half the decode step. `messages_per_token` reads that count off a stage's own figures; the
simulated counterpart stamps every token that many times at its delivery (0 s apart; the real pair is
microseconds apart, which moves the mean by under 0.1% and no percentile above the share of such gaps)
and the two closing messages at the response's end. The first stamp is the first token, so TTFT is the
table's; E2E's end is the last stamp.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import chain

import numpy as np
import pandas as pd

END_MESSAGES = 2  # the usage message and `data: [DONE]`, each stamped (completion.py:48, 58-66)
TAIL_PERCENTILES = (90, 99)


def messages_per_token(measured: Mapping[str, float], output_len: int) -> int | None:
    """Stamped stream messages per generated token implied by a stage's means: its stamps per request
    c solve time_per_output_token = (E2E - TTFT) / (c - 1), and c = m x output_len + END_MESSAGES.
    None where the stage has no time_per_output_token (or no sensible m)."""
    tpot = measured.get("stream_tpot")
    if tpot is None or not tpot > 0 or "ttft" not in measured or "e2e" not in measured or output_len < 1:
        return None
    stamps = (measured["e2e"] - measured["ttft"]) / tpot + 1
    m = round((stamps - END_MESSAGES) / output_len)
    return m if m >= 1 else None


def pooled_percentiles(values: np.ndarray, zeros: int, qs: tuple[float, ...]) -> list[float]:
    """np.percentile(concatenate(values, zeros(zeros)), q) for each q (numpy's linear interpolation), for
    non-negative `values`, without building the pooled array (millions of zero gaps) or sorting it: the
    two order statistics each q interpolates between are found by np.partition."""
    n = len(values) + zeros
    if n == 0:
        return [math.nan] * len(qs)
    spots = []
    for q in qs:
        h = (n - 1) * q / 100
        lo = math.floor(h)
        spots.append((lo, min(lo + 1, n - 1), h - lo))
    kth = sorted({i - zeros for lo, hi, _ in spots for i in (lo, hi) if i >= zeros})
    part = np.partition(values, kth) if kth else values
    out = []
    for lo, hi, frac in spots:
        a = float(part[lo - zeros]) if lo >= zeros else 0.0
        b = float(part[hi - zeros]) if hi >= zeros else 0.0
        out.append(a + (b - a) * frac)
    return out


def token_gaps(rows: pd.DataFrame) -> np.ndarray | None:
    """The stamp gaps of `rows` (finished requests of a simulated run) that may not be 0, pooled: between
    consecutive tokens (every token is delivered alike after the engine made it), and from the last token to
    the closing messages (the front end's completion time); a request's other stamps - 1 gaps are 0. None
    where a row has no `token_times`. Their order carries no figure (only percentiles are taken of them), so
    the gaps of a run's parts, joined, are the whole run's."""
    if "token_times" not in rows or rows["token_times"].isna().any():
        return None
    span = rows["e2el_ms"].to_numpy(dtype=float) / 1e3 - rows["ttft_ms"].to_numpy(dtype=float) / 1e3  # client_figures'
    times = rows["token_times"].tolist()
    lengths = np.fromiter(map(len, times), dtype=np.int64, count=len(times))
    flat = np.fromiter(chain.from_iterable(times), dtype=float, count=int(lengths.sum()))
    ends = np.cumsum(lengths)
    within = np.delete(np.diff(flat), ends[:-1] - 1)  # drop the jumps from one request to the next
    last = np.maximum(span - (flat[ends - 1] - flat[ends - lengths]), 0.0)  # rounding: never below 0
    return np.concatenate([within, last])


def client_figures(rows: pd.DataFrame, per_token: int | None, gaps: np.ndarray | None = None) -> dict[str, float]:
    """The load generator's figures, in seconds, over `rows` (finished requests of a simulated run:
    `ttft_ms`, `e2el_ms`, `output_len` and, for the inter-token percentiles, `token_times`, the engine's
    time of each token): ttft, e2e, their medians (`ttft_p50`, `e2e_p50`: numpy's median, as the load
    generator's) and TAIL_PERCENTILES (`ttft_p90`, ...), and with `per_token`
    stamped messages per token, `itl` (the pooled gaps' mean), `itl_p90`, `itl_p99` and `stream_tpot`
    (the mean time_per_output_token). `gaps`: `token_gaps(rows)` where the caller has them already."""
    out: dict[str, float] = {}
    if not len(rows):
        return out
    ttft = rows["ttft_ms"].to_numpy(dtype=float) / 1e3
    e2e = rows["e2el_ms"].to_numpy(dtype=float) / 1e3
    for name, v in (("ttft", ttft), ("e2e", e2e)):
        out[name] = float(np.mean(v))
        for q, p in zip((50, *TAIL_PERCENTILES), np.percentile(v, (50, *TAIL_PERCENTILES))):
            out[f"{name}_p{q}"] = float(p)
    if per_token is None:
        return out
    stamps = per_token * rows["output_len"].to_numpy() + END_MESSAGES
    span = e2e - ttft  # last stamp - first stamp: the first token's delivery to the response's end
    out["stream_tpot"] = float(np.mean(span / (stamps - 1)))
    out["itl"] = float(span.sum() / (stamps - 1).sum())
    if gaps is None:
        gaps = token_gaps(rows)
        if gaps is None:
            return out
    zeros = int((stamps - 1).sum()) - len(gaps)
    for q, p in zip(TAIL_PERCENTILES, pooled_percentiles(gaps, zeros, TAIL_PERCENTILES)):
        out[f"itl_p{q}"] = p
    return out
