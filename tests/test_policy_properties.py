"""One property test for every registered policy: register a policy and it is covered.

Random small traces (shared prefixes included), random KV capacities, budgets and
sequence caps. Checked at every step: the plan respects the token budget, the sequence
cap and KV capacity, and the block manager's books balance. Checked at the end: every
request is accounted for exactly once, every request that fits in the cache on its own
finished, and the run terminated (a step cap catches livelock). Set PROPERTY_EXAMPLES for
a longer search (CI runs 40 examples a policy).
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FixedCost
from testbed.core.kv import BlockManager
from testbed.core.loop import SchedulerLimits, StepLoop
from testbed.policies import make_policy, registered
from testbed.core.request import Request, Status
from testbed.sim.simulation import Simulation

MAX_STEPS = 20_000


class CheckedLoop(StepLoop):
    """A step loop that re-checks the invariants itself after every plan."""

    steps = 0

    def plan(self, now):
        batch = super().plan(now)
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise AssertionError(f"policy {self.policy_name!r}: no termination after {MAX_STEPS} steps")
        if batch is not None:
            assert sum(n for _, n in batch.items) <= self.limits.max_num_batched_tokens
            assert len(batch.items) <= self.limits.max_num_seqs
            for s, n in batch.items:
                assert s.status is Status.RUNNING
                assert s.num_computed + n <= s.known_len, "decode before prefill, or past the known tokens"
                assert len(s.blocks) * self.kv.block_size >= s.num_computed + n
        assert self.kv.num_used_blocks <= self.kv.num_blocks
        self.kv.check_invariants(self.live.values())
        return batch


requests_st = st.lists(
    st.tuples(st.floats(0, 0.5), st.integers(1, 60), st.integers(1, 20), st.integers(0, 2), st.integers(0, 2)),
    min_size=1, max_size=12)


@pytest.mark.parametrize("name", sorted(registered()))
@settings(max_examples=int(os.environ.get("PROPERTY_EXAMPLES", 40)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(specs=requests_st, num_blocks=st.integers(4, 48), block_size=st.integers(1, 8),
       budget=st.integers(8, 128), max_seqs=st.integers(1, 8), host=st.sampled_from([0, 16]))
def test_every_policy_keeps_the_invariants(name, specs, num_blocks, block_size, budget, max_seqs, host):
    arrivals = sorted(s[0] for s in specs)
    reqs = [Request(id=i, arrival=t, prompt_len=p, output_len=o, tenant=f"t{tenant}", priority=prio,
                    prefix_hashes=(7, 8) if p > 16 and tenant == 0 else (), prefix_block_tokens=8)
            for i, (t, (_, p, o, tenant, prio)) in enumerate(zip(arrivals, specs))]
    cost = FixedCost(0.01, 0.0005)
    limits = SchedulerLimits(budget, max_seqs, 10_000)
    sim = Simulation(reqs, lambda: CheckedLoop(make_policy(name), BlockManager(num_blocks, block_size, True, host, "finished" if name == "sglang" else "scheduled"),
                                               limits, cost), cost)
    out = sim.run()
    loop = out.loops[0]
    assert not out.stalled, f"policy {name!r} stalled with requests left"
    assert sorted(s.req.id for s in loop.states) == [r.id for r in reqs]  # none lost, none twice
    for s in loop.states:
        fits = -(-s.req.total_len // block_size) <= num_blocks
        if fits:
            assert s.status is Status.FINISHED, f"request {s.req.id} ended {s.status.value}: {s.reject_reason}"
            assert s.num_generated == s.req.output_len
        else:
            assert s.status is Status.REJECTED
    assert loop.kv.num_free_blocks == num_blocks and loop.kv.num_free_host_blocks == host
