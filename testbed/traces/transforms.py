"""Reshaping a trace without touching the file: load scaling, time windows, truncation, caps.

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
