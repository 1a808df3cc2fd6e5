"""Real-time trace replay on the engine: the simulator's server process, on the wall clock.

Arrivals are delivered when the wall clock passes their trace time; the loop never
sleeps while work is waiting; a token's time is taken once its id is on the host (the
runner returns Python ints, which synchronises the device). Everything else (policy,
validation, KV accounting, metrics) is the shared step loop's, so a real run produces
the same files as a simulated one. A stop ends the replay cleanly: finished requests keep
their results, the rest are marked unfinished. It comes from `run(stop)` (checked between
steps and, sliced, while waiting for an arrival; the app raises it on SIGINT and SIGTERM)
or from a KeyboardInterrupt.
"""
from __future__ import annotations

import time
from array import array

try:
    import resource
except ImportError:  # not on Windows
    resource = None
from typing import Callable, Protocol, Sequence

from testbed.core.cost import BatchShape
from testbed.core.loop import Batch, ReplayOutcome, StepLoop
from testbed.core.request import Request, Status
from testbed.core.wallclock import WallClockReplay


def _minor_faults() -> int:
    """This thread's minor page faults so far (Linux); 0 where the OS cannot say."""
    if resource is None:
        return 0
    try:
        return resource.getrusage(_RUSAGE_THREAD).ru_minflt
    except (OSError, ValueError):
        return 0


_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF) if resource else 0


class StepRunner(Protocol):
    def execute(self, items, token_ids: dict[int, list[int]]) -> dict[int, int]: ...

    def swap_out(self, state, blocks: list[int]) -> None: ...

    def swap_in(self, state, blocks: list[int]) -> None: ...


class EngineReplay(WallClockReplay):
    def __init__(self, requests: Sequence[Request], loop: StepLoop, runner: StepRunner,
                 prompt_tokens: Callable[[Request], list[int]], horizon_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        super().__init__(requests, horizon_s, clock, sleep)
        self.loop, self.runner = loop, runner
        self.prompt_tokens = prompt_tokens
        self.tokens: dict[int, list[int]] = {}  # known token ids of every live request
        self.step_wall: list[float] = []  # measured seconds of each step's execute(), for calibration
        # each step's (batch shape, execute() seconds, whole iteration seconds: arrivals + plan + execute +
        # complete), so a cost model's prediction can be checked step by step (testbed-fidelity)
        self.step_records: list[tuple[BatchShape, float, float]] = []
        # this thread's CPU seconds over each recorded iteration: with one torch thread, a step whose wall
        # time exceeds it lost the core to another process (testbed-fidelity's `cpu_share`)
        self.step_cpu_s: list[float] = []
        self.generated: dict[int, list[int]] = {}  # output token ids of every finished request
        self._prompts: dict[int, array] = {}  # prompt token ids drawn before the replay, until their request arrives
        # minor page faults of this thread during each step's execute(): memory the step's buffers took from the
        # OS (the heap grown, or regrown after a trim), a cost a profile's repeated, warmed-up points never see
        self.step_faults: list[int] = []

    def run(self, stop: Callable[[], bool] | None = None) -> ReplayOutcome:
        loop = self.loop
        # Every prompt's token ids, drawn before the clock starts: a real server's engine receives them already
        # tokenized (vLLM's EngineCoreRequest.prompt_token_ids, from the API server process), so drawing them is
        # no step's work. Drawn in the step loop they cost 0.1-0.3 ms per arrival, charged to the prefill steps.
        self._prompts = {r.id: array("i", self.prompt_tokens(r)) for r in self.requests if r.arrival < self.horizon}
        t0 = self.clock()
        d = self._drive(stop, t0)
        if d.stalled:
            loop.abandon(f"stalled: policy {loop.policy_name!r} scheduled nothing and no arrivals were left")
        elif loop.has_work:
            loop.abandon("interrupted" if d.interrupted else "unfinished at the horizon")
        return ReplayOutcome([loop], list(self.requests[d.delivered:]), d.end, d.stalled, d.interrupted)

    def _has_work(self) -> bool:
        return self.loop.has_work

    def _step(self, now: float, t0: float) -> bool:
        batch = self.loop.plan(now)
        if batch is None:
            return False
        self._run(batch, t0, now)
        return True

    def _arrive(self, req: Request, now: float) -> None:
        s = self.loop.arrive(req, now)
        prompt = self._prompts.pop(req.id)
        if s.status is not Status.REJECTED:
            self.tokens[req.id] = prompt.tolist()

    def _run(self, batch: Batch, t0: float, now: float) -> None:
        runner = self.runner
        for s, blocks in batch.swap_out or ():
            runner.swap_out(s, blocks)
        for s, blocks in batch.swap_in or ():
            runner.swap_in(s, blocks)
        f0 = _minor_faults()
        start = self.clock()
        sampled = runner.execute(batch.items, self.tokens)
        end = self.clock()
        self.step_faults.append(_minor_faults() - f0)
        self.step_wall.append(end - start)
        tokens = self.tokens
        for rid, tok in sampled.items():
            tokens[rid].append(tok)
        self.loop.complete(batch, end - t0)
        for s, _ in batch.items:
            if s.status is Status.FINISHED:
                self.generated[s.req.id] = tokens.pop(s.req.id)[s.req.prompt_len:]
        self.step_records.append((batch.shape, end - start, self.clock() - t0 - now))
        self.step_cpu_s.append(time.thread_time() - self.iteration_cpu0)
