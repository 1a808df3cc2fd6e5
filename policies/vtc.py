"""Virtual Token Counter: fair sharing of the engine between tenants.

Source: Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024 (Algorithm 2).
Rule: each tenant has a counter of the service it received: `w_in` per prompt token
computed and `w_out` per output token generated. Running requests continue as in vLLM
(running first, the most recently admitted preempted by recompute on a KV shortage, the
victim returning to the head of its tenant's queue). New work is admitted from the
backlogged tenant with the smallest counter, its oldest request first, while the budget,
sequence cap and KV allow; admission stops at the first request that does not fit. When
a tenant becomes backlogged again after an idle spell, its counter is lifted to the
smallest counter among the backlogged tenants (so idling banks no credit).
Choices: counters are charged from the requests' progress (prompt tokens as scheduled,
output tokens as generated), so a fast-forwarded run of decode steps is charged exactly;
`tenants > 0` ignores the trace's tenant column and assigns tenant `t{id % tenants}`.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

from policies._passes import StepBudget, run_running
from testbed.plan import Plan
from testbed.policy import BasePolicy, PolicyKnobs, register
from testbed.request import Status


@dataclass
class VTCKnobs(PolicyKnobs):
    name: str = "vtc"
    w_in: float = 1.0
    w_out: float = 2.0
    tenants: int = 0  # > 0: assign tenant t{id % tenants} instead of the trace's

    def __post_init__(self):
        if self.w_in < 0 or self.w_out < 0 or self.tenants < 0:
            raise ValueError("policy: w_in, w_out and tenants must be >= 0")


@register
class VTCPolicy(BasePolicy):
    name = "vtc"
    Knobs = VTCKnobs

    def __init__(self, knobs=None):
        super().__init__(knobs)
        self.counter: dict[str, float] = defaultdict(float)
        self.queues: dict[str, deque] = defaultdict(deque)
        self.charged_out: dict[int, int] = {}  # output tokens already charged, per live request

    def tenant(self, s) -> str:
        return f"t{s.req.id % self.knobs.tenants}" if self.knobs.tenants else s.req.tenant

    def _enqueue(self, s, front: bool = False) -> None:
        t = self.tenant(s)
        q = self.queues[t]
        if not q:  # newly backlogged: lift to the smallest backlogged counter
            backlogged = [self.counter[u] for u, other in self.queues.items() if other and u != t]
            if backlogged:
                self.counter[t] = max(self.counter[t], min(backlogged))
        q.appendleft(s) if front else q.append(s)

    def on_arrival(self, s, view) -> None:
        self._enqueue(s)

    def on_finish(self, s, view) -> None:
        self._charge_output(s)
        self.charged_out.pop(s.req.id, None)

    def _charge_output(self, s) -> None:
        done = self.charged_out.get(s.req.id, 0)
        if s.num_generated > done:
            self.counter[self.tenant(s)] += self.knobs.w_out * (s.num_generated - done)
            self.charged_out[s.req.id] = s.num_generated

    def is_steady(self, view) -> bool:
        return not view.waiting

    def schedule(self, view) -> Plan:
        k = self.knobs
        for s in view.running:
            self._charge_output(s)
        plan, b = Plan(), StepBudget.of(view)
        for victim in run_running(view, plan, view.running, b):
            self._enqueue(victim, front=True)
        for s, n in plan.items:
            if s.is_prefill:
                self.counter[self.tenant(s)] += k.w_in * n
        if b.preempted:
            return plan
        while b.tokens > 0 and b.seqs < view.max_num_seqs:
            backlogged = [t for t, q in self.queues.items() if q]
            if not backlogged:
                break
            t = min(backlogged, key=lambda u: (self.counter[u], u))
            s = self.queues[t][0]
            if s.status is Status.RUNNING or s.status is Status.FINISHED:  # stale entry
                self.queues[t].popleft()
                continue
            n = min(view.num_new_tokens(s), b.tokens)
            need = view.blocks_needed(s, n)
            if need > b.free_blocks:
                break
            self.queues[t].popleft()
            plan.schedule(s, n)
            self.counter[t] += k.w_in * n
            b.tokens -= n
            b.free_blocks -= need
            b.seqs += 1
        return plan
