"""FastServe's skip-join multi-level feedback queue (preemptive, per output token).

Source: Wu et al., "Fast Distributed Inference Serving for Large Language Models", 2023
(skip-join MLFQ, section 4.1).
Rule: level i has a quantum of `base_quantum * ratio**i` output tokens. A new request
skips to the first level whose quantum covers its prefill, counted in decode-iteration
equivalents (`ceil(prompt_len / prefill_tokens_per_iteration)`), instead of always
joining the top. Each step, all live requests (running and waiting) are ranked by (level,
arrival); the batch is filled in that order under the token budget, the sequence cap and
KV. A request that has used its level's quantum is demoted one level; one that has waited
more than `starvation_limit_s` since it was last served is promoted to the top level.
Running requests not chosen keep their KV (they are simply not scheduled) unless a chosen
running request cannot grow: then the lowest-ranked running requests are preempted, by
swapping their KV to host memory as FastServe's proactive KV management does
(`preemption_mode: swap`, while `kv.swap_space_gb` has room) or else by recompute. A
waiting request joins only into free KV: preempting running jobs by recompute to make room
for new ones thrashes under overload (68k preemptions on the Azure conv trace at 4x load,
7x longer). And waiting requests join strictly by rank: once one does not fit, none ranked
below it joins this step. Letting lower-ranked ones squeeze into the blocks left thrashed
too: a step later a running request needed those blocks and preempted the lowest-ranked,
often that newcomer or a demoted long job, which squeezed in again (1,925 preemptions, 21
of one request, against vllm's 221 on 1,000 Azure conv requests at 4x load with 400
blocks); it also made every step read the whole waiting queue (70 s for those 1,000
requests, minutes for 2,000).
The strict order costs some median for the tail: on Mooncake at 0.4x load (Llama-3.1-8B,
H100 roofline, `kv.swap_space_gb=256`) p50 TTFT went from 45 s to 124 s, p99 from 1,095 s
to 785 s, p99 TPOT from 8.1 s to 0.98 s, preemptions from 12,376 to 3,518.
With long prompts recompute preemption still thrashes, which is why the paper swaps: on
that run p50 TTFT is 1,909 s with no host swap space and 124 s with 256 GB (vllm: 39 s).
Choices: quanta count output tokens (the paper counts iterations, one token each);
a request's quantum use resets when it changes level. Because admissions and preemptions
interleave in one plan, a waiting request's KV cost counts its cached prefix in full (a
victim of the same plan may hold it, and reviving released blocks costs free ones).
Cost per step: proportional to the running requests and the waiting ones read before the
first misfit, not to the queue. Waiting requests are kept per level in arrival order and
merged with the running ones lazily; their only level change, starvation promotion, is
driven by a heap of last-service times (a waiting request generates nothing, so it is
never demoted, and is promoted at most once before it is served again).
Steady decode runs are fast-forwarded (`is_steady`, `steady_steps`): while every running
request decodes and the best-ranked waiting one does not fit, the plan only reorders as
requests use up quanta, until a running request falls behind that waiting one or a
starvation limit passes; the run stops there, and the level changes it skipped are booked
at the next plan.
"""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass
from operator import attrgetter

from testbed.policies._passes import StepBudget, preempt
from testbed.core.bounds import bounded
from testbed.core.plan import PREEMPT_MODES, SWAP, Plan
from testbed.core.policy import BasePolicy, PolicyKnobs, register
from testbed.core.request import Status


@dataclass
class FastServeKnobs(PolicyKnobs):
    name: str = "fastserve"
    base_quantum: int = bounded(8, ge=1)  # output tokens at the top level
    ratio: float = bounded(2.0, ge=1)  # quantum growth per level
    num_levels: int = bounded(6, ge=1)
    prefill_tokens_per_iteration: int = bounded(512, ge=1)  # prompt tokens that cost one decode iteration, for skip-join
    starvation_limit_s: float = bounded(5.0, ge=0)  # waited this long unserved: back to the top level (0 = never)
    preemption_mode: str = SWAP  # swap to host while kv.swap_space_gb has room, else recompute

    def __post_init__(self):
        super().__post_init__()
        if self.preemption_mode not in PREEMPT_MODES:
            raise ValueError(f"policy.preemption_mode={self.preemption_mode!r}: expected one of {PREEMPT_MODES}")


@register
class FastServePolicy(BasePolicy):
    name = "fastserve"
    Knobs = FastServeKnobs

    def __init__(self, knobs=None):
        super().__init__(knobs)
        k = self.knobs
        self.quanta = [k.base_quantum * k.ratio ** i for i in range(k.num_levels)]
        self.level: dict[int, int] = {}
        self.entered_at: dict[int, int] = {}  # num_generated when the request entered its level
        self.served: dict[int, float] = {}  # when it was last scheduled (arrival until then)
        # waiting (and swapped) requests, per level, as sorted (arrival, id, state) entries
        self.queued: list[list] = [[] for _ in self.quanta]
        # (last served, id, state) of waiting requests, for starvation promotion; stale entries skipped
        self.unserved: list = []
        self._admitting = True  # within schedule(): no waiting request has failed to fit yet
        self._quantum_steps = [math.ceil(q) for q in self.quanta]  # tokens a level's quantum lasts
        # the fast-forwarded run `steady_steps` last allowed, settled at the next plan:
        # (steps done before it, its steps, when its last step started, its requests)
        self._run: tuple | None = None

    def on_arrival(self, s, view) -> None:
        iterations = math.ceil(s.req.prompt_len / self.knobs.prefill_tokens_per_iteration)
        level = next((i for i, q in enumerate(self.quanta) if q >= iterations), len(self.quanta) - 1)
        self.level[s.req.id], self.entered_at[s.req.id], self.served[s.req.id] = level, 0, s.req.arrival
        self._enqueue(s)

    def on_finish(self, s, view) -> None:
        for d in (self.level, self.entered_at, self.served):
            d.pop(s.req.id, None)

    def _enqueue(self, s) -> None:
        rid = s.req.id
        bisect.insort(self.queued[self.level[rid]], (s.req.arrival, rid, s))
        if self.knobs.starvation_limit_s:
            heapq.heappush(self.unserved, (self.served[rid], rid, s))

    def _dequeue(self, s) -> None:
        q = self.queued[self.level[s.req.id]]
        del q[bisect.bisect_left(q, (s.req.arrival, s.req.id))]

    def _promote_starving(self, now: float) -> None:
        """The level update of waiting requests, touching only those whose time has come: a
        waiting request generates nothing (no demotion) and is promoted at most once before
        it is served again."""
        limit, heap = self.knobs.starvation_limit_s, self.unserved
        while limit and heap and now - heap[0][0] > limit:
            served, rid, s = heapq.heappop(heap)
            if self.served.get(rid) != served or s.status is Status.RUNNING or not self.level[rid]:
                continue  # served since, finished, running (ranked each step), or at the top already
            self._dequeue(s)
            self.level[rid], self.entered_at[rid] = 0, s.num_generated
            bisect.insort(self.queued[0], (s.req.arrival, rid, s))

    # --- fast-forwarded decode runs ----------------------------------------------------------
    def _head(self):
        """The best-ranked waiting request: the only one a steady plan tries (and fails) to admit."""
        for q in self.queued:
            if q:
                return q[0][2]
        return None

    def is_steady(self, view) -> bool:
        """Every running request decoded and nobody joined: the plan repeats while the best-ranked
        waiting request (if any) still does not fit. Its KV need is the blocks of its whole known
        sequence whenever the budget left at its turn covers it (so no prefix hit or rank order can
        change it), and the free blocks at its turn only shrink as the running requests grow, as long
        as no running request falls behind it in rank: `steady_steps` cuts the run there, and where a
        level changes by time (starvation promotion)."""
        head = self._head()
        return head is None or head.known_len <= view.token_budget - len(view.running)

    def steady_steps(self, view, ends: list[float]) -> int:
        """How many of the run's steps (step i + 1 starts at ends[i - 1]) keep this plan: up to the
        first whose plan would promote a request for starvation, or see a running request demoted
        behind the best-ranked waiting one. Demotions that only reorder the running requests keep
        the plan (the same requests, one token each); `_settle_run` books them afterwards."""
        m = len(ends)
        limit = self.knobs.starvation_limit_s
        if limit:
            prev = view.now  # start of the step before the one planned at ends[i]
            for i in range(m - 1):
                if ends[i] - prev > limit:  # `_running_levels` would promote its running requests
                    m = i + 1
                    break
                prev = ends[i]
            served = self._first_starving()
            if served is not None:
                for i in range(m - 1):
                    if ends[i] - served > limit:  # `_promote_starving` would promote a waiting request
                        m = i + 1
                        break
        head = self._head()
        if head is not None:
            m = min(m, self._steps_before_passed(view, head))
        self._run = (view.steps_done, m, ends[m - 2], list(view.running)) if m > 1 else None
        return m

    def _first_starving(self) -> float | None:
        """When the first waiting request `_promote_starving` would promote was last served
        (entries it would skip are dropped now; they stay stale)."""
        heap = self.unserved
        while heap:
            served, rid, s = heap[0]
            if self.served.get(rid) == served and s.status is not Status.RUNNING and self.level[rid]:
                return served
            heapq.heappop(heap)
        return None

    def _steps_before_passed(self, view, head) -> int:
        """The steps before a plan in which some running request ranked ahead of `head` is
        demoted behind it (its quantum use counts the tokens the run generates)."""
        top = len(self.quanta) - 1
        lw, w = self.level[head.req.id], _rank(head)
        steps = float("inf")
        for s in view.running:
            rid = s.req.id
            level = self.level[rid]
            if (level, _rank(s)) > (lw, w):
                continue  # behind it already: demotions keep it there
            target = lw + 1 if _rank(s) < w else lw  # the level that puts it behind
            if target > top:
                continue
            g = self.entered_at[rid]
            while level < target:  # demoted when its tokens at a plan reach entered + quantum
                g += self._quantum_steps[level]
                level += 1
            steps = min(steps, g - s.num_generated)
        return steps

    def _settle_run(self, view) -> None:
        """Book the plans a fast-forwarded run skipped: each of its requests was served at the
        start of every step, and demoted at each plan whose tokens used up its quantum."""
        run, self._run = self._run, None
        if run is None:
            return
        steps_done, steps, last_start, states = run
        if view.steps_done != steps_done + steps:
            return  # the loop did not merge the run (KV or clock), or cut it shorter
        top = len(self.quanta) - 1
        level_of, entered_at, served, quantum_steps = self.level, self.entered_at, self.served, self._quantum_steps
        for s in states:
            if s.status is not Status.RUNNING:
                continue  # finished at the end of the run
            rid = s.req.id
            level, entered = level_of[rid], entered_at[rid]
            last = s.num_generated - 1  # its tokens when the run's last step was planned
            while level < top and entered + quantum_steps[level] <= last:
                entered += quantum_steps[level]
                level += 1
            level_of[rid], entered_at[rid], served[rid] = level, entered, last_start

    def _candidates(self, running_levels: list[list]):
        """Live requests in rank order (level, arrival, id), merged level by level so a step
        reads only as far into the waiting queues as it admits. Once a waiting request did not
        fit (`_admitting` is False), only running requests are yielded."""
        for level, running in enumerate(running_levels):
            queue = self.queued[level]
            if not queue or not self._admitting:
                yield from running
                continue
            i, last = 0, len(running)
            for arrival, rid, w in queue:
                key = (arrival, rid)
                while i < last and (running[i].req.arrival, running[i].req.id) < key:
                    yield running[i]
                    i += 1
                yield w
                if not self._admitting:
                    break
            yield from running[i:]

    def _running_levels(self, view, now: float) -> list[list]:
        """Running requests per level, each level in rank order, after this step's level
        changes: demoted one level once a request has used its level's quantum, promoted to
        the top once unserved for `starvation_limit_s` (its quantum use restarts with either).
        Inlined: it runs for every running request at every plan."""
        quanta, top = self.quanta, len(self.quanta) - 1
        level_of, entered_at, served = self.level, self.entered_at, self.served
        limit = self.knobs.starvation_limit_s
        running_levels = [[] for _ in quanta]
        for s in view.running:
            rid = s.req.id
            level = level_of[rid]
            generated = s.num_generated
            if level < top and generated - entered_at[rid] >= quanta[level]:
                level += 1
                entered_at[rid] = generated
            if limit and level and now - served[rid] > limit:
                level = 0
                entered_at[rid] = generated
            level_of[rid] = level
            running_levels[level].append(s)
        for running in running_levels:
            if len(running) > 1:
                running.sort(key=_rank)
        return running_levels

    def schedule(self, view) -> Plan:
        now = view.now
        if self._run is not None:
            self._settle_run(view)
        self._promote_starving(now)
        running_levels = self._running_levels(view, now)
        running_by_rank = [s for running in running_levels for s in running]
        plan = Plan()
        b = StepBudget.of(view)  # host blocks, for swap preemption; the rest is kept in locals
        tokens, free, seqs, max_seqs = b.tokens, b.free_blocks, 0, view.max_num_seqs
        bs, served, mode = view.block_size, self.served, self.knobs.preemption_mode
        reached = 0  # running requests reached so far; running_by_rank[reached:] may be preempted
        preempted, admitted = [], []
        items = plan.items
        self._admitting = True
        # Once per running request per step: a running request's `remaining` and
        # `view.blocks_needed` (kv.blocks_needed's arithmetic) are inlined, as in _passes.run_running.
        for s in self._candidates(running_levels):
            if tokens <= 0 or seqs >= max_seqs:
                break
            status = s.status
            if status is _RUNNING:
                if reached >= len(running_by_rank):
                    continue  # preempted by this plan (victims come off the end of the rank order)
                reached += 1
                n = s.req.prompt_len + s.num_generated - s.num_computed
                if n > tokens:
                    n = tokens
                need = -(-(s.num_computed + n) // bs) - len(s.blocks)
                if need < 0:
                    need = 0
            else:
                n = min(view.num_new_tokens(s), tokens)
                if status is _SWAPPED:
                    need = view.blocks_needed(s, n)  # a swapped request brings all its blocks back
                else:  # a victim of this very plan may hold its cached prefix, which then costs free
                    # blocks to revive: count the whole prefix (an upper bound; exact without sharing)
                    need = -(-(view.prefix_hit_tokens(s) + n) // bs)
                if need > free:
                    # new work joins only into free KV (preempting running jobs for it thrashes),
                    # and by rank: none joins ahead of a higher-ranked one that does not fit
                    self._admitting = False
                    continue
            # victims: the lowest-ranked running requests not reached (so neither chosen nor s)
            while need > free and len(running_by_rank) > reached:
                victim = running_by_rank.pop()
                preempt(plan, victim, mode, b)
                preempted.append(victim)
                free += view.reclaimable_blocks(victim)
            if need > free:
                break
            items.append((s, n))  # plan.schedule(s, n)
            if status is not _RUNNING:
                admitted.append(s)
            tokens -= n
            free -= need
            seqs += 1
            served[s.req.id] = now
        for s in admitted:  # the loop applies the plan as returned (or stops the run)
            self._dequeue(s)
        for s in preempted:
            self._enqueue(s)
        return plan


_RUNNING, _SWAPPED = Status.RUNNING, Status.SWAPPED
_rank = attrgetter("req.arrival", "req.id")  # rank within a level: (arrival, id)
