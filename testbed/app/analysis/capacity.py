"""The highest load a policy sustains under an SLO (DistServe's goodput definition).

Load is the trace's own arrival process scaled by `trace.rate_scale`; the answer is the
largest scale at which at least `slo.attainment_target` of all requests meet every SLO,
found by bisection in log space (attainment falls as load rises; where it is not
monotone, the search still returns a scale that met the target, and the curve it
walked is reported so the reader can see).

A search can be stopped (SIGINT/SIGTERM, `app/entry/stop.py`): the evaluation under way ends early
(`SearchStopped`: a partial run says nothing of its load), and the search returns what it had,
marked `interrupted`: the largest scale that met the target so far is a lower bound.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class CapacitySearch:
    target: float
    best_scale: float | None  # the largest scale seen that met the target (None: even `lo` failed)
    bracketed: bool  # False when `hi` itself met the target: the true capacity may be higher
    curve: list[tuple[float, float]] = field(default_factory=list)  # (scale, attainment) in the order tried
    interrupted: bool = False  # stopped before its end: best_scale is the best so far (a lower bound)


class SearchStopped(Exception):
    """Raised by an `attainment` whose run was stopped early (its figure would be meaningless)."""


def bisect_max_scale(attainment: Callable[[float], float], target: float, lo: float = 0.25, hi: float = 8.0,
                     rel_tol: float = 0.02, max_evals: int = 16,
                     stop: Callable[[], bool] | None = None) -> CapacitySearch:
    """The search; `stop()` turning true (or `attainment` raising SearchStopped) ends it early, interrupted."""
    if not 0 < lo < hi:
        raise ValueError(f"capacity: need 0 < lo < hi, got lo={lo}, hi={hi}")
    if not 0 < rel_tol < 1:
        raise ValueError(f"capacity.rel_tol={rel_tol}: must be in (0, 1)")
    curve: list[tuple[float, float]] = []

    def meets(x: float) -> bool:
        if stop is not None and stop():
            raise SearchStopped
        a = attainment(x)
        curve.append((x, a))
        return a >= target

    good: float | None = None
    try:
        if meets(hi):
            return CapacitySearch(target, hi, False, curve)
        if not meets(lo):
            return CapacitySearch(target, None, True, curve)
        good, bad = lo, hi
        while bad / good > 1 + rel_tol and len(curve) < max_evals:
            mid = math.sqrt(good * bad)
            if meets(mid):
                good = mid
            else:
                bad = mid
    except SearchStopped:
        return CapacitySearch(target, good, good is not None, curve, interrupted=True)
    return CapacitySearch(target, good, True, curve)
