"""vLLM V1 with `--scheduling-policy priority`.

Source: vLLM v0.32.0, `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`, L591-1405) and
`vllm/v1/core/sched/request_queue.py` (`PriorityRequestQueue`, L131-197); `SchedulingPolicy.PRIORITY`
is tested in exactly two places of `schedule()` (L796, L808), everything else is `vllm`'s rule.
`tests/test_vllm_ported.py` (the `prio_*` scenarios) checks it step by step against REAL vLLM 0.32.
Rule, per step, under a token budget:
1. `long_prefill_token_threshold` caps one request's chunk unless the running and waiting
   requests number one in all (L640-648), as `vllm`.
2. Running requests in vLLM's own order, `self.running` (admission order; L657-660), NOT in
   priority order: each takes what it still needs, capped by the threshold and the remaining
   budget (L704-711). So a low-priority request admitted earlier is served before a
   high-priority one admitted later when the budget is short.
3. If its KV blocks do not fit, the victim is the worst running request by (priority,
   arrival): `max(self.running, key=(priority, arrival_time))` (L795-800; the first such in
   `self.running` on a tie), among ALL running requests, including one already scheduled
   earlier in this step and the request itself. The victim leaves `self.running` (L809-812:
   if it stood before the request being served, the index steps back); if it was already
   scheduled this step, its tokens go back to the budget and its new blocks with all its
   others are freed (L814-830 and `_preempt_request` L1571-1614: recompute, KV freed). The
   request retries with the chunk size it had (L784-792); if the victim was the request
   itself, the running pass stops (L843-848): the requests after it are not scheduled.
4. A preempted request goes back into the waiting heap by (priority, arrival), not at its
   head (`_preempt_request` L1613 -> `PriorityRequestQueue.prepend_request` L159-164).
5. Only if nothing was preempted this step (L900), admit waiting requests in heap order:
   (priority, arrival, request id) ascending (`Request.__lt__`, vllm/v1/request.py L357-367;
   `peek_request` L153-157), under the sequence cap (L923), budget and KV, stopping at the
   first that does not fit (L1275), with `vllm`'s prefix-cache, whole-sequence
   (`scheduler_reserve_full_isl`) and unchunked-prefill rules.
Not modelled: the request-id tie-break of two waiting requests with equal (priority,
arrival) (the testbed breaks it by its integer id); speculative decoding,
encoders, LoRA, KV connectors (`kv_holding_waiting`, `_request_blocks_can_be_freed` L803-805),
pipeline parallelism, pausing. vLLM V1 preempts by recompute only; `preemption_mode=swap` is the
testbed's extension. A step in which vLLM preempts and schedules nothing (the first running
request is the worst and preempts itself) is an empty vLLM step; the testbed's loop asks the
policy again at once instead (testbed/core/loop.py `plan`), which is that next step.
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.core.plan import Plan
from testbed.core.request import Status
from testbed.policies._passes import StepBudget, admit, preempt
from testbed.policies.vllm import VLLMKnobs, VLLMPolicy
from testbed.core.policy import register


def _rank(s):
    return (s.req.priority, s.req.arrival, s.req.id)


def _victim_key(s):
    return (s.req.priority, s.req.arrival)  # vLLM's key: no id, so a tie goes to the first in self.running


@dataclass
class VLLMPriorityKnobs(VLLMKnobs):
    name: str = "vllm_priority"


def run_running_priority(view, plan: Plan, b: StepBudget, mode: str, cap: int | None, preview=None) -> list:
    """vLLM 0.32's running pass under the priority policy (scheduler.py L657-848): requests in
    admission order; on a KV shortage preempt the worst (priority, arrival) of all running
    requests, giving back what it was given this step. Returns the requests preempted."""
    running = list(view.running)  # self.running
    taken: dict[int, tuple[int, int]] = {}  # request id -> (tokens, blocks) scheduled this step
    victims = []
    i = 0
    while i < len(running) and b.tokens > 0:
        s = running[i]
        if s.status is Status.FINISHED:  # finished in the step before, outputs not back (async scheduling):
            i += 1  # skipped, holding its seat and blocks (L664-676); still a possible victim
            continue
        n = min(s.remaining, b.tokens, cap or b.tokens)
        need = view.blocks_needed(s, n)
        stopped = False
        while need > b.free_blocks:
            victim = max(running, key=_victim_key)  # L797-800
            j = running.index(victim)
            del running[j]  # L809-810
            if j < i:
                i -= 1  # L811-812
            given = taken.pop(victim.req.id, None)
            if given is not None:  # L814-820: unschedule it, restore its budget and blocks
                plan.items = [(x, m) for x, m in plan.items if x is not victim]
                b.tokens += given[0]
                b.free_blocks += given[1]
            preempt(plan, victim, mode, b)
            victims.append(victim)
            b.free_blocks += view.reclaimable_blocks(victim)
            if victim is s:  # L843-845
                stopped = True
                break
        if stopped:
            break  # L847-848
        plan.schedule(s, n)
        if preview is not None:
            preview.schedule(s, n)
        taken[s.req.id] = (n, need)
        b.free_blocks -= need
        b.tokens -= n
        i += 1
    b.seqs += len(running)  # those not preempted hold their place in the running set
    b.preempted = b.preempted or bool(victims)
    return victims


@register
class VLLMPriorityPolicy(VLLMPolicy):
    name = "vllm_priority"
    Knobs = VLLMPriorityKnobs

    def waiting_order(self, view):
        return sorted(view.waiting, key=_rank)  # already arrival-ordered: Timsort is linear when priorities agree

    def schedule(self, view) -> Plan:
        k = self.knobs
        plan, b = Plan(), StepBudget.of(view)
        cap = k.long_prefill_token_threshold if len(view.running) + len(view.waiting) > 1 else 0
        preview = view.kv_preview() if view.waiting else None
        run_running_priority(view, plan, b, k.preemption_mode, cap or None, preview)
        if not b.preempted and view.waiting:
            admit(view, plan, self.waiting_order(view), b, k.chunked_prefill, cap or None, preview=preview,
                  full_sequence_must_fit=k.reserve_full_isl)
        return plan
