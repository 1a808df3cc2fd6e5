"""Virtual Token Counter: fair sharing of the engine between tenants.

Source: Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024 (Algorithm 2),
and its artifact (`slora/server/router/vtc_req_queue.py`).
Rule: each tenant has a counter of the service it received: `w_in` per prompt token
computed and `w_out` per output token generated. Running requests continue as in vLLM
(running first, each taking what it still needs; on a KV shortage the most recently
admitted is preempted by recompute and goes back to the head of its tenant's queue; a
step that preempted admits nothing). New work is admitted from the backlogged tenant
(one with a waiting request) with the smallest counter, that tenant's oldest request
first, charging the prompt tokens it computes, while the budget, sequence cap and KV
allow; admission stops at the first request that does not fit. Counter lift: when a tenant
becomes backlogged, its counter is raised to the smallest counter among the other
backlogged tenants; if none is backlogged, to the counter of the tenant that left the
queue last (Algorithm 2's empty-queue branch, which the artifact's code leaves out), so
idling banks no credit either way.
Choices: counters are charged from the requests' progress (prompt tokens as scheduled,
output tokens as generated, read before each plan and before a lift), so a fast-forwarded
run of decode steps is charged exactly. A recomputed request's tokens are charged again
as prompt tokens (the engine did compute them). Ties between counters go to the tenant
name. `tenants` > 0 ignores the trace's tenant column and assigns tenant `t{id % tenants}`.
Per-tenant queues are kept from the arrival hook, so a step costs O(running + tenants
+ admissions), not O(waiting).
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from testbed.policies._passes import StepBudget, run_running
from testbed.core.bounds import bounded
from testbed.core.plan import Plan
from testbed.core.policy import BasePolicy, PolicyKnobs, register
from testbed.core.request import Status


@dataclass
class VTCKnobs(PolicyKnobs):
    name: str = "vtc"
    w_in: float = bounded(1.0, ge=0)
    w_out: float = bounded(2.0, ge=0)
    tenants: int = bounded(0, ge=0)  # > 0: assign tenant t{id % tenants} instead of the trace's


@register
class VTCPolicy(BasePolicy):
    name = "vtc"
    Knobs = VTCKnobs

    def __init__(self, knobs=None):
        super().__init__(knobs)
        self.counter: dict[str, float] = defaultdict(float)
        self.queues: dict[str, deque] = defaultdict(deque)  # waiting requests per tenant, oldest first
        self.backlogged: set[str] = set()  # tenants whose queue is not empty
        self.last_left: str | None = None  # the tenant whose queue emptied last
        self.charged_out: dict[int, int] = {}  # output tokens already charged, per live request

    def tenant(self, s) -> str:
        return f"t{s.req.id % self.knobs.tenants}" if self.knobs.tenants else s.req.tenant

    def is_steady(self, view) -> bool:
        """Nobody waiting: every running request decodes each step until an arrival or a
        finish (output charges are read from progress, so skipped plans lose nothing)."""
        return not view.waiting

    # --- counters and queues ---------------------------------------------------------------
    def _charge_output(self, s) -> None:
        done = self.charged_out.get(s.req.id, 0)
        if s.num_generated > done:
            self.counter[self.tenant(s)] += self.knobs.w_out * (s.num_generated - done)
            self.charged_out[s.req.id] = s.num_generated

    def _enqueue(self, s, view, front: bool = False) -> None:
        t = self.tenant(s)
        if t not in self.backlogged:  # newly backlogged: lift its counter
            for r in view.running:  # bring the counters up to date first
                self._charge_output(r)
            others = [self.counter[u] for u in self.backlogged]
            floor = min(others) if others else (self.counter[self.last_left] if self.last_left else 0.0)
            self.counter[t] = max(self.counter[t], floor)
            self.backlogged.add(t)
        q = self.queues[t]
        q.appendleft(s) if front else q.append(s)

    def _pop(self, t: str) -> None:
        q = self.queues[t]
        q.popleft()
        if not q:
            self.backlogged.discard(t)
            self.last_left = t

    def on_arrival(self, s, view) -> None:
        self._enqueue(s, view)

    def on_finish(self, s, view) -> None:
        self._charge_output(s)
        self.charged_out.pop(s.req.id, None)

    # --- one step ----------------------------------------------------------------------------
    def schedule(self, view) -> Plan:
        k = self.knobs
        for s in view.running:
            self._charge_output(s)
        plan, b = Plan(), StepBudget.of(view)
        for victim in run_running(view, plan, view.running, b):
            self._enqueue(victim, view, front=True)
        for s, n in plan.items:
            if s.is_prefill:  # a chunked prompt (or a recompute) continuing
                self.counter[self.tenant(s)] += k.w_in * n
        if b.preempted:
            return plan
        while b.tokens > 0 and b.seqs < view.max_num_seqs and self.backlogged:
            t = min(self.backlogged, key=lambda u: (self.counter[u], u))
            s = self.queues[t][0]
            if s.status is not Status.WAITING:  # defensive: only waiting requests are queued
                self._pop(t)
                continue
            n = min(view.num_new_tokens(s), b.tokens)
            need = view.blocks_needed(s, n)
            if need > b.free_blocks:
                break
            self._pop(t)
            plan.schedule(s, n)
            self.counter[t] += k.w_in * n
            b.tokens -= n
            b.free_blocks -= need
            b.seqs += 1
        return plan
