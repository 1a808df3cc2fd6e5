"""Synthetic arrivals for load studies: Poisson, and Gamma for burstiness.

Lengths are either fixed or drawn (with replacement) from a real trace's requests, so a
synthetic load keeps a production length distribution while its arrival process and
rate are under the experimenter's control. Deterministic for a seed.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from testbed.request import Request

Lengths = tuple[int, int] | Sequence[Request]


def poisson(rate: float, *, n: int | None = None, duration: float | None = None, lengths: Lengths,
            seed: int = 0) -> list[Request]:
    """Exponential inter-arrival times at `rate` requests per second."""
    return gamma(rate, 1.0, n=n, duration=duration, lengths=lengths, seed=seed)


def gamma(rate: float, cv: float, *, n: int | None = None, duration: float | None = None, lengths: Lengths,
          seed: int = 0) -> list[Request]:
    """Gamma inter-arrival times with mean 1/rate and coefficient of variation `cv`
    (shape 1/cv^2); cv=1 is Poisson, cv>1 is burstier."""
    if rate <= 0:
        raise ValueError(f"trace.rate={rate}: must be > 0")
    if cv <= 0:
        raise ValueError(f"trace.cv={cv}: must be > 0")
    if (n is None) == (duration is None):
        raise ValueError("trace: give exactly one of num_requests and duration_s")
    if n is not None and n < 1:
        raise ValueError(f"trace.num_requests={n}: must be >= 1")
    if duration is not None and duration <= 0:
        raise ValueError(f"trace.duration_s={duration}: must be > 0")
    rng = np.random.default_rng(seed)
    shape = 1.0 / cv**2
    scale = 1.0 / (rate * shape)
    if n is not None:
        gaps = rng.gamma(shape, scale, n)
    else:
        chunks, total = [], 0.0
        while total < duration:
            chunk = rng.gamma(shape, scale, max(16, int(duration * rate * 1.2)))
            chunks.append(chunk)
            total += chunk.sum()
        gaps = np.concatenate(chunks)
    times = np.cumsum(gaps) - gaps[0]  # the first request arrives at 0
    if duration is not None:
        times = times[times < duration]
    count = len(times)
    if isinstance(lengths, tuple) and len(lengths) == 2 and all(isinstance(x, (int, np.integer)) for x in lengths):
        prompt, output = int(lengths[0]), int(lengths[1])
        if prompt < 1 or output < 1:
            raise ValueError(f"trace: fixed lengths must be >= 1, got prompt {prompt}, output {output}")
        pairs = [(prompt, output)] * count
    else:
        pool = np.array([(r.prompt_len, r.output_len) for r in lengths], dtype=np.int64)
        if not len(pool):
            raise ValueError("trace: the length distribution is empty")
        pairs = pool[rng.integers(0, len(pool), count)].tolist()
    return [Request(id=i, arrival=float(t), prompt_len=p, output_len=o, source=f"generated:{i}")
            for i, (t, (p, o)) in enumerate(zip(times, pairs))]
