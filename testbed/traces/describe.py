"""What a trace is like before anything replays it: rate and burstiness, lengths, prefix reuse, sessions.

Why: a policy's result on a trace is read against the trace's load shape. Two traces of one
mean rate load a server very differently when one sends its requests in bursts, and a prefix
cache can only win what the trace repeats. These are the numbers workload characterisations
quote (ServeGen, for one, publishes rate and the CV of gaps per 600-s window), computed here on
the exact request list a run would replay, after its transforms. Pure functions of ``list[Request]``; the command that
loads, prints, plots and writes them is `testbed.app.analysis.traces`.

Definitions (each a statement about the requests in arrival order):

* **CV of gaps**: standard deviation over mean of the inter-arrival gaps (population std).
  A Poisson process has 1, a regular one 0, a bursty one more.
* **Index of dispersion** per window of `w` seconds: variance over mean of the arrival counts
  in the full windows ``[k*w, (k+1)*w)`` from time 0 up to the window holding the last arrival
  (that one is partial and left out). Poisson gives 1 at every `w`; it grows with `w` when
  bursts last longer than `w`. Needs two full windows, else None. **Peak rate** per window:
  the most arrivals in any window (the partial last one included) over `w`.
* **Prefix reuse**: the share of all prompt tokens lying in trace prefix blocks (of
  `prefix_block_tokens`, ids in `prefix_hashes`) whose chained id -- the block's id and
  every id before it, the key the KV cache shares blocks by (`testbed.core.kv.prefix_block_keys`)
  -- an earlier request already had. A cache of unlimited capacity that keeps every block
  would hit exactly these tokens, so it bounds any prefix cache's hit rate from above (a real
  one also misses evicted blocks and, as vLLM, recomputes a prompt's last token).
* **Sessions**: requests sharing a non-empty `session_id`; where requests carry a `parent_id`
  (a later turn names the request it follows), a request without a session id joins the
  session of its first ancestor, its root.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from typing import Iterable, Sequence

import numpy as np

from testbed.core.request import Request

WINDOWS_S = (1.0, 60.0)  # burstiness at one second (what a batch sees) and one minute (what autoscaling sees)
PERCENTILES = (50, 90, 99)
_VALUE = re.compile(r"'[^']*'|\"[^\"]*\"|[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def describe_requests(requests: Sequence[Request], rejected: Iterable[tuple[str, str]] = (),
                      windows_s: Sequence[float] = WINDOWS_S) -> dict:
    """Every statistic of the module's docstring, as a JSON-ready dict.

    `rejected` are the (field, reason) pairs of the rows the load set aside; they are counted
    by field and reason with the row's own values elided, so that one kind of fault is one line.
    """
    rejected = list(rejected)
    arrivals = np.fromiter((r.arrival for r in requests), dtype=np.float64, count=len(requests))
    return {
        "requests": len(requests),
        "rejected": len(rejected),
        "rejected_by_reason": reason_counts(rejected),
        **arrival_stats(arrivals, windows_s),
        "prompt_len": length_stats(np.fromiter((r.prompt_len for r in requests), np.int64, len(requests))),
        "output_len": length_stats(np.fromiter((r.output_len for r in requests), np.int64, len(requests))),
        "prefix": prefix_reuse(requests),
        "sessions": session_stats(requests),
    }


def reason_counts(rejected: Iterable[tuple[str, str]]) -> dict[str, int]:
    """``{"<field>: <reason with values as ...>": rows}``, most frequent first."""
    counts = Counter(f"{fld}: {_VALUE.sub('...', reason)}" for fld, reason in rejected)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def arrival_stats(arrivals: np.ndarray, windows_s: Sequence[float] = WINDOWS_S) -> dict:
    """Span, mean rate, the gaps' CV and, per window, counts' dispersion and the peak rate."""
    n = len(arrivals)
    first = float(arrivals[0]) if n else None
    last = float(arrivals[-1]) if n else None
    span = last - first if n else 0.0
    gaps = np.diff(arrivals)
    return {
        "first_arrival_s": first,
        "last_arrival_s": last,
        "span_s": span,
        "mean_rate": (n - 1) / span if span > 0 else None,  # arrivals per second between the first and the last
        "gap_cv": gap_cv(gaps),
        "zero_gap_share": float((gaps == 0).mean()) if gaps.size else None,  # arrivals sharing an instant
        "windows": [window_stats(arrivals, w) for w in windows_s],
    }


def gap_cv(gaps: np.ndarray) -> float | None:
    """The gaps' coefficient of variation (std / mean); None for fewer than two gaps or a mean <= 0.
    The gaps are first multiplied by the power of two that brings the largest into [0.5, 1): exact in
    binary floating point, and the CV is a ratio that no scale changes. Without it the squared
    deviations underflow for gaps of 1e-160 s and less (the CV lost digits, and was 0 for gaps of
    1e-200 s) and overflow for gaps above 1e154 s; with it, stretching time by a power of two gives
    the same CV to the bit (tests/test_trace_describe.py)."""
    if gaps.size < 2:
        return None
    top = float(np.abs(gaps).max())
    if not top > 0:
        return None
    unit = np.ldexp(gaps, -math.frexp(top)[1])  # top / 2**e lies in [0.5, 1)
    mean = float(unit.mean())
    return float(unit.std()) / mean if mean > 0 else None


def window_counts(arrivals: np.ndarray, window_s: float) -> np.ndarray:
    """Arrivals in each window ``[k*w, (k+1)*w)`` from 0 to the one holding the last arrival."""
    if not (math.isfinite(window_s) and window_s > 0):
        raise ValueError(f"window_s={window_s!r}: a window must be a finite number of seconds > 0")
    if not len(arrivals):
        return np.zeros(0, dtype=np.int64)
    return np.bincount(np.floor(arrivals / window_s).astype(np.int64))


def window_stats(arrivals: np.ndarray, window_s: float) -> dict:
    counts = window_counts(arrivals, window_s)
    full = counts[:-1]  # the last window holds the last arrival and is cut there
    mean = float(full.mean()) if full.size else 0.0
    return {
        "window_s": float(window_s),
        "full_windows": int(full.size),
        "mean_count": mean if full.size else None,
        "dispersion": float(full.var()) / mean if full.size >= 2 and mean > 0 else None,
        "peak_rate": float(counts.max()) / window_s if counts.size else None,
    }


def length_stats(lengths: np.ndarray) -> dict:
    """Mean, p50/p90/p99 (linear interpolation, as numpy's default) and max of token counts."""
    if not lengths.size:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    return {"mean": float(lengths.mean()),
            **{f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(lengths, PERCENTILES))},
            "max": int(lengths.max())}


def prefix_reuse(requests: Sequence[Request]) -> dict:
    """The share of prompt tokens in trace prefix blocks an earlier request had (module docstring)."""
    seen: set[int] = set()
    reused = hashed = with_hashes = 0
    for r in requests:
        if not r.prefix_hashes:
            continue
        with_hashes += 1
        size, key, keys = r.prefix_block_tokens, 0, []
        for i, h in enumerate(r.prefix_hashes):
            tokens = min(size, r.prompt_len - i * size)
            if tokens <= 0:
                break
            key = hash((key, h))  # chained as testbed.core.kv.prefix_block_keys chains the trace's ids
            keys.append(key)
            hashed += tokens
            if key in seen:
                reused += tokens
        seen.update(keys)  # seen *before*: a request never reuses its own blocks
    prompt = sum(r.prompt_len for r in requests)
    sizes = sorted({r.prefix_block_tokens for r in requests if r.prefix_hashes})
    return {
        "requests_with_hashes": with_hashes,
        "block_tokens": sizes[0] if len(sizes) == 1 else sizes or None,
        "hashed_token_share": hashed / prompt if prompt else 0.0,
        "reused_tokens": reused,
        "reuse_share": reused / prompt if prompt else 0.0,
        "distinct_blocks": len(seen),
    }


def _parent(r: Request):
    """The request this one follows, where the Request record has `parent_id` and it is set."""
    p = getattr(r, "parent_id", None)
    return None if p is None or p == "" or (isinstance(p, int) and p < 0) else p


def session_keys(requests: Sequence[Request]) -> list[object | None]:
    """Each request's session: its session id, else its root's (through `parent_id`), else the
    root itself when it has descendants; None for a request in no session. A chain whose first
    turn is not among the requests (a time window cut it off) is rooted at that missing parent."""
    by_id = {r.id: r for r in requests}
    parents = {r.id: _parent(r) for r in requests}

    def root(rid):
        for _ in range(len(by_id)):  # at most one hop per request: a cycle in a broken trace stops here
            parent = parents[rid]
            if parent is None:
                break
            if parent not in by_id:
                return ("outside", parent)
            rid = parent
        return rid

    tops = {r.id: root(r.id) for r in requests if parents[r.id] is not None}
    roots = set(tops.values())
    keys = []
    for r in requests:
        top = tops.get(r.id, r.id if r.id in roots else None)
        sid = r.session_id or (by_id[top].session_id if top in by_id else "")
        keys.append(("session", sid) if sid else ("root", top) if top is not None else None)
    return keys


def session_stats(requests: Sequence[Request]) -> dict:
    """How many sessions, how many requests in them, and turns (requests) per session."""
    turns = Counter(k for k in session_keys(requests) if k is not None)
    counts = np.fromiter(turns.values(), dtype=np.int64, count=len(turns))
    return {
        "sessions": len(turns),
        "requests_in_sessions": int(counts.sum()),
        "requests_with_parent": sum(_parent(r) is not None for r in requests),
        "turns": length_stats(counts),
    }
