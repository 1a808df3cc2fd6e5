"""Power of two choices: two distinct replicas drawn at random, the less loaded wins (the first
drawn on a tie).

Mitzenmacher's rule, SGLang model gateway's `power_of_two` policy (lightseekorg/smg
model_gateway/src/policies/power_of_two.rs L49-54: two distinct indices, the second offset from
the first; L90-91: the lower load wins, the first on a tie), which compares KV token usage
when the engines report it and request counts otherwise (`load`: outstanding | kv_usage).
Nearly as even as least outstanding, but without reading every replica: with many routers
sharing stale load counts it avoids the herd a global minimum attracts. The draws come from
a generator seeded with `seed` (the run's `${seed}`), so a run repeats exactly."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from testbed.core.bounds import bounded
from testbed.core.request import Request
from testbed.core.router import BaseRouter, ReplicaView, RouterKnobs, register_router

LOADS = ("outstanding", "kv_usage")


@dataclass
class PowerOfTwoKnobs(RouterKnobs):
    name: str = "power_of_two"
    seed: int = bounded(0, ge=0)  # seeds the draws
    load: str = "outstanding"  # outstanding (unfinished requests) | kv_usage (used share of the KV blocks)

    def __post_init__(self):
        super().__post_init__()
        if self.load not in LOADS:
            raise ValueError(f"router.load={self.load!r}: expected one of {', '.join(LOADS)}")


@register_router
class PowerOfTwo(BaseRouter):
    name = "power_of_two"
    Knobs = PowerOfTwoKnobs

    def __init__(self, knobs: PowerOfTwoKnobs | None = None):
        super().__init__(knobs)
        self._rng = random.Random(self.knobs.seed)
        self._load = (lambda r: r.outstanding) if self.knobs.load == "outstanding" else (lambda r: r.kv_usage)

    def route(self, req: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        n = len(replicas)
        if n == 1:
            return 0
        i = self._rng.randrange(n)
        j = (i + 1 + self._rng.randrange(n - 1)) % n
        return i if self._load(replicas[i]) <= self._load(replicas[j]) else j
