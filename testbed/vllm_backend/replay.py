"""Wall-clock trace replay against a vLLM engine, recorded as the testbed's own types.

Arrivals are handed to vLLM (`add_request`) when the wall clock passes their trace time;
`engine.step()` runs one scheduler step and one forward; a token's time is when the step
that produced it returned. Each request is a `RequestState` (status, first scheduled,
token times, preemptions, prefix hits) and each step a row of a `StepSeries`, from the
scheduler's log, so `testbed.app.assembly.run_setup.finish()` turns a vLLM run into the same files as the
simulator's and the engine's. Every output length is fixed: max_tokens = min_tokens =
output_len with ignore_eos, greedy.

A request whose prompt + output exceeds max_model_len is rejected here with the testbed's
`too-long` reason (vLLM would raise on add_request); one that can never fit in the KV
cache, with `exceeds-kv` (vLLM would wait on it forever).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from testbed.core.cost import BatchShape
from testbed.core.loop import ReplayOutcome, StepSeries, record_token, reject_reason
from testbed.core.request import Request, RequestState, Status
from testbed.core.wallclock import WallClockReplay
from testbed.vllm_backend.recording import SchedulerLog, StepDecision, shape_of


@dataclass
class KVStats:
    """The KV figures `finish()` reads from a loop's BlockManager."""

    num_blocks: int
    block_size: int
    hit_tokens: int = 0  # prefix-cache hits over admissions (vLLM's, incl. a preempted request's own blocks)
    queried_tokens: int = 0  # known tokens (prompt + output so far) looked up, over admissions

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)


@dataclass
class VLLMRun:
    """A vLLM replay in the shape of a StepLoop as `finish()` reads it: states, itl, series, kv."""

    kv: KVStats
    states: list[RequestState] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    series: StepSeries = field(default_factory=StepSeries)

    def arrive(self, req: Request, now: float, max_model_len: int, record_token_times: bool) -> RequestState:
        """The arriving request's state, kept; rejected at once (REJECTED, with the reason) when it can never
        be served: longer than the context or than the whole cache (vLLM would raise, or wait forever)."""
        s = RequestState(req)
        self.states.append(s)
        if record_token_times:
            s.token_times = []
        reason = reject_reason(req, max_model_len, self.kv)
        if reason:
            s.status, s.reject_reason, s.finish_time = Status.REJECTED, reason, now
        return s


def sampling_params(req: Request):
    """Exactly the trace's output length, greedy; each step's output holds only its new tokens."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=req.output_len, min_tokens=req.output_len, ignore_eos=True,
                          temperature=0.0, output_kind=RequestOutputKind.DELTA)


class VLLMReplay(WallClockReplay):
    def __init__(self, engine, log: SchedulerLog, requests: Sequence[Request],
                 prompt_tokens: Callable[[Request], list[int]], max_model_len: int,
                 horizon_s: float | None = None, record_token_times: bool = False,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        super().__init__(requests, horizon_s, clock, sleep)
        self.engine, self.log = engine, log
        self.prompt_tokens, self.max_model_len = prompt_tokens, max_model_len
        self.record_token_times = record_token_times
        self.run_record = VLLMRun(KVStats(log.num_blocks, log.block_size))
        self.by_id: dict[str, RequestState] = {}  # vLLM's internal id and our external id -> state
        self.live: dict[int, RequestState] = {}
        self.delivered: list[tuple[float, Request]] = []  # (seconds since start, request) as handed to vLLM
        self.decisions: list[StepDecision] = []  # every step, for the referee
        self.output_ids: dict[int, list[int]] = {}  # the tokens vLLM generated, per request
        # each step's (batch shape, vLLM's step: schedule() to the step's return, whole iteration: arrivals +
        # step + recording), as EngineReplay.step_records (shape, execute() seconds, iteration seconds)
        self.step_records: list[tuple[BatchShape, float, float]] = []
        # this thread's CPU seconds over each recorded iteration (torch on one thread runs the forward here):
        # well below the iteration's wall time, another process had the core (testbed-fidelity reports it)
        self.step_cpu_s: list[float] = []

    def run(self, stop: Callable[[], bool] | None = None) -> ReplayOutcome:
        t0 = self.clock()
        self.log.steps.clear()
        d = self._drive(stop, t0)
        reason = "interrupted" if d.interrupted else "unfinished at the horizon"
        for s in self.live.values():
            s.reject_reason = reason
        if self.live:
            self.engine.abort_request([str(i) for i in self.live])
        self.live.clear()
        return ReplayOutcome([self.run_record], list(self.requests[d.delivered:]), d.end, False, d.interrupted)

    def _has_work(self) -> bool:
        return bool(self.live)

    def _step(self, now: float, t0: float) -> bool:
        """One vLLM step (its own scheduler decides), recorded; vLLM always makes progress here."""
        known = len(self.step_records)
        outputs = self.engine.step()
        self._record(outputs, self.clock() - t0, t0)
        if len(self.step_records) > known:  # the whole iteration, as EngineReplay's: arrivals + step + record
            shape, step_s, _ = self.step_records[-1]
            self.step_records[-1] = (shape, step_s, self.clock() - t0 - now)
            self.step_cpu_s += [float("nan")] * (len(self.step_records) - known - 1)
            self.step_cpu_s.append(time.thread_time() - self.iteration_cpu0)
        return True

    def _arrive(self, req: Request, now: float) -> None:
        self.delivered.append((now, req))
        s = self.run_record.arrive(req, now, self.max_model_len, self.record_token_times)
        if s.status is Status.REJECTED:
            return
        internal = self.engine.add_request(str(req.id), {"prompt_token_ids": self.prompt_tokens(req)},
                                           sampling_params(req),
                                           priority=req.priority)  # read under --scheduling-policy priority only
        self.by_id[internal] = self.by_id[str(req.id)] = s
        self.live[req.id] = s

    def _record(self, outputs, end: float, t0: float) -> None:
        """One engine step: the scheduler's log rows into the series and the states, then the tokens."""
        rec, by_id = self.run_record, self.by_id
        series = rec.series
        logs, self.log.steps[:] = list(self.log.steps), []
        for i, step in enumerate(logs):
            start = step.start - t0
            stop = logs[i + 1].start - t0 if i + 1 < len(logs) else end
            series.start.append(start)
            series.duration.append(stop - start)
            if step.tokens:
                self.step_records.append((shape_of(step), stop - start, stop - start))  # run() sets the iteration
            series.prefill_tokens.append(sum(n for rid, n in step.tokens.items() if rid not in step.decodes))
            series.decode_tokens.append(len(step.decodes))
            series.running.append(step.running)
            series.waiting.append(step.waiting)
            series.kv_used_blocks.append(step.kv_used_blocks)
            series.preemptions.append(len(step.preempted))
            series.steps.append(1)
            self.decisions.append(StepDecision(start, stop, {by_id[rid].req.id: n for rid, n in step.tokens.items()},
                                               [by_id[rid].req.id for rid in step.preempted], len(self.delivered)))
            for rid in step.preempted:
                s = by_id[rid]
                s.num_preemptions += 1
                s.status = Status.WAITING
            for rid, (hit, known) in step.admitted.items():
                s = by_id[rid]
                s.status = Status.RUNNING
                if s.first_scheduled < 0:
                    s.first_scheduled = start
                s.prefix_hit_tokens += hit
                rec.kv.hit_tokens += hit
                rec.kv.queried_tokens += known
        for out in outputs:
            s = by_id[out.request_id]
            ids = out.outputs[0].token_ids if out.outputs else []
            self.output_ids.setdefault(s.req.id, []).extend(ids)
            for _ in ids:
                record_token(s, end, rec.itl)
            if out.finished:
                s.status, s.finish_time = Status.FINISHED, end
                del self.live[s.req.id]
