"""A vLLM V1 Scheduler subclass that logs every step it schedules, for `backend.scheduler=native`.

vLLM decides everything (its own `Scheduler.schedule()`, vllm/v1/core/sched/scheduler.py);
this only watches: after each `schedule()` it notes which requests got how many tokens,
how many requests it preempted (`_preempt_request`, the one place vLLM V1 preempts), the
running and waiting counts, the KV blocks in use, and each scheduled request's tokens computed
before the step (from which `shape_of` builds the step's BatchShape, for calibration). The replay reads the log after each
engine step. Built by `scheduler_class()` so that vLLM is imported only when the backend runs.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from testbed.core.cost import BatchShape, add_work


@dataclass
class StepLog:
    """What one vLLM `schedule()` call did, read before the model ran."""

    start: float  # perf_counter when schedule() began
    tokens: dict[str, int]  # vLLM request id -> tokens scheduled this step
    decodes: set[str]  # the ids whose one token is a decode (the prompt and outputs so far were computed)
    admitted: dict[str, tuple[int, int]]  # ids taken from waiting to running -> (prefix-cache hit tokens, known tokens)
    preempted: list[str]
    running: int
    waiting: int
    kv_used_blocks: int
    computed: dict[str, int] = field(default_factory=dict)  # id -> tokens computed before this step (cache hits included)


@dataclass
class StepDecision:
    """One vLLM step in testbed request ids, for the referee: what was decided, when, and
    how many of the trace's requests had been handed to vLLM before the step was planned."""

    start: float  # seconds since the replay began
    end: float
    tokens: dict[int, int]
    preempted: list[int]
    num_delivered: int


@dataclass
class SchedulerLog:
    """The log the scheduler writes and the replay drains (one per engine: a class attribute
    would be shared across runs in one process)."""

    steps: list[StepLog] = field(default_factory=list)
    num_blocks: int = 0  # usable KV blocks (the pool less vLLM's null block)
    block_size: int = 0


def used_blocks(scheduler) -> int:
    """KV blocks held by requests: vLLM's block pool less its free blocks and its null block
    (BlockPool.get_usage, vllm/v1/core/block_pool.py, counts the same way)."""
    pool = scheduler.kv_cache_manager.block_pool
    return pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()


def shape_of(step: StepLog) -> BatchShape:
    """The step's batch features, summed as the simulator's step loop sums them (`add_work`)."""
    shape = BatchShape()
    add_work(shape, ((step.computed.get(rid, 0), n, rid in step.decodes) for rid, n in step.tokens.items()))
    return shape


def scheduler_class(log: SchedulerLog):
    """A subclass of vLLM's V1 Scheduler that appends to `log` on every schedule()."""
    from vllm.v1.core.sched.scheduler import Scheduler

    class RecordingScheduler(Scheduler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._step_preempted: list[str] = []
            log.num_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks - 1
            log.block_size = self.block_size

        def _preempt_request(self, request, timestamp, *args, **kwargs):
            self._step_preempted.append(request.request_id)
            return super()._preempt_request(request, timestamp, *args, **kwargs)

        def schedule(self, *args, **kwargs):
            start = time.perf_counter()
            before = {r.request_id for r in self.running}
            self._step_preempted = []
            out = super().schedule(*args, **kwargs)
            tokens = dict(out.num_scheduled_tokens)
            if tokens or self._step_preempted:
                decodes, admitted, computed = set(), {}, {}
                for rid, n in tokens.items():
                    req = self.requests[rid]
                    computed[rid] = req.num_computed_tokens - n  # _update_after_schedule already advanced it
                    if n == 1 and req.num_output_tokens > 0 and computed[rid] + 1 == req.num_tokens:
                        decodes.add(rid)
                    if rid not in before:
                        admitted[rid] = (computed[rid], req.num_tokens)  # what the prefix cache gave it, of what it asked
                log.steps.append(StepLog(start, tokens, decodes, admitted, list(self._step_preempted),
                                         len(self.running), len(self.waiting), used_blocks(self), computed))
            return out

    return RecordingScheduler
