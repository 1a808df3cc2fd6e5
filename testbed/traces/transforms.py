"""Reshaping a trace without touching the file: load scaling, time windows, truncation, caps,
spreading coarse timestamps.

Why: one recorded trace serves many experiments (twice the load, the busiest ten
minutes, the first thousand requests, prompts cut to a model's context). Each transform
returns new `Request`s (`dataclasses.replace`) and never mutates its input, which other
runs may share. Ids and sources are kept, so a result still joins back to its trace row;
the ids of a transformed list are therefore unique but need not be contiguous.
Arguments are checked up front with errors that name the config key they come from.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from numbers import Integral, Real
from typing import Sequence

import numpy as np

from testbed.core.request import Request
from testbed.traces.errors import RejectedRow
from testbed.traces.loaders import BEYOND_MAX_ARRIVAL, MAX_ARRIVAL_S


def scale_rate(requests: Sequence[Request], factor: float) -> list[Request]:
    """Replay at `factor` times the load: every arrival time divided by `factor` (2 = twice
    as many requests per second; 0.5 = half). Order and lengths are unchanged."""
    if isinstance(factor, bool) or not isinstance(factor, Real) or not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"scale_rate: factor={factor!r} (trace.rate_scale) must be a finite number > 0")
    last = max((r.arrival for r in requests), default=0.0)
    if last / factor >= MAX_ARRIVAL_S:
        raise ValueError(f"scale_rate: factor={factor!r} (trace.rate_scale) would move the last arrival ({last:g} s) "
                         f"to {last / factor:.3g} s, {BEYOND_MAX_ARRIVAL}")
    return [dataclasses.replace(r, arrival=r.arrival / factor) for r in requests]


def time_window(requests: Sequence[Request], start_s: float, end_s: float = math.inf) -> list[Request]:
    """The requests arriving in ``[start_s, end_s)``, re-based by `start_s`.

    Re-basing by the window's start (not by the first kept arrival) keeps the idle gap
    at the window's start, so the window replays exactly as that stretch of the trace did:
    a request that arrived 3 s into the window arrives at 3 s. `end_s` may be infinite.
    """
    if isinstance(start_s, bool) or not isinstance(start_s, Real) or not (math.isfinite(start_s) and start_s >= 0):
        raise ValueError(f"time_window: start_s={start_s!r} (trace.start_s) must be a finite number >= 0")
    if isinstance(end_s, bool) or not isinstance(end_s, Real) or math.isnan(end_s) or not end_s > start_s:
        raise ValueError(f"time_window: end_s={end_s!r} (trace.end_s) must be a number > start_s={start_s!r}")
    return [dataclasses.replace(r, arrival=r.arrival - start_s) for r in requests if start_s <= r.arrival < end_s]


def first_n(requests: Sequence[Request], n: int) -> list[Request]:
    """The first `n` requests in list order (arrival order for a loaded trace); all if fewer."""
    if isinstance(n, bool) or not isinstance(n, Integral) or n < 1:
        raise ValueError(f"first_n: n={n!r} (trace.max_requests) must be an integer >= 1")
    return list(requests[:n])


def rejected_in_selection(rejected: Sequence[RejectedRow], loaded: Sequence[Request], kept: Sequence[Request],
                          start_s: float | None = None, end_s: float | None = None) -> list[RejectedRow]:
    """The rows a lenient load rejected that lie inside a selection of its requests.

    `loaded` are the requests as loaded (file order), `kept` those that `time_window`
    (``[start_s, end_s)``) and then `first_n` kept. Why: a run of 100 requests must not
    report the 2,000 bad rows of the whole file (its SLO attainment would read 0.048
    instead of 0.33). The rule, since a bad row may have no usable time:

    * a rejected row lies in the window by its own time when that is known
      (`RejectedRow.arrival`), else by its place in the file: after the last request
      that arrives before `start_s` and before the first that arrives at or after `end_s`;
    * when `first_n` cut the window's requests short, a rejected row after the last kept
      request in the file lies outside.

    Without a window or a cut every rejected row counts, as before.
    """
    if not rejected:
        return []
    start = -math.inf if start_s is None else start_s
    end = math.inf if end_s is None else end_s
    times = [r.arrival for r in loaded]
    first_in = bisect.bisect_left(times, start)  # arrivals are in order: the window is a run of requests
    first_after = bisect.bisect_left(times, end)
    lo = loaded[first_in - 1].id if first_in > 0 else -1
    hi = loaded[first_after].id if first_after < len(loaded) else math.inf
    cut = kept[-1].id if kept and len(kept) < first_after - first_in else math.inf
    return [r for r in rejected if r.id <= cut and
            (start <= r.arrival < end if r.arrival is not None else lo < r.id < hi)]


def cap_lengths(requests: Sequence[Request], max_prompt: int | None = None,
                max_output: int | None = None) -> list[Request]:
    """Clip prompt lengths to `max_prompt` and output lengths to `max_output` (None: no cap).

    Prefix hashes for blocks wholly beyond a clipped prompt are dropped, so they never
    describe tokens the request no longer has. Unchanged requests are returned as they are.
    """
    for key, v in (("max_prompt", max_prompt), ("max_output", max_output)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, Integral) or v < 1):
            raise ValueError(f"cap_lengths: {key}={v!r} (trace.{key}_len) must be None or an integer >= 1")
    out = []
    for r in requests:
        p = r.prompt_len if max_prompt is None else min(r.prompt_len, int(max_prompt))
        o = r.output_len if max_output is None else min(r.output_len, int(max_output))
        if p == r.prompt_len and o == r.output_len:
            out.append(r)
            continue
        keep = -(-p // r.prefix_block_tokens)
        # a session parent's ids over its answer (Request.hashes_span_output) no longer describe it
        out.append(dataclasses.replace(r, prompt_len=p, output_len=o, prefix_hashes=r.prefix_hashes[:keep],
                                       hashes_span_output=False))
    return out


SPREAD_MODES = ("none", "uniform", "poisson")


def detect_bucket_s(requests: Sequence[Request]) -> float:
    """The width of a trace's timestamp buckets: the median gap between its distinct arrival times.

    Why the median of the distinct times' gaps: a trace rounded to a grid has its distinct times
    one grid step apart wherever the load is steady (the Mooncake conversation trace's are
    0, 3000, 5999, 9000 ms: about 3 s, not exactly), an empty bucket makes one gap of two steps,
    and the median ignores both such outliers and the grid's jitter. A trace in which no two
    requests share a time has no buckets to detect: the caller must say the width.
    """
    times = sorted({r.arrival for r in requests})
    if len(times) < 2 or 2 * len(times) > len(requests):
        raise ValueError(f"spread_arrivals: {len(requests)} requests at {len(times)} distinct times: fewer than two "
                         f"a time on average (or a single time), so the timestamps do not look coarse and there are "
                         f"no buckets to detect; give trace.spread_bucket_s to spread them anyway")
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    return float(gaps[(len(gaps) - 1) // 2])


def spread_arrivals(requests: Sequence[Request], mode: str, bucket_s: float, seed: int = 0) -> list[Request]:
    """Spread the requests that share a coarse timestamp over the bucket that timestamp stands for.

    A trace whose times are rounded (the Mooncake conversation trace: about ten requests per
    3-s stamp) replays as a burst every bucket, a load no server saw. Each distinct time `t`
    is taken as the start of its bucket ``[t, t + bucket_s)``, cut short at the next distinct
    time when that comes sooner (a grid with jitter), and its requests are placed in it,
    in their order in the list (so the trace's order is kept):

    * ``uniform``: evenly, ``t + (i + u) * width / n`` for the i-th of n, one random phase
      ``u`` per bucket;
    * ``poisson``: as a Poisson process conditioned on n arrivals in the bucket, which puts
      them at n sorted independent uniform times (the order-statistics property of the
      Poisson process);
    * ``none``: unchanged.

    Every bucket keeps its count and every request stays in its bucket, at or after its
    recorded time. Draws come from a generator seeded by `seed` (the run's seed).
    """
    if mode not in SPREAD_MODES:
        raise ValueError(f"spread_arrivals: mode={mode!r} (trace.spread) must be one of {', '.join(SPREAD_MODES)}")
    if mode == "none":
        return list(requests)
    if isinstance(bucket_s, bool) or not isinstance(bucket_s, Real) or not (math.isfinite(bucket_s) and bucket_s > 0):
        raise ValueError(f"spread_arrivals: bucket_s={bucket_s!r} (trace.spread_bucket_s) must be a finite number > 0")
    times = [r.arrival for r in requests]
    if any(b < a for a, b in zip(times, times[1:])):
        raise ValueError("spread_arrivals: the arrivals are not in time order; spread a trace as loaded")
    rng = np.random.default_rng(seed)
    out: list[Request] = []
    i, n_all = 0, len(requests)
    while i < n_all:
        t = times[i]
        j = i
        while j < n_all and times[j] == t:
            j += 1
        width = min(float(bucket_s), times[j] - t) if j < n_all else float(bucket_s)
        n = j - i
        if mode == "uniform":
            offsets = (np.arange(n) + rng.random()) * (width / n)
        else:
            offsets = np.sort(rng.random(n)) * width
        # t + offset < t + width in exact arithmetic; rounding must not reach the next bucket either
        new = [min(t + float(o), math.nextafter(t + width, -math.inf)) for o in offsets]
        out.extend(dataclasses.replace(r, arrival=a) for r, a in zip(requests[i:j], new))
        i = j
    return out
