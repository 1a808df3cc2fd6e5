"""Wall-clock replay for `backend.scheduler=policy`: the testbed's step loop drives vLLM.

As the engine's replay (testbed/engine/replay.py), except that the step runs in vLLM: the
loop arrives requests, `engine.step()` calls the PolicyScheduler (which asks the loop to plan
and applies the plan in vLLM), and the loop completes the batch at the wall time the step
returned. The loop does all bookkeeping, so token times, ITL, preemptions and steps come out
as in the simulator; each step, vLLM's count of tokens produced is checked against the loop's.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

from testbed.core.loop import ReplayOutcome
from testbed.core.request import Request, Status
from testbed.core.wallclock import WallClockReplay
from testbed.vllm_backend.policy import PlanNotApplicable, PolicyBridge
from testbed.vllm_backend.replay import sampling_params


class PolicyReplay(WallClockReplay):
    def __init__(self, engine, bridge: PolicyBridge, requests: Sequence[Request],
                 prompt_tokens: Callable[[Request], list[int]], horizon_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        super().__init__(requests, horizon_s, clock, sleep)
        self.engine, self.bridge, self.prompt_tokens = engine, bridge, prompt_tokens
        bridge.clock = clock
        self.produced: dict[int, int] = {}  # tokens vLLM has returned, per testbed id
        # each step's (the loop's batch shape, engine.step() seconds, whole iteration seconds: arrivals +
        # step + complete), as EngineReplay.step_records, for testbed-fidelity's per-step error
        self.step_records: list = []
        self.step_cpu_s: list[float] = []  # this thread's CPU seconds over each recorded iteration

    def run(self, stop: Callable[[], bool] | None = None) -> ReplayOutcome:
        loop, bridge = self.bridge.loop, self.bridge
        t0 = bridge.t0 = self.clock()
        d = self._drive(stop, t0)
        if loop.has_work:
            self._abort()
            loop.abandon(f"stalled: policy {loop.policy_name!r} scheduled nothing and no arrivals were left"
                         if d.stalled else "interrupted" if d.interrupted else "unfinished at the horizon")
        return ReplayOutcome([loop], list(self.requests[d.delivered:]), d.end, d.stalled, d.interrupted)

    def _has_work(self) -> bool:
        return self.bridge.loop.has_work

    def _step(self, now: float, t0: float) -> bool:
        """One vLLM step (the PolicyScheduler asks the loop for the plan); False if it planned nothing."""
        started = self.clock() - t0
        outputs = self.engine.step()
        end = self.clock() - t0
        self._complete(outputs, end)
        batch = self.bridge.batch
        if batch is None:
            return False
        self.step_records.append((batch.shape, end - started, self.clock() - t0 - now))
        self.step_cpu_s.append(time.thread_time() - self.iteration_cpu0)
        return True

    def _arrive(self, req: Request, now: float) -> None:
        s = self.bridge.loop.arrive(req, now)
        if s.status is Status.REJECTED:
            return
        internal = self.engine.add_request(str(req.id), {"prompt_token_ids": self.prompt_tokens(req)},
                                           sampling_params(req))
        self.bridge.vllm_id[req.id] = internal
        self.bridge.testbed_id[internal] = req.id
        self.produced[req.id] = 0

    def _complete(self, outputs, end: float) -> None:
        for out in outputs:
            rid = int(out.request_id)
            self.produced[rid] += len(out.outputs[0].token_ids) if out.outputs else 0
        batch = self.bridge.batch
        if batch is None:
            if any(outputs):
                raise PlanNotApplicable("vLLM returned tokens from a step the testbed loop scheduled nothing in")
            return
        self.bridge.loop.complete(batch, end)
        for s, _ in batch.items:
            if self.produced[s.req.id] != s.num_generated:
                raise PlanNotApplicable(f"request {s.req.id}: vLLM produced {self.produced[s.req.id]} tokens, the "
                                        f"testbed loop counts {s.num_generated}")

    def _abort(self) -> None:
        live = [str(i) for i in self.bridge.loop.live]
        if live:
            self.engine.abort_request(live)
