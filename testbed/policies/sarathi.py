"""Sarathi-Serve's stall-free batching.

Source: Agrawal et al., "Taming Throughput-Latency Tradeoff in LLM Inference with
Sarathi-Serve", OSDI 2024 (Algorithm 1).
Rule, per step, under a token budget tau (`token_budget`, capped by the scheduler's):
1. every running decode first, one token each, so ongoing decodes are never stalled by
   a prefill (on a KV shortage the most recently admitted running request is preempted
   by recompute, as in vLLM);
2. then running requests whose prefill is still partial, chunked to the leftover budget;
3. then new requests from the waiting queue, FCFS, chunked to the leftover budget, while
   the sequence cap and KV allow.
A small tau bounds each step's time (and so the TPOT of the decodes riding in it) at the
cost of slower prefills: the knob the paper tunes against the TPOT SLO.
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.policies._passes import StepBudget, admit, run_running
from testbed.core.bounds import bounded
from testbed.core.plan import Plan
from testbed.core.policy import BasePolicy, PolicyKnobs, register


@dataclass
class SarathiKnobs(PolicyKnobs):
    name: str = "sarathi"
    token_budget: int = bounded(512, ge=1)  # tau: tokens per step (decodes + prefill chunks)


@register
class SarathiPolicy(BasePolicy):
    name = "sarathi"
    Knobs = SarathiKnobs

    def is_steady(self, view) -> bool:
        return not view.waiting

    def schedule(self, view) -> Plan:
        plan, b = Plan(), StepBudget.of(view, self.knobs.token_budget)
        decoding = [s for s in view.running if not s.is_prefill]
        prefilling = [s for s in view.running if s.is_prefill]
        run_running(view, plan, decoding + prefilling, b)
        if not b.preempted:
            admit(view, plan, view.waiting, b)
        return plan
