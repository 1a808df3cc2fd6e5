"""The two passes most schedulers are built from, written once.

`run_running` is vLLM's pass over running requests (each takes what it still needs under
the budget; on a KV shortage the policy's chosen victim is preempted and the request
retries). `admit` is FCFS-style admission of candidates in a given order, stopping at the
first that does not fit. Policies differ in the orders they pass in and in what they do
around these passes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from testbed.core.kv import KVPreview
from testbed.core.plan import RECOMPUTE, SWAP, Plan
from testbed.core.request import RequestState, Status

_RUNNING, _FINISHED = Status.RUNNING, Status.FINISHED


def arrival_order(s: RequestState) -> tuple[float, int]:
    """Sort key: arrival, then request id (the FCFS order of systems that sort by arrival time)."""
    return (s.req.arrival, s.req.id)


@dataclass(slots=True)
class StepBudget:
    """What is left of this step as a policy fills it."""

    tokens: int
    free_blocks: int
    host_blocks: int
    seqs: int  # requests scheduled (or kept running) so far
    preempted: bool = False

    @classmethod
    def of(cls, view, tokens: int | None = None) -> "StepBudget":
        return cls(view.token_budget if tokens is None else min(tokens, view.token_budget), view.free_blocks,
                   view.free_host_blocks, 0)


def preempt(plan: Plan, victim: RequestState, mode: str, b: StepBudget) -> None:
    """Preempt by `mode`; a swap falls back to recompute when the host swap space left is short."""
    if mode == SWAP and len(victim.blocks) <= b.host_blocks:
        b.host_blocks -= len(victim.blocks)
    else:
        mode = RECOMPUTE
    plan.preempt_request(victim, mode)


def run_running(view, plan: Plan, order: list[RequestState], b: StepBudget, mode: str = RECOMPUTE,
                cap: int | None = None, want: Callable[[RequestState], int] | None = None,
                preview: KVPreview | None = None) -> list[RequestState]:
    """Schedule running requests in `order`; victims are taken from the end of `order`.

    Returns the requests preempted. Stops at the first request that preempted itself or
    when the budget is spent; requests after that stay running, unscheduled. `preview`
    (view.kv_preview()) is told of every allocation, for an `admit` that follows.
    """
    victims: list[RequestState] = []
    last = len(order)
    i = 0
    # This loop runs once per running request per step, the hottest in a run: the budget is kept in
    # locals, and a running request's `remaining` and `view.blocks_needed` (the same arithmetic as
    # kv.blocks_needed) are inlined; a request in any other state asks the view.
    bs = view.block_size
    items = plan.items
    first = len(items)
    tokens, free = b.tokens, b.free_blocks
    while i < last and tokens > 0:
        s = order[i]
        status = s.status  # read once (a policy's `want` reads, never writes, it)
        if status is _FINISHED:  # finished in the step before, outputs not back (async scheduling): skipped,
            i += 1  # holding its seat and blocks (vLLM 0.32 scheduler.py L664-676); still a possible victim
            continue
        computed = s.num_computed
        n = want(s) if want else s.req.prompt_len + s.num_generated - computed
        if n > tokens:
            n = tokens
        if cap and n > cap:
            n = cap
        if status is _RUNNING:
            need = -(-(computed + n) // bs) - len(s.blocks)
            if need < 0:
                need = 0
        else:
            need = view.blocks_needed(s, n)
        while need > free and last > i:
            last -= 1
            victim = order[last]
            preempt(plan, victim, mode, b)
            victims.append(victim)
            free += view.reclaimable_blocks(victim)
        if last == i:  # the request preempted itself
            break
        items.append((s, n))  # plan.schedule(s, n)
        free -= need
        tokens -= n
        i += 1
    if preview is not None:  # told of this pass's items at once (preempting tells it nothing)
        preview.schedule_items(items[first:])
    b.tokens, b.free_blocks = tokens, free
    b.seqs += last  # those not preempted hold their place in the running set
    b.preempted = b.preempted or bool(victims)
    return victims


def admit(view, plan: Plan, candidates: Iterable[RequestState], b: StepBudget, chunked: bool = True,
          cap: int | None = None, reserve: Callable[[RequestState, int], int] | None = None,
          preview: KVPreview | None = None, full_sequence_must_fit: bool = False) -> int:
    """Admit candidates in order while the sequence cap, budget and KV allow; stop at the
    first that does not fit. Returns the count.

    `reserve(s, n)` overrides the blocks a request must find free and takes them (e.g. its
    whole prompt + output, for policies that reserve up front). `preview` plans each request
    against the cache as the earlier ones leave it (vLLM's order: see KVPreview).
    `full_sequence_must_fit` admits a request only if blocks for its whole known sequence are
    free, while taking only its chunk's (vLLM's `scheduler_reserve_full_isl`).
    """
    admitted = 0
    bs = view.block_size
    for s in candidates:
        if b.tokens <= 0 or b.seqs >= view.max_num_seqs:
            break
        fresh = preview is not None and s.status is Status.WAITING  # a swapped request brings its own KV back
        if fresh:
            hit, revive = preview.match(s)
            want = s.known_len - hit * bs
        else:
            want = view.num_new_tokens(s)
        # the threshold caps the chunk before the no-chunking check (vLLM 0.32 scheduler.py L1155-1167), so
        # without chunked prefill a long prompt is still admitted in threshold-sized pieces
        chunk = min(want, cap) if cap else want
        if chunk > b.tokens and not chunked and chunk <= view.token_budget:
            break
        n = min(chunk, b.tokens)
        if fresh:
            held = hit - len(revive)  # hit blocks already off the free queue
            need = -(-(hit * bs + n) // bs) - held
            gate = -(-s.known_len // bs) - held if full_sequence_must_fit else need
        else:
            need = reserve(s, n) if reserve else view.blocks_needed(s, n)
            gate = view.blocks_needed(s, want) if full_sequence_must_fit else need
        if max(need, gate) > b.free_blocks:
            break
        plan.schedule(s, n)
        if fresh:
            preview.admit(s, hit, revive, n)
        elif preview is not None:
            preview.take(need)
        b.free_blocks -= need
        b.tokens -= n
        b.seqs += 1
        admitted += 1
    return admitted
