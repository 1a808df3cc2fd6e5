"""Orca's iteration-level scheduling, with whole prompts and KV reserved for the maximum.

Source: Yu et al., "Orca: A Distributed Serving System for Transformer-Based Generative
Models", OSDI 2022 (no public code). Algorithm 1 (as reconstructed from the paper's listing):
the main loop calls `Select(request_pool, n_rsrv)` every iteration and, when a request
finishes, releases its reservation (`n_rsrv <- n_rsrv - req.max_tokens`); `Select` takes the
requests not in flight, `SortByArrivalTime`, and for each: `if batch.size() = max_bs: break`;
if the request is in its initiation phase, `new_n_rsrv <- n_rsrv + req.max_tokens; if
new_n_rsrv > n_slots: break`, else reserve; add it to the batch. Section 4 (selective
batching): requests in the initiation (prefill) and increment (decode) phases run in the same
iteration, a prompt whole.
Rule here, per step: every running request runs (arrived before every waiting one, since
admission is FCFS and stops at the first that does not fit: the sorted pool is the running
requests then the waiting ones); a waiting request is admitted FCFS while the batch holds
fewer than `max_batch_size` (capped by the scheduler's `max_num_seqs`), and only if the KV for
its maximum length (prompt + output: `max_tokens`) fits on top of the maximum lengths of the
running requests (`n_slots` = the cache's blocks); the first that does not fit stops admission.
No request ever runs out of KV, so nothing is ever preempted. With `kv.block_size=1` (the
preset) the reservation is Orca's token-slot arithmetic exactly; a larger block rounds each
request's reservation up to whole blocks.
Limits of the testbed, not of Orca: Orca has no per-iteration token budget, but the loop
enforces `scheduler.max_num_batched_tokens`, so a prompt is admitted only if it fits whole in
the budget the decodes left (raise the budget to come closer to Orca). Choice: a prompt longer
than the whole budget (which Orca would run in one iteration) is admitted alone and prefilled in
budget-sized chunks, rather than left to starve. Not modeled: pipeline-parallel workers
(`n_workers` batches in flight; here one), Orca's max_tokens given by the client: the trace's
prompt + output length stands for it, the reservation the vLLM paper (Kwon et al., SOSP'23,
section 6) calls "Orca (Oracle)"; its "Orca (Max)" would reserve `max_model_len` per request.
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
        items = plan.items
        budget = view.token_budget
        bs = view.block_size
        reserved = 0
        for s in view.running:  # every running request every step: `remaining` and `max_blocks` inlined
            req = s.req
            n = req.prompt_len + s.num_generated - s.num_computed
            if n > budget:
                n = budget
            if n > 0:
                items.append((s, n))  # plan.schedule(s, n)
                budget -= n
            reserved += -(-(req.prompt_len + req.output_len) // bs)
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
