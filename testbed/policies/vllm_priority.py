"""vLLM V1 with `--scheduling-policy priority`.

Source: vLLM `vllm/v1/core/sched/scheduler.py` and `request_queue.py` (PriorityRequestQueue).
Rule: as `vllm` (running first, then admission under budget, KV and sequence cap, chunked
prefill), except that the waiting queue is ordered by (priority, arrival) with the lower
priority value first, and the preemption victim on a KV shortage is the running request
with the worst (largest) (priority, arrival), not the most recently admitted.
Choice: the running pass visits requests best-first, so victims are taken from the worst end.
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.policies.vllm import VLLMKnobs, VLLMPolicy
from testbed.core.policy import register


def _rank(s):
    return (s.req.priority, s.req.arrival, s.req.id)


@dataclass
class VLLMPriorityKnobs(VLLMKnobs):
    name: str = "vllm_priority"


@register
class VLLMPriorityPolicy(VLLMPolicy):
    name = "vllm_priority"
    Knobs = VLLMPriorityKnobs

    def running_order(self, view) -> list:
        return sorted(view.running, key=_rank)

    def waiting_order(self, view):
        return sorted(view.waiting, key=_rank)  # already arrival-ordered: Timsort is linear when priorities agree
