"""vLLM V0's default scheduler: prefill-prioritising, no chunked prefill.

Source: vLLM v0.6 `vllm/core/scheduler.py` (`Scheduler._schedule_default`).
Rule, per step:
1. If any waiting request fits (its whole prompt within the token budget, its prompt's KV
   blocks free, the sequence cap not reached), the step is a pure prefill step: waiting
   requests are admitted FCFS while they fit, stopping at the first that does not.
2. Otherwise the step is a pure decode step of every running request, one token each; on
   a KV shortage the most recently admitted running request is preempted (recompute by
   default, swap with `preemption_mode=swap` and swap space) and the request retries.
Prefill and decode are never mixed in one step: arrivals stall running decodes, which is
what Sarathi-Serve and V1's chunked prefill were built to fix.
Choice: a prompt longer than the whole budget (which V0 refuses) is admitted when the KV
for its whole prompt is free, and prefilled in budget-sized chunks over consecutive
prefill steps, rather than left to starve.
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.policies._passes import StepBudget, admit, run_running
from testbed.core.plan import PREEMPT_MODES, RECOMPUTE, Plan
from testbed.core.policy import BasePolicy, PolicyKnobs, register


@dataclass
class VLLMV0Knobs(PolicyKnobs):
    name: str = "vllm_v0"
    preemption_mode: str = RECOMPUTE

    def __post_init__(self):
        super().__post_init__()
        if self.preemption_mode not in PREEMPT_MODES:
            raise ValueError(f"policy.preemption_mode={self.preemption_mode!r}: expected one of {PREEMPT_MODES}")


@register
class VLLMV0Policy(BasePolicy):
    name = "vllm_v0"
    Knobs = VLLMV0Knobs

    def is_steady(self, view) -> bool:
        """A decode step means no waiting request fit; decodes only use up KV, so none will
        until a request finishes (or one arrives)."""
        return True

    def schedule(self, view) -> Plan:
        plan, b = Plan(), StepBudget.of(view)
        partial = [s for s in view.running if s.is_prefill]  # a prompt longer than the budget, mid-prefill
        if partial:
            run_running(view, plan, partial, b, self.knobs.preemption_mode)
            return plan
        b.seqs = len(view.running)

        def whole_prompt(s, n):  # V0 allocates a prompt's blocks at once: admit only if all of them fit
            return view.blocks_needed(s, view.num_new_tokens(s))
        if admit(view, plan, view.waiting, b, chunked=False, reserve=whole_prompt):
            return plan
        run_running(view, plan, view.running, StepBudget.of(view), self.knobs.preemption_mode)
        return plan
