"""TensorRT-LLM's batch scheduler and its two capacity policies.

Source: TensorRT-LLM `cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp`
(GuaranteedNoEvictScheduler, MaxUtilizationScheduler) and `microBatchScheduler.cpp`
(chunked context under `max_num_tokens`).
Rule, per step, with chunked context (prefill) under the token budget:
- `guaranteed_no_evict`: every running request runs (decode, or its next context chunk);
  a waiting request is admitted FCFS only if the KV blocks for its whole prompt + output
  fit on top of the blocks the running requests still need to finish. Nothing is ever
  preempted.
- `max_utilization`: admit greedily by what a request needs now (vLLM-style); when a
  running request cannot grow, the most recently admitted is paused (preempted by
  recompute) and the request retries.
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.policies._passes import StepBudget, admit, run_running
from testbed.core.plan import Plan
from testbed.core.policy import BasePolicy, PolicyKnobs, register

MODES = ("guaranteed_no_evict", "max_utilization")


@dataclass
class TRTLLMKnobs(PolicyKnobs):
    name: str = "trtllm"
    mode: str = "guaranteed_no_evict"

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"policy.mode={self.mode!r}: expected one of {MODES}")


def _blocks_to_finish(view, s) -> int:
    return max(0, -(-s.req.total_len // view.block_size) - len(s.blocks))


@register
class TRTLLMPolicy(BasePolicy):
    name = "trtllm"
    Knobs = TRTLLMKnobs

    def is_steady(self, view) -> bool:
        """No-evict admission compares free blocks with what running requests still need:
        decodes lower both alike, so the verdict holds until an arrival or a finish."""
        return self.knobs.mode == "guaranteed_no_evict" or not view.waiting

    def schedule(self, view) -> Plan:
        plan, b = Plan(), StepBudget.of(view)
        if self.knobs.mode == "max_utilization":
            run_running(view, plan, view.running, b)
            if not b.preempted:
                admit(view, plan, view.waiting, b)
            return plan
        owed = 0
        for s in view.running:
            owed += _blocks_to_finish(view, s)
            if b.tokens > 0:
                n = min(s.remaining, b.tokens)
                plan.schedule(s, n)
                b.tokens -= n
        b.seqs = len(view.running)
        b.free_blocks -= owed  # what the running requests will still take, decodes of this step included

        def whole_request(s, n):  # its whole prompt's blocks now (a shared prefix revived counts) + its output's
            bs = view.block_size
            return view.blocks_needed(s, view.num_new_tokens(s)) + -(-s.req.total_len // bs) - -(-s.known_len // bs)
        admit(view, plan, view.waiting, b, reserve=whole_request)
        return plan
