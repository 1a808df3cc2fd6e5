"""Orca's iteration-level scheduling, with whole prompts and KV reserved for the maximum.

Source: Yu et al., "Orca: A Distributed Serving System for Transformer-Based Generative
Models", OSDI 2022 (Algorithm 1, with the `n_rsrv` reservation of max tokens).
Rule, per step: every running request runs (its whole prompt in the step it joins, then
one decode token a step). Waiting requests are admitted FCFS while the batch-size cap
(`max_batch_size`, capped by the scheduler's) allows, the whole prompt fits in the token
budget left after the decodes, and the KV for the request's *maximum* length (prompt +
output) fits on top of the maximum lengths reserved by the running requests: so no
request ever runs out of KV and nothing is ever preempted.
Choice: a prompt longer than the whole token budget (which Orca would not accept) is
admitted alone and prefilled in budget-sized chunks, rather than left to starve.
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.core.bounds import bounded
from testbed.core.plan import Plan
from testbed.core.policy import BasePolicy, PolicyKnobs, register


@dataclass
class OrcaKnobs(PolicyKnobs):
    name: str = "orca"
    max_batch_size: int = bounded(0, ge=0)  # 0 = scheduler.max_num_seqs


def max_blocks(view, s) -> int:
    return -(-s.req.total_len // view.block_size)


@register
class OrcaPolicy(BasePolicy):
    name = "orca"
    Knobs = OrcaKnobs

    def is_steady(self, view) -> bool:
        """Admission depends on the batch size, the decode count and the reservations, none
        of which change until a request arrives or finishes."""
        return True

    def schedule(self, view) -> Plan:
        plan = Plan()
        budget = view.token_budget
        reserved = 0
        for s in view.running:
            n = min(s.remaining, budget)
            if n > 0:
                plan.schedule(s, n)
                budget -= n
            reserved += max_blocks(view, s)
        limit = min(self.knobs.max_batch_size or view.max_num_seqs, view.max_num_seqs)
        seqs = len(view.running)
        for s in view.waiting:
            if seqs >= limit:
                break
            want = view.num_new_tokens(s)
            if want > budget and not (want > view.token_budget and budget == view.token_budget):
                break  # whole prompts only (one that exceeds the whole budget runs alone, chunked)
            need = max_blocks(view, s)
            if reserved + need > view.num_blocks or view.blocks_needed(s, min(want, budget)) > view.free_blocks:
                break
            n = min(want, budget)
            plan.schedule(s, n)
            budget -= n
            reserved += need
            seqs += 1
        return plan
