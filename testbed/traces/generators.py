"""Synthetic arrivals for load studies: Poisson, and Gamma for burstiness.

Why: a recorded trace fixes both the arrival process and the rate; a load study needs to
turn those knobs one at a time. Lengths are either fixed or drawn with replacement from
a real trace's (prompt_len, output_len) pairs, so a synthetic load can keep a production
length distribution while its arrival process (Poisson, or Gamma with a chosen
coefficient of variation) and its rate are the experimenter's. Every draw comes from one
`numpy.random.Generator` seeded by `seed`, so the same arguments give the same requests,
bit for bit. The first request arrives at 0; request ids are 0..n-1.

`max_requests` bounds a `duration` run's generation (issue 25: a mistyped rate once drew every
arrival of the span before the cut): its arrivals are drawn as ``n=max_requests`` draws them and
those before `duration` kept, so when the cut falls inside the span the requests are exactly
``n=max_requests``'s, and memory is bounded by the cut, not by ``rate * duration``.
"""
from __future__ import annotations

import math
from numbers import Integral, Real
from collections.abc import Sequence
from typing import Union

import numpy as np

from testbed.core.request import Request
from testbed.traces.loaders import BEYOND_MAX_ARRIVAL, MAX_ARRIVAL_S, TraceLoad

# (prompt_len, output_len), or requests (e.g. a loaded trace) whose pairs are resampled
Lengths = Union[tuple[int, int], Sequence[Request], TraceLoad]


def poisson(rate: float, *, n: int | None = None, duration: float | None = None, lengths: Lengths,
            seed: int = 0, max_requests: int | None = None) -> list[Request]:
    """Poisson arrivals (exponential inter-arrival times, mean 1/`rate` seconds).

    Give exactly one of `n` (that many requests) or `duration` (every arrival in
    ``[0, duration)`` seconds; with `max_requests`, at most its first that many). Equal to
    ``gamma(rate, 1.0, ...)``, draw for draw.
    """
    return _generate("poisson", rate, 1.0, n, duration, lengths, seed, max_requests)


def gamma(rate: float, cv: float, *, n: int | None = None, duration: float | None = None, lengths: Lengths,
          seed: int = 0, max_requests: int | None = None) -> list[Request]:
    """Gamma inter-arrival times: mean 1/`rate`, coefficient of variation `cv` (shape 1/cv^2).

    cv=1 is Poisson; cv>1 is burstier (the Azure code trace has cv ~13), cv<1 more regular.
    Give exactly one of `n` or `duration` (and `max_requests`), as for `poisson`.
    """
    return _generate("gamma", rate, cv, n, duration, lengths, seed, max_requests)


def _length_pool(lengths: Lengths) -> tuple[np.ndarray | None, tuple[int, int] | None]:
    if isinstance(lengths, TraceLoad):
        lengths = lengths.requests
    if (isinstance(lengths, Sequence) and not isinstance(lengths, str) and len(lengths) == 2
            and all(isinstance(x, Integral) and not isinstance(x, bool) for x in lengths)):
        prompt, output = int(lengths[0]), int(lengths[1])
        if prompt < 1 or output < 1:
            raise ValueError(f"lengths=({prompt}, {output}): a prompt needs >= 1 token and a request generates "
                             f">= 1 token")
        return None, (prompt, output)
    try:
        pool = np.array([(r.prompt_len, r.output_len) for r in lengths], dtype=np.int64).reshape(-1, 2)
    except (TypeError, AttributeError):
        raise ValueError(f"lengths: expected (prompt_len, output_len) or a list of Requests, got {lengths!r:.80}") \
            from None
    if not len(pool):
        raise ValueError("lengths: the list of requests to sample lengths from is empty")
    return pool, None


def _generate(kind: str, rate: float, cv: float, n: int | None, duration: float | None, lengths: Lengths,
              seed: int, max_requests: int | None = None) -> list[Request]:
    if not (isinstance(rate, Real) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"{kind}: rate={rate!r} (trace.rate) must be a finite number > 0 requests per second")
    if not (isinstance(cv, Real) and math.isfinite(cv) and cv > 0):
        raise ValueError(f"{kind}: cv={cv!r} (trace.cv) must be a finite number > 0")
    if (n is None) == (duration is None):
        raise ValueError(f"{kind}: give exactly one of n (trace.num_requests) and duration (trace.duration_s)")
    if n is not None and not (isinstance(n, Integral) and not isinstance(n, bool) and n >= 1):
        raise ValueError(f"{kind}: n={n!r} (trace.num_requests) must be an integer >= 1")
    if duration is not None and not (isinstance(duration, Real) and math.isfinite(duration) and duration > 0):
        raise ValueError(f"{kind}: duration={duration!r} (trace.duration_s) must be a finite number > 0 seconds")
    if duration is not None and duration > MAX_ARRIVAL_S:
        raise ValueError(f"{kind}: duration={duration!r} (trace.duration_s) reaches {BEYOND_MAX_ARRIVAL}")
    if max_requests is not None and not (isinstance(max_requests, Integral) and not isinstance(max_requests, bool)
                                         and max_requests >= 1):
        raise ValueError(f"{kind}: max_requests={max_requests!r} (trace.max_requests) must be an integer >= 1")
    pool, fixed = _length_pool(lengths)

    rng = np.random.default_rng(seed)
    shape = 1.0 / cv**2
    scale = 1.0 / (rate * shape)  # mean gap = shape * scale = 1/rate
    if n is not None or max_requests is not None:
        gaps = rng.gamma(shape, scale, int(n if n is not None else max_requests))
        times = np.cumsum(gaps) - gaps[0]  # the first request arrives at 0
        if duration is not None:
            times = times[times < duration]
    else:
        chunk = max(64, int(duration * rate * 1.1))
        parts = [rng.gamma(shape, scale, chunk)]
        times = np.cumsum(parts[0]) - parts[0][0]
        while times[-1] < duration:
            parts.append(rng.gamma(shape, scale, chunk))
            times = np.concatenate([times, times[-1] + np.cumsum(parts[-1])])
        times = times[times < duration]
    count = len(times)
    if count and not times[-1] < MAX_ARRIVAL_S:
        raise ValueError(f"{kind}: rate={rate!r} (trace.rate) puts the last of {count} arrivals at {times[-1]:.3g} s, "
                         f"{BEYOND_MAX_ARRIVAL}")
    if fixed is not None:
        prompts, outputs = [fixed[0]] * count, [fixed[1]] * count
    else:
        pairs = pool[rng.integers(0, len(pool), count)]
        prompts, outputs = pairs[:, 0].tolist(), pairs[:, 1].tolist()
    return [Request(i, t, p, o, source=f"{kind}:{i}")
            for i, (t, p, o) in enumerate(zip(times.tolist(), prompts, outputs))]
