"""vLLM V1's default scheduler: FCFS with chunked prefill and recompute preemption.

Source: vLLM `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`, v0.8+).
Rule, per step, under a token budget:
1. Running requests first, in admission order: each takes what it still needs (the rest
   of its prefill, or one decode token), capped by the remaining budget and by
   `long_prefill_token_threshold` when set. If its KV blocks do not fit, preempt the
   most recently admitted running request (recompute: its KV is dropped and it goes back
   to the waiting queue) and retry; if that was the request itself, stop.
2. Only if nothing was preempted this step: admit waiting requests FCFS while the
   sequence cap, budget and KV allow, each chunked to the remaining budget (its prefix
   cache hit counted as computed). With `chunked_prefill=false`, a prompt that does not
   fit in the remaining budget waits (and blocks the queue, FCFS); one longer than the
   whole budget is still chunked, since it could never run otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.policies._passes import StepBudget, admit, run_running
from testbed.core.bounds import bounded
from testbed.core.plan import PREEMPT_MODES, RECOMPUTE, Plan
from testbed.core.policy import BasePolicy, PolicyKnobs, register


@dataclass
class VLLMKnobs(PolicyKnobs):
    name: str = "vllm"
    chunked_prefill: bool = True
    long_prefill_token_threshold: int = bounded(0, ge=0)  # 0 = no cap on one request's prefill chunk
    preemption_mode: str = RECOMPUTE  # "recompute" (V1) or "swap" (V0)

    def __post_init__(self):
        super().__post_init__()
        if self.preemption_mode not in PREEMPT_MODES:
            raise ValueError(f"policy.preemption_mode={self.preemption_mode!r}: expected one of {PREEMPT_MODES}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"policy.long_prefill_token_threshold={self.long_prefill_token_threshold}: must be >= 0")


@register
class VLLMPolicy(BasePolicy):
    name = "vllm"
    Knobs = VLLMKnobs

    def is_steady(self, view) -> bool:
        """With every running request decoding and nobody waiting, the plan repeats until
        an arrival or a finish (the loop checks KV growth)."""
        return not view.waiting

    def running_order(self, view) -> list:
        return view.running

    def waiting_order(self, view):
        return view.waiting

    def schedule(self, view) -> Plan:
        k = self.knobs
        plan, b = Plan(), StepBudget.of(view)
        cap = k.long_prefill_token_threshold or None
        run_running(view, plan, self.running_order(view), b, k.preemption_mode, cap)
        if not b.preempted:
            admit(view, plan, self.waiting_order(view), b, k.chunked_prefill, cap)
        return plan
