"""Shortest job first by predicted output length, non-preemptive, with aging.

Source: SJF as used for LLM serving with a length predictor (Qiu et al., "Efficient
Interactive LLM Serving with Proxy Model-based Sequence Length Prediction", 2024; the
"sjf" ordering of vllm-ltr, Fu et al., NeurIPS 2024, which sorts the waiting queue by an
estimated output length). Lengths come from `policies/_predictors.py` (oracle by
default: an upper bound).

Rule, per step, under a token budget (chunked prefill, recompute preemption):
1. Running requests exactly as vLLM V1 (`policies/vllm.py`): admission order, each takes
   the rest of its prefill chunk or one decode token; if its KV blocks do not fit, the
   most recently admitted running request is preempted (recompute) and it retries, and
   if that was the request itself, stop. Running requests are never displaced by
   shorter arrivals: the policy is non-preemptive in the scheduling sense.
2. Only if nothing was preempted: admit waiting requests in order while the sequence
   cap, budget and KV allow, each chunked to the remaining budget, stopping at the first
   that does not fit (strict order, as vLLM's FCFS). The order: requests that have waited
   longer than `starvation_s` (aging; now - arrival) first, FCFS among them; then the
   rest by predicted output length, shortest first (ties by arrival, then id).

Choices: "waited" is the time since arrival; for a recompute-preempted request it counts
its whole time in the system, so an old preempted request is promoted (0 disables
aging). The waiting queue is a heap filled on arrival and on preemption (a request's
prediction never changes), and promoted requests are read from the head of the loop's
arrival-ordered waiting queue: no per-step sort.
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.policies._predictors import PredictorKnobs
from testbed.policies.srpt import AgedFirst, WaitingQueue, fill_ranked
from testbed.core.bounds import bounded
from testbed.core.plan import Plan
from testbed.core.policy import BasePolicy, register
from testbed.core.request import Status

_WAITING = Status.WAITING


@dataclass
class SJFKnobs(PredictorKnobs):
    name: str = "sjf"
    starvation_s: float = bounded(10.0, ge=0)  # requests waiting longer than this go first, FCFS; 0 = off


@register
class SJFPolicy(BasePolicy):
    name = "sjf"
    Knobs = SJFKnobs

    def __init__(self, knobs=None):
        super().__init__(knobs)
        k = self.knobs
        self.predictor = k.make()
        self.queue = WaitingQueue()
        self._requeue: list = []

    def _key(self, s):
        return (1, self.predictor.predict(s.req), s.req.arrival, s.req.id)

    def on_arrival(self, s, view) -> None:
        self.queue.push(self._key(s), s)

    def is_steady(self, view) -> bool:
        """As vLLM: with every running request decoding and nobody waiting, the plan
        repeats until an arrival or a finish (the loop checks KV growth)."""
        return not view.waiting

    def schedule(self, view) -> Plan:
        if self._requeue:
            for v in self._requeue:
                if v.status is _WAITING:
                    self.queue.push(self._key(v), v)
            self._requeue = []
        k = self.knobs
        cutoff = view.now - k.starvation_s if k.starvation_s > 0 else float("-inf")
        running = [(None, s) for s in view.running]  # admission order: the last admitted is the victim
        plan, victims = fill_ranked(view, running, AgedFirst(view.waiting, cutoff, self.queue), preemptive=False)
        self._requeue = victims
        return plan
