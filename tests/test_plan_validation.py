"""Every rule of plan validation rejects its kind of invalid plan, naming policy and rule."""
from __future__ import annotations

import pytest

from conftest import make_loop, make_requests
from testbed.core.plan import Plan, PlanError
from testbed.core.policy import BasePolicy


class Scripted(BasePolicy):
    """Returns whatever plan the test puts in `next_plan`."""

    name = "scripted"

    def __init__(self):
        super().__init__()
        self.next_plan = None

    def schedule(self, view):
        return self.next_plan(view) if callable(self.next_plan) else self.next_plan


def loop_with(reqs, **kw):
    pol = Scripted()
    loop = make_loop(pol, **kw)
    for r in reqs:
        loop.arrive(r, r.arrival)
    return loop, pol


def plan_of(*items, preempt=()):
    p = Plan()
    for s, n in items:
        p.schedule(s, n)
    for s, m in preempt:
        p.preempt_request(s, m)
    return p


def expect(loop, rule):
    with pytest.raises(PlanError) as e:
        loop.plan(0.0)
    assert e.value.rule == rule
    assert "scripted" in str(e.value) and rule in str(e.value)
    return e.value


def test_not_a_plan():
    loop, pol = loop_with(make_requests([(0, 8, 2)]))
    pol.next_plan = {"a": 1}
    expect(loop, "plan-type")


def test_token_budget():
    loop, pol = loop_with(make_requests([(0, 40, 2), (0, 40, 2)]), budget=64)
    a, b = loop.waiting
    pol.next_plan = plan_of((a, 40), (b, 40))
    err = expect(loop, "token-budget")
    assert "80" in str(err) and "64" in str(err)


def test_sequence_cap():
    loop, pol = loop_with(make_requests([(0, 4, 2)] * 3), max_seqs=2)
    pol.next_plan = plan_of(*((s, 4) for s in loop.waiting))
    expect(loop, "max-num-seqs")


def test_duplicate_request():
    loop, pol = loop_with(make_requests([(0, 8, 2)]))
    s = loop.waiting[0]
    pol.next_plan = plan_of((s, 4), (s, 4))
    expect(loop, "duplicate")


def test_unknown_request():
    loop, pol = loop_with(make_requests([(0, 8, 2)]))
    from testbed.core.request import RequestState
    stranger = RequestState(make_requests([(0, 8, 2)])[0])
    pol.next_plan = plan_of((stranger, 4))
    expect(loop, "unknown-request")


def test_chunk_past_the_prompt():
    loop, pol = loop_with(make_requests([(0, 8, 2)]))
    pol.next_plan = plan_of((loop.waiting[0], 9))
    expect(loop, "beyond-known-tokens")


def test_decode_before_prefill_done():
    loop, pol = loop_with(make_requests([(0, 8, 3)]))
    s = loop.waiting[0]
    pol.next_plan = plan_of((s, 4))  # half the prompt
    loop.complete(loop.plan(0.0), 0.1)
    assert s.num_generated == 0
    # the remaining 4 prompt tokens are fine; 5 would be a decode token before the prefill completes
    pol.next_plan = plan_of((s, 5))
    err = expect(loop, "beyond-known-tokens")
    assert "before its prefill completes" in str(err)


def test_two_decode_tokens():
    loop, pol = loop_with(make_requests([(0, 8, 3)]))
    s = loop.waiting[0]
    pol.next_plan = plan_of((s, 8))
    loop.complete(loop.plan(0.0), 0.1)
    assert s.num_generated == 1
    pol.next_plan = plan_of((s, 2))
    expect(loop, "beyond-known-tokens")


def test_non_positive_or_non_int_tokens():
    loop, pol = loop_with(make_requests([(0, 8, 2)]))
    s = loop.waiting[0]
    for bad in (0, -1, 2.0):
        pol.next_plan = plan_of((s, bad))
        expect(loop, "token-count")


def test_kv_capacity():
    loop, pol = loop_with(make_requests([(0, 16, 2), (0, 16, 2)]), num_blocks=6, block_size=4)
    a, b = loop.waiting
    pol.next_plan = plan_of((a, 16), (b, 16))  # 8 blocks, 6 exist
    err = expect(loop, "kv-capacity")
    assert "needed" in str(err).lower() or "need" in str(err).lower()


def test_preempt_a_waiting_request():
    loop, pol = loop_with(make_requests([(0, 8, 2)]))
    s = loop.waiting[0]
    pol.next_plan = plan_of(preempt=[(s, "recompute")])
    expect(loop, "preempt-not-running")


def test_preempt_and_schedule_same_request():
    loop, pol = loop_with(make_requests([(0, 8, 4)]))
    s = loop.waiting[0]
    pol.next_plan = plan_of((s, 8))
    loop.complete(loop.plan(0.0), 0.1)
    pol.next_plan = plan_of((s, 1), preempt=[(s, "recompute")])
    expect(loop, "preempt-and-schedule")


def test_bad_preempt_mode_and_swap_without_space():
    loop, pol = loop_with(make_requests([(0, 8, 4)]), host_blocks=0)
    s = loop.waiting[0]
    pol.next_plan = plan_of((s, 8))
    loop.complete(loop.plan(0.0), 0.1)
    pol.next_plan = plan_of(preempt=[(s, "evict")])
    expect(loop, "preempt-mode")
    pol.next_plan = plan_of(preempt=[(s, "swap")])
    expect(loop, "kv-capacity")


def test_valid_plan_passes_and_applies():
    loop, pol = loop_with(make_requests([(0, 8, 2), (0, 6, 1)]))
    a, b = loop.waiting
    pol.next_plan = plan_of((a, 8), (b, 6))
    batch = loop.plan(0.0)
    assert batch.shape.num_prefill_tokens == 14 and batch.shape.num_prefill_seqs == 2
    assert loop.running == [a, b] and loop.waiting == []
    loop.complete(batch, 0.5)
    assert b.status.value == "finished" and a.num_generated == 1
    assert loop.running == [a]


def test_preempt_only_plan_is_followed_by_a_new_plan():
    # the policy preempts the only running request and schedules nothing; the loop must ask
    # again at once (not wait for an arrival that may never come) and carry the swap along
    loop, pol = loop_with(make_requests([(0, 8, 4)]), host_blocks=8)
    s = loop.waiting[0]
    pol.next_plan = plan_of((s, 8))
    loop.complete(loop.plan(0.0), 0.1)
    calls = []

    def script(view):
        calls.append(len(view.running))
        return plan_of(preempt=[(s, "swap")]) if view.running else plan_of((s, 1))

    pol.next_plan = script
    batch = loop.plan(0.1)
    assert calls == [1, 0] and batch is not None and batch.items == [(s, 1)]
    assert batch.swap_out and batch.swap_out[0][0] is s and batch.swap_in and batch.swap_in[0][0] is s
    assert batch.shape.swap_blocks == 2 * len(batch.swap_out[0][1])


def test_a_long_chain_of_preempt_only_plans_does_not_recurse():
    # Finding 9: 1,200 running requests, and a policy that preempts one of them per plan and
    # schedules nothing until none runs. The loop re-plans after each preempt-only plan; done by
    # recursion, this passed Python's recursion limit (RecursionError) long before the end.
    n = 1200
    loop, pol = loop_with(make_requests([(0, 1, 2)] * n), num_blocks=n, block_size=1, budget=n, max_seqs=n)
    states = list(loop.waiting)
    pol.next_plan = plan_of(*((s, 1) for s in states))
    loop.complete(loop.plan(0.0), 0.1)
    assert len(loop.running) == n
    calls = []

    def script(view):
        calls.append(len(view.running))
        return plan_of(preempt=[(view.running[-1], "recompute")]) if view.running else plan_of((states[0], 1))

    pol.next_plan = script
    batch = loop.plan(0.1)
    assert calls == list(range(n, -1, -1)) and batch.items == [(states[0], 1)]
    assert sum(s.num_preemptions for s in states) == n


def test_swaps_of_a_preempt_only_plan_reach_the_next_batch_even_after_an_empty_plan():
    # the policy swaps the only running request out, then schedules nothing: plan() returns
    # None. The swap-out must still reach the batch that finally runs (the engine copies the
    # blocks to host then, and a later swap-in without that copy fails); it was dropped.
    loop, pol = loop_with(make_requests([(0, 8, 4)]), host_blocks=8)
    s = loop.waiting[0]
    pol.next_plan = plan_of((s, 8))
    loop.complete(loop.plan(0.0), 0.1)
    rounds = iter([plan_of(preempt=[(s, "swap")]), plan_of()])
    pol.next_plan = lambda view: next(rounds)
    assert loop.plan(0.1) is None and s.status.value == "swapped"
    pol.next_plan = plan_of((s, 1))
    batch = loop.plan(0.2)
    assert batch.swap_out and batch.swap_out[0][0] is s and batch.swap_in and batch.swap_in[0][0] is s
    assert batch.shape.swap_blocks == 2 * len(batch.swap_out[0][1])
