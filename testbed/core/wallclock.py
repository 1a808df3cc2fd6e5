"""Replaying a trace on the wall clock: the part every real backend shares.

Arrivals are handed over when the wall clock passes their trace time (none at or after the
horizon); a step runs whenever there is work; with none, the replay sleeps until the next
arrival, in 0.1 s slices when it can be stopped (a signal does not cut a sleep short). A stop
(`stop()`, checked between steps and while waiting) or a KeyboardInterrupt ends it cleanly.
Our engine (testbed/engine/replay.py) and real vLLM (testbed/vllm_backend/) subclass it and say
what arriving and stepping mean; each then closes the run its own way.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from testbed.core.request import Request


@dataclass
class Driven:
    """How a wall-clock replay ended."""

    delivered: int  # requests handed over (the rest never arrived)
    end: float  # seconds since the start
    stalled: bool  # work was left, the backend made no progress and nothing else would arrive
    interrupted: bool


class WallClockReplay:
    def __init__(self, requests: Sequence[Request], horizon_s: float | None,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        self.requests = requests
        self.horizon = horizon_s if horizon_s is not None else float("inf")
        self.clock, self.sleep = clock, sleep
        self.iteration_cpu0 = 0.0  # this thread's CPU time when the current iteration began

    # what a backend says ------------------------------------------------------------------
    def _arrive(self, req: Request, now: float) -> None:
        raise NotImplementedError

    def _has_work(self) -> bool:
        raise NotImplementedError

    def _step(self, now: float, t0: float) -> bool:
        """Run one step begun at `now` (seconds since `t0`); False when nothing could run."""
        raise NotImplementedError

    # the replay ---------------------------------------------------------------------------
    def _drive(self, stop: Callable[[], bool] | None, t0: float) -> Driven:
        reqs, horizon = self.requests, self.horizon
        delivered = 0
        stalled = interrupted = False
        try:
            while True:
                if stop is not None and stop():
                    interrupted = True
                    break
                now = self.clock() - t0
                self.iteration_cpu0 = time.thread_time()
                while delivered < len(reqs) and reqs[delivered].arrival <= now and reqs[delivered].arrival < horizon:
                    self._arrive(reqs[delivered], now)
                    delivered += 1
                if now >= horizon:
                    break
                if self._has_work() and self._step(now, t0):
                    continue
                if delivered >= len(reqs) or reqs[delivered].arrival >= horizon:
                    stalled = self._has_work()
                    break
                wait = max(0.0, min(reqs[delivered].arrival, horizon) - (self.clock() - t0))
                if stop is None:
                    self.sleep(wait)
                else:
                    while wait > 0 and not stop():
                        self.sleep(min(wait, 0.1))
                        wait = min(reqs[delivered].arrival, horizon) - (self.clock() - t0)
        except KeyboardInterrupt:
            interrupted = True
        return Driven(delivered, self.clock() - t0, stalled, interrupted)
