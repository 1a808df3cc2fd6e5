"""`sglang` makes SGLang 0.5.23's decisions, step by step, on crafted scenarios.

Each expected plan is worked out by hand from SGLang's source (the sglang 0.5.23 wheel,
`srt/managers/scheduler.py` S, `schedule_policy.py` P, `schedule_batch.py` B,
`mem_cache/prefill_budget.py` M): page size 1, KV counted in tokens, FixedCost steps.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import FixedCost, make_loop, make_requests
from testbed.policies import make_policy
from testbed.core.request import Status
from testbed.policies.sglang import dfs_weight_order, in_batch_deprioritized
from testbed.sim.simulation import Simulation


def run_sglang(reqs, num_blocks, knobs=None, budget=16384, max_seqs=4096, prefix=True):
    """Simulate with SGLang's KV (page 1, decode tokens cached at finish); returns (loop, steps)
    with each step as ([(request id, tokens)], [retracted ids])."""
    pol = make_policy("sglang", **(knobs or {}))
    steps = []
    inner = pol.schedule

    pol.ratios = []

    def schedule(view):
        plan = inner(view)
        pol.ratios.append(pol.ratio)
        if plan.preempt:
            pol.retracting = plan
        if plan:
            steps.append(([(s.req.id, n) for s, n in plan.items], [s.req.id for s, _ in plan.preempt]))
        return plan
    pol.schedule = schedule
    cost = FixedCost(0.01, 0.0001)
    out = Simulation(reqs, lambda: make_loop(pol, num_blocks=num_blocks, block_size=1, budget=budget,
                                             max_seqs=max_seqs, cost=cost, cache_decode_tokens="finished",
                                             prefix=prefix),
                     cost, fast_forward=False).run()
    loop = out.loops[0]
    assert all(s.status.value == "finished" for s in loop.states), [s.status for s in loop.states]
    return loop, steps, pol


def test_admission_is_a_strict_inequality_with_one_page_and_the_whole_output_reserved():
    # 100 KV tokens. A (40 + 20) passes 40 + 20 + 1 < 100 and reserves 40 + 1 + 20 = 61 (M L156-168):
    # 39 left. B (p + 20) passes only if p + 20 + 1 < 39 (M L125-127): p = 17 joins A's prefill,
    # p = 18 is refused. The refusal marks the running batch full (S L4282), but that batch is
    # empty, so the mark is lost (S L3952-3955, L4093-4096; referee scenario admit_strict_refused):
    # step 2 tries B again with 60 free less A's 19 outputs to come: 18 + 20 + 1 < 41 passes.
    for b_prompt, joins in ((17, True), (18, False)):
        reqs = make_requests([(0.0, 40, 20), (0.0, b_prompt, 20)])
        _, steps, _ = run_sglang(reqs, 100)
        if joins:
            assert steps[0] == ([(0, 40), (1, b_prompt)], [])
        else:
            assert steps[0] == ([(0, 40)], [])
            assert steps[1] == ([(1, b_prompt)], [])


def test_a_refusal_beside_no_running_request_does_not_hold_admission():
    # Not fixed lengths: running requests count min(max_new - generated, 4096) * ratio (P L785-795).
    # A (40 + 50) passes 91 < 100 and leaves 9; B (10 + 10) needs 21 < 9: refused. The batch-full
    # mark lands on the empty running batch and is lost (S L3952-3955, L4093-4096), so step 2 tries
    # again: 60 - 49 * 0.7 = 25.7 > 21 admits B (SGLang's real scheduler agrees: referee scenario
    # refusal_holds_admission; an earlier version of this test held B until A finished).
    reqs = make_requests([(0.0, 40, 50), (0.0, 10, 10)])
    _, steps, _ = run_sglang(reqs, 100, knobs={"ignore_eos": False})
    assert steps[0] == ([(0, 40)], [])
    assert steps[1] == ([(1, 10)], [])
    assert steps[2] == ([(0, 1), (1, 1)], [])


def test_retraction_takes_the_latest_of_equals_re_estimates_the_ratio_and_requeues_at_the_back():
    # 42 KV tokens, ratio 0 (init 0). R0 (10 + 20) at t=0; R1 (10 + 20) arrives during step 1 and
    # passes 31 < 32 in step 2. Both decode from step 3, two tokens a step: the 22 free tokens last
    # 11 steps. Step 14: the decode does not fit (B L3432-3449), retract_decode (B L3451-3530) keeps
    # the order sorted by (outputs, -prompt) descending, stable, and pops the back: equal keys, so R1
    # (joined last) goes; R0 alone fits. Ratio: min(1, (12 + 20) / (20 + 1)) = 1 (R L36-44).
    # Its decode tokens are freed uncached and its prompt, released to the cache, is evicted at once:
    # release_req evicts until 20 tokens per kept request are free (B L2389-2392), and the radix
    # tree evicts whole leaves. Step 15: R1 needs 22 + 8 + 1 < 20 - 7 * 1.0: refused with R0 running,
    # the batch is full until R0 finishes; then R1 recomputes all 22 tokens.
    reqs = make_requests([(0.0, 10, 20), (0.005, 10, 20)])
    loop, steps, pol = run_sglang(reqs, 42, knobs={"ignore_eos": False, "init_new_token_ratio": 0.0})
    assert steps[0] == ([(0, 10)], [])
    assert steps[1] == ([(1, 10)], [])
    assert all(s == ([(0, 1), (1, 1)], []) for s in steps[2:13])
    assert steps[13] == ([(0, 1)], [1])
    assert all(s == ([(0, 1)], []) for s in steps[14:21])
    assert steps[21] == ([(1, 22)], [])
    assert all(s == ([(1, 1)], []) for s in steps[22:])
    assert len(steps) == 29
    # the retracting plan evicts the cache for the whole decode first (check_decode_mem, S L4469:
    # 2 tokens), then after R1's release until 20 tokens per kept request are free and R0's next
    # token fits (B L2389-2392, B L3459-3461)
    assert (pol.retracting.free_first, pol.retracting.keep_free) == (2, {1: 20})
    by_id = {s.req.id: s for s in loop.states}
    assert by_id[1].prefix_hit_tokens == 0 and by_id[1].num_preemptions == 1
    # with fixed lengths (ignore_eos, as a trace replay sends them) running outputs count at ratio 1:
    # R1 (31 < 32 - 19) is refused in step 2, and nothing is ever retracted
    _, fixed, _ = run_sglang(reqs, 42, knobs={"ignore_eos": True, "init_new_token_ratio": 0.0})
    assert fixed[1] == ([(0, 1)], []) and not any(p for _, p in fixed)


def test_a_retracted_request_goes_behind_the_requests_already_waiting():
    # As above, plus R2 (10 + 20) arriving at step 4: refused (31 < 20 fails), batch full. R1's
    # retraction at step 14 appends it behind R2 (S L3480-3495, L4539-4540), so once R0 finishes R2
    # is admitted first, and R1 (22 tokens to recompute: its prompt was evicted) is refused and waits again.
    reqs = make_requests([(0.0, 10, 20), (0.005, 10, 20), (0.04, 10, 20)])
    _, steps, _ = run_sglang(reqs, 42, knobs={"ignore_eos": False, "init_new_token_ratio": 0.0})
    assert steps[13] == ([(0, 1)], [1])
    assert steps[21] == ([(2, 10)], [])
    readmitted = next(i for i, (items, _) in enumerate(steps) if i > 13 and any(r == 1 for r, _ in items))
    assert readmitted > 21


def test_a_long_prompt_is_chunked_page_aligned_and_continues_first():
    # chunked_prefill_size 16: A (40 tokens) is cut to 16 and reserves no output yet (P L1640-1668),
    # which spends the chunk budget (budget_state OTHER, P L874-893). A continues first each step
    # (P L1140-1222); its last chunk (8) leaves 8 of the budget, which B (5) takes in the same step.
    reqs = make_requests([(0.0, 40, 2), (0.0, 5, 2)])
    _, steps, _ = run_sglang(reqs, 1000, knobs={"chunked_prefill_size": 16})
    assert [s[0] for s in steps] == [[(0, 16)], [(0, 16)], [(0, 8), (1, 5)], [(0, 1), (1, 1)]]


def test_lpm_defers_a_request_whose_prefix_an_earlier_one_will_cache():
    # R0 and R1 share 128 uncached prompt tokens (prefix ids 1, 2 of 64 tokens); R2 shares nothing.
    # lpm: R1 matches 128 >= 32 tokens of R0 in the scratch tree, so it goes last (P L346-396, L441-452):
    # step 1 prefills R0 and R2 (128 + 64 spend the 192-token chunk budget), step 2 R1 hits 127 tokens.
    # fcfs takes R1 in step 1, cut to 64 tokens, recomputing the prefix R0 computes beside it.
    reqs = make_requests([(0.0, 128, 2, (1, 2)), (0.0, 128, 2, (1, 2)), (0.0, 64, 2, (9,))], block_tokens=64)
    loop, steps, _ = run_sglang(reqs, 1000, knobs={"schedule_policy": "lpm", "chunked_prefill_size": 192})
    assert steps[0][0] == [(0, 128), (2, 64)]
    assert steps[1][0] == [(1, 1)]
    assert {s.req.id: s.prefix_hit_tokens for s in loop.states}[1] == 127
    _, steps, _ = run_sglang(reqs, 1000, knobs={"schedule_policy": "fcfs", "chunked_prefill_size": 192})
    assert steps[0][0] == [(0, 128), (1, 64)]


def _req(rid, ids, hit, p=64, prompt=256):
    return SimpleNamespace(id=rid, req=SimpleNamespace(prefix_hashes=ids, prefix_block_tokens=p, prompt_len=prompt)), hit


def test_dfs_weight_visits_heavier_subtrees_first_and_a_nodes_requests_after_its_children():
    # cached prefixes: A, C end at node (1, 2); E at (1, 2, 4); B at (1, 3) matched 64 tokens, so at
    # node (1); D at the root. _dfs_weight_order (base_prefix_cache.py L347-387): E, A, C, B, D.
    pairs = [_req("A", (1, 2), 128), _req("B", (1, 3), 64), _req("C", (1, 2), 128), _req("D", (), 0),
             _req("E", (1, 2, 4), 192)]
    queue = [s for s, _ in pairs]
    hit_of = {s.id: h for s, h in pairs}
    assert [s.id for s in dfs_weight_order(queue, hit_of)] == ["E", "A", "C", "B", "D"]


def test_in_batch_check_only_for_small_cached_prefixes():
    # a request already matching more than 32 cached tokens is never deferred (P L368)
    pairs = [_req("A", (1, 2), 0), _req("B", (1, 2), 0), _req("C", (1, 2), 64), _req("D", (1,), 0, prompt=20)]
    queue = [s for s, _ in pairs]
    hit_of = {s.id: h for s, h in pairs}
    # B shares 128 tokens with A: deferred; C matched 64 > 32 in the cache: not checked; D's 20-token
    # prompt shares only 20 < 32 tokens: kept
    assert in_batch_deprioritized(queue, hit_of) == {"B"}


def test_the_ratio_decays_per_decode_step_to_its_floor():
    # init 0.7, floor 0.7 * 0.14 = 0.098, decay (0.7 - 0.098) / 600 per decode step without
    # retraction (R L21-34, S L4541-4542); the prefill step does not decay it
    reqs = make_requests([(0.0, 4, 700)])
    _, steps, pol = run_sglang(reqs, 2000, knobs={"ignore_eos": False})
    decay = (0.7 - 0.098) / 600
    assert abs(pol.min_ratio - 0.098) < 1e-12 and abs(pol.decay - decay) < 1e-15
    # plan k (0: the prefill) sees the decays of the k - 1 decode steps before it
    for k in (1, 2, 300, 601):
        assert abs(pol.ratios[k] - max(0.098, 0.7 - decay * (k - 1))) < 1e-9, k
    assert pol.ratios[650] == pol.min_ratio


# --- ported from SGLang's own tests: test/srt/test_schedule_policy.py (sgl-project/sglang) --------------


def first_admitted(steps):
    order = []
    for items, _ in steps:
        order += [r for r, n in items if r not in order]
    return order


def test_ported_init_with_unknown_policy():
    with pytest.raises(ValueError, match="schedule_policy"):
        make_policy("sglang", schedule_policy="invalid")


def test_ported_calc_priority_fcfs_keeps_the_queue_order():
    # upstream: rids 1, 3, 2 (prompts [1,2], [1,2,3], [1]) stay in that order; one admitted at a time
    reqs = make_requests([(0.0, 2, 2), (0.0, 3, 2), (0.0, 1, 2)])
    _, steps, _ = run_sglang(reqs, 1000, knobs={"schedule_policy": "fcfs", "max_running_requests": 1})
    assert first_admitted(steps) == [0, 1, 2]


def test_ported_calc_priority_longest_output_first():
    # upstream: max_new_tokens 1000, 10, 100 for rids 1, 3, 2 -> order 1, 2, 3 (P L504-519)
    reqs = make_requests([(0.0, 2, 1000), (0.0, 3, 10), (0.0, 1, 100)])
    _, steps, _ = run_sglang(reqs, 5000, knobs={"schedule_policy": "lof", "max_running_requests": 1})
    assert first_admitted(steps) == [0, 2, 1]


def test_ported_init_with_disabled_cache_is_fcfs():
    # upstream: lpm over a disabled radix cache is FCFS (P L324-344). The in-batch scenario above,
    # without the prefix cache: R1 is no longer deferred behind R2
    reqs = make_requests([(0.0, 128, 2, (1, 2)), (0.0, 128, 2, (1, 2)), (0.0, 64, 2, (9,))], block_tokens=64)
    _, steps, _ = run_sglang(reqs, 1000, knobs={"schedule_policy": "lpm", "chunked_prefill_size": 192}, prefix=False)
    assert steps[0][0] == [(0, 128), (1, 64)]


def test_a_retracted_request_cut_one_token_short_continues_as_the_chunked_request():
    # R0 and R1 (8 + 30 each), chunk budget 4. R0 is retracted (here by hand) after 5 outputs: its
    # prompt stays in the radix tree, its outputs are freed, so it comes back with 8 cached and 13 - 8
    # = 5 to recompute (its last token is always recomputed). The chunk budget cuts that to 4,
    # leaving exactly one token, which RequestState.is_prefill reads as decoding. SGLang still holds
    # R0 as its chunked_req (S L4176-4184) and continues it with that one token in a prefill step
    # (add_chunked_req, P L1140-1222): R1 does not decode in that step.
    from testbed.core.cost import BatchShape
    from testbed.core.plan import RECOMPUTE
    pol = make_policy("sglang", chunked_prefill_size=4)
    loop = make_loop(pol, num_blocks=200, block_size=1, budget=16384 + 4, max_seqs=64,
                     cost=FixedCost(1.0, 0.0), cache_decode_tokens="finished")
    r0, r1 = (loop.arrive(r, 0.0) for r in make_requests([(0.0, 8, 30), (0.0, 8, 30)]))
    now = 0.0

    def step():
        nonlocal now
        batch = loop.plan(now)
        now += 1.0
        loop.complete(batch, now)
        return [(s.req.id, n) for s, n in batch.items]

    while r0.num_generated < 5:
        step()
    loop._preempt(r0, RECOMPUTE, BatchShape())
    assert step() == [(0, 4)]  # re-admitted: hit 8 of 13, a chunk of 4
    assert r0.prefix_hit_tokens == 8 and r0.remaining == 1 and not r0.is_prefill
    assert step() == [(0, 1)]  # the chunk's last token, a prefill step of its own
    assert sorted(step()) == [(0, 1), (1, 1)]  # both decode again


@settings(max_examples=200, deadline=None)
@given(changes=st.lists(st.tuples(st.sampled_from(["arrive", "admit", "admit_any", "retract", "arrive_inside"]),
                                  st.integers(0, 30), st.booleans()), max_size=40))
def test_the_waiting_queue_follows_the_waiting_list_as_a_rebuild_would(changes):
    # `_sync_queue` applies the last plan's admissions and the arrivals at the waiting list's end in place,
    # checks, and else rebuilds: the queue is always the old one without those that left, then the new ones
    # in the waiting list's order (admissions the plan did not make, a request arriving inside the list,
    # several changes between two plans)
    pol = make_policy("sglang")
    Running, Waiting = Status.RUNNING, Status.WAITING
    states, waiting, rid = {}, [], 0
    view = SimpleNamespace(waiting=waiting)
    expected: dict = {}
    for change, k, sync in changes:
        if change in ("arrive", "arrive_inside"):
            rid += 1
            s = states[rid] = SimpleNamespace(req=SimpleNamespace(id=rid), status=Waiting)
            waiting.insert(k % (len(waiting) + 1) if change == "arrive_inside" else len(waiting), s)
        elif change in ("admit", "admit_any") and waiting:
            s = waiting.pop(k % len(waiting))
            s.status = Running
            if change == "admit":
                pol._admitted.append(s)  # (as `_prefill` notes what it admits)
        elif change == "retract":
            back = [s for s in states.values() if s.status is Running]
            if back:
                s = back[k % len(back)]
                s.status = Waiting
                waiting.insert(k % (len(waiting) + 1), s)
                pol._queue[s.req.id] = s  # (as `_decode` queues what it retracts)
                expected[s.req.id] = s
        if not sync:  # (several changes between two plans)
            continue
        ids = {s.req.id for s in waiting}
        expected = {i: s for i, s in expected.items() if i in ids}
        for s in waiting:
            expected.setdefault(s.req.id, s)
        pol._sync_queue(view)
        assert list(pol._queue) == list(expected)
