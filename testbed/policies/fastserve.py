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
7x longer). With long prompts recompute preemption still thrashes, which is why the paper
swaps: on Mooncake at 0.4x load (Llama-3.1-8B, H100 roofline), p50 TTFT is 3,173 s with no
host swap space and 45 s with `kv.swap_space_gb=256` (vllm: 39 s).
Choices: quanta count output tokens (the paper counts iterations, one token each);
a request's quantum use resets when it changes level. Because admissions and preemptions
interleave in one plan, a waiting request's KV cost counts its cached prefix in full (a
victim of the same plan may hold it, and reviving released blocks costs free ones).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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

    def on_arrival(self, s, view) -> None:
        iterations = math.ceil(s.req.prompt_len / self.knobs.prefill_tokens_per_iteration)
        level = next((i for i, q in enumerate(self.quanta) if q >= iterations), len(self.quanta) - 1)
        self.level[s.req.id], self.entered_at[s.req.id], self.served[s.req.id] = level, 0, s.req.arrival

    def on_finish(self, s, view) -> None:
        for d in (self.level, self.entered_at, self.served):
            d.pop(s.req.id, None)

    def _update_level(self, s, now: float) -> int:
        rid = s.req.id
        level = self.level[rid]
        if s.num_generated - self.entered_at[rid] >= self.quanta[level] and level + 1 < len(self.quanta):
            level += 1
            self.entered_at[rid] = s.num_generated
        limit = self.knobs.starvation_limit_s
        if limit and level and now - self.served[rid] > limit:
            level, self.entered_at[rid] = 0, s.num_generated
        self.level[rid] = level
        return level

    def schedule(self, view) -> Plan:
        now = view.now
        ranked = sorted(list(view.running) + list(view.waiting),
                        key=lambda s: (self._update_level(s, now), s.req.arrival, s.req.id))
        plan = Plan()
        b = StepBudget.of(view)
        running_by_rank = [s for s in ranked if s.status is Status.RUNNING]
        chosen, preempted = set(), set()
        for s in ranked:
            if b.tokens <= 0 or b.seqs >= view.max_num_seqs:
                break
            if s in preempted:
                continue
            n = min(view.num_new_tokens(s), b.tokens)
            if s.status is Status.RUNNING or s.status is Status.SWAPPED:
                need = view.blocks_needed(s, n)  # a swapped request brings all its blocks back
            else:  # a victim of this very plan may hold its cached prefix, which then costs free
                # blocks to revive: count the whole prefix (an upper bound; exact without sharing)
                need = -(-(view.prefix_hit_tokens(s) + n) // view.block_size)
            if need > b.free_blocks and s.status is not Status.RUNNING:
                continue  # new work joins only into free KV (preempting running jobs for it thrashes)
            while (need > b.free_blocks and running_by_rank and running_by_rank[-1] is not s
                   and running_by_rank[-1] not in chosen):
                victim = running_by_rank.pop()
                preempt(plan, victim, self.knobs.preemption_mode, b)
                preempted.add(victim)
                b.free_blocks += view.reclaimable_blocks(victim)
            if need > b.free_blocks:
                break
            plan.schedule(s, n)
            chosen.add(s)
            b.tokens -= n
            b.free_blocks -= need
            b.seqs += 1
            self.served[s.req.id] = now
        return plan
