"""vLLM's plan with its queue's head shut out: admission stops at the sequence cap before it looks at the
queue, and under `reserve_full_isl` a head short of blocks for its whole sequence stays short while the
decodes ahead of it only take blocks, so an all-decode batch repeats until a finish or an arrival whatever
waits (`VLLMPolicy.is_steady`), and the simulator may fast-forward it. Every result must stay what planning each
step gave (`fast_forward=False`): request outcomes and times, inter-token gaps, engine steps and the
per-step rows once back-to-back identical decode rows are merged. Not the KV free queue's block ids: a
fast-forwarded run takes its blocks request by request (`BlockManager.grow_decode_run`), as every run
always has, so two requests that each need a block in it may swap ids."""
from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FixedCost
from test_replica_runs import plans, requests, results, specs_st
from testbed.core.kv import BlockManager
from testbed.core.loop import SchedulerLimits, StepLoop
from testbed.policies import make_policy
from testbed.sim.simulation import Simulation


def replay(reqs, policy, max_seqs, num_blocks, fast_forward, async_scheduling, cost=FixedCost(0.01, 0.0005)):
    sim = Simulation(reqs, lambda: StepLoop(make_policy(policy), BlockManager(num_blocks, 4, True, 0, "scheduled"),
                                            SchedulerLimits(64, max_seqs, 10_000), cost, record_token_times=True),
                     cost, 1, None, fast_forward=fast_forward, async_scheduling=async_scheduling)
    return sim.run()


def outcome(out):
    """`results` without the KV free queue (index 2 of each loop's)."""
    _, per_loop, end = results(out, [])
    return [loop[:2] + loop[3:] for loop in per_loop], end


@settings(max_examples=int(os.environ.get("PROPERTY_EXAMPLES", 60)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(specs=specs_st, policy=st.sampled_from(["vllm", "vllm_priority"]), max_seqs=st.integers(1, 8),
       num_blocks=st.integers(12, 60), async_scheduling=st.booleans())
def test_runs_at_the_seq_cap_change_no_result(specs, policy, max_seqs, num_blocks, async_scheduling):
    reqs = requests(specs, None)
    runs = replay(reqs, policy, max_seqs, num_blocks, True, async_scheduling)
    steps = replay(reqs, policy, max_seqs, num_blocks, False, async_scheduling)
    assert outcome(runs) == outcome(steps)


def test_a_queue_behind_full_seats_takes_fewer_plans():
    """Twenty requests at once, four seats: the queue never empties until the end, and the batch only
    changes when a seat frees."""
    reqs = requests([(0.0, 8 + i % 5, 30 + (i * 7) % 20, (), "") for i in range(20)], None)
    for async_scheduling in (False, True):
        runs = replay(reqs, "vllm", 4, 400, True, async_scheduling)
        steps = replay(reqs, "vllm", 4, 400, False, async_scheduling)
        assert outcome(runs) == outcome(steps)
        assert plans(runs) < plans(steps) / 3, (async_scheduling, plans(runs), plans(steps))


def test_a_queue_shut_out_by_the_kv_takes_fewer_plans():
    """Seats to spare but blocks for three whole sequences at a time: the head waits for a finish's blocks,
    and the decodes ahead of it repeat meanwhile (`reserve_full_isl`, vLLM's default)."""
    reqs = requests([(0.0, 24, 40 + (i * 7) % 20, (), "") for i in range(12)], None)
    for async_scheduling in (False, True):
        runs = replay(reqs, "vllm", 16, 48, True, async_scheduling)
        steps = replay(reqs, "vllm", 16, 48, False, async_scheduling)
        assert outcome(runs) == outcome(steps)
        assert max(steps.loops[0].series.waiting) > 0
        # (runs stop where the KV growth outgrows the free blocks too: planning each step with a queue, as
        # before the rule, took 146 of 189 plans here)
        assert plans(runs) < plans(steps) * 2 / 3, (async_scheduling, plans(runs), plans(steps))
