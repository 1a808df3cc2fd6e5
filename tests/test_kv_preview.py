"""KVPreview: a plan made through it gets exactly the prefix hits it counted on.

vLLM admits requests one after another, each seeing the blocks those before it registered and
not the cached blocks their allocations evicted; the testbed's `vllm` policy plans that through
`view.kv_preview()` and the loop applies the plan afterwards. If the two disagreed, a request
would compute more or fewer tokens than its plan said, so every admission's predicted hit is
checked against what `_apply` really gave it, on random traces with shared prefixes, small
caches, preemption and re-admission.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.core import kv as kv_module
from testbed.core.kv import BlockManager
from testbed.core.loop import SchedulerLimits, StepLoop
from testbed.core.request import Request, RequestState
from testbed.policies.vllm import VLLMKnobs, VLLMPolicy

BS = 8

request = st.tuples(st.integers(0, 3), st.integers(1, 60), st.integers(1, 12),
                    st.lists(st.integers(1, 3), max_size=4))


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(request, min_size=2, max_size=14), blocks=st.integers(12, 30),
       budget=st.integers(8, 64), full_isl=st.booleans(), threshold=st.sampled_from([0, 16]))
def test_every_admission_gets_the_hit_its_plan_counted(reqs, blocks, budget, full_isl, threshold):
    predicted: dict[int, int] = {}
    real_admit = kv_module.KVPreview.admit

    def admit(self, state: RequestState, hit: int, revive: list[int], num_tokens: int) -> None:
        predicted[state.req.id] = hit * BS
        real_admit(self, state, hit, revive, num_tokens)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv_module.KVPreview, "admit", admit)
        run(predicted, reqs, blocks, budget, full_isl, threshold)


def run(predicted, reqs, blocks, budget, full_isl, threshold):
    kv = BlockManager(blocks, BS)
    loop = StepLoop(VLLMPolicy(VLLMKnobs(reserve_full_isl=full_isl, long_prefill_token_threshold=threshold)),
                    kv, SchedulerLimits(budget, 6, 80))
    pending = [Request(i, float(t), p, o, tuple(h), BS) for i, (t, p, o, h) in enumerate(sorted(reqs))]
    now, steps = 0.0, 0
    while (pending or loop.has_work) and steps < 2000:
        while pending and pending[0].arrival <= now:
            loop.arrive(pending.pop(0), now)
        predicted.clear()
        computed_before = {s.req.id: s.num_computed for s in loop.live.values()}
        batch = loop.plan(now) if loop.has_work else None
        for rid, hit in predicted.items():
            s = loop.live[rid]
            assert computed_before[rid] == 0 and s.num_computed == hit, (rid, hit, s.num_computed)
        kv.check_invariants(loop.live.values())
        if batch is None:
            now = pending[0].arrival if pending else now + 1
            continue
        now += 0.25
        loop.complete(batch, now)
        steps += 1
    assert not loop.has_work
    assert kv.num_free_blocks == blocks  # everything released at the end


def test_a_hit_evicted_by_an_earlier_admission_in_the_same_step_is_not_counted():
    """vLLM's free queue holds uncached blocks first, then cached ones least recently released
    first. A (keys 1-4) and E finish and release their blocks; B, admitted first in the next
    step, takes the 4 uncached blocks and A's tail block, evicting key 4; C, sharing A's whole
    prompt, then hits keys 1-3 only and computes 9 tokens, not 1."""
    kv = BlockManager(10, BS)
    loop = StepLoop(VLLMPolicy(VLLMKnobs()), kv, SchedulerLimits(64, 6, 80))
    loop.arrive(Request(0, 0.0, 32, 1, (1, 2, 3, 4), BS), 0.0)
    loop.arrive(Request(1, 0.0, 16, 1, (9, 10), BS), 0.0)
    loop.complete(loop.plan(0.0), 0.5)  # both finish: A's 4 and E's 2 blocks stay cached, unowned
    assert not loop.has_work and kv.num_free_blocks == 10
    loop.arrive(Request(2, 1.0, 40, 1), 1.0)  # B: 5 blocks
    loop.arrive(Request(3, 1.0, 33, 1, (1, 2, 3, 4, 5), BS), 1.0)  # C: A's prompt and one token more
    batch = loop.plan(1.0)
    assert [(s.req.id, n) for s, n in batch.items] == [(2, 40), (3, 9)]
    c = batch.items[1][0]
    assert c.num_computed == 24 and c.prefix_hit_tokens == 24
    kv.check_invariants(loop.live.values())
