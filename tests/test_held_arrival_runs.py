"""vLLM's async scheduling holds an arrival back until after the next plan, so the step after a decode
run stopped by an arrival is planned without it: the same plan again. The simulator folds that step
into the run (`Simulation(fold_held_arrivals=True)`, `StepLoop.extend_decode_run(one_past=...)`); every
result must stay what planning it on its own gave: request outcomes and times, inter-token gaps, the
KV free queue, engine steps and the per-step rows once back-to-back identical decode rows are merged."""
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


def replay(reqs, policy, num_blocks, cost, fold, cache_decode, async_scheduling=True, horizon=None):
    sim = Simulation(reqs, lambda: StepLoop(make_policy(policy), BlockManager(num_blocks, 4, True, 0, cache_decode),
                                            SchedulerLimits(64, 6, 10_000), cost, record_token_times=True),
                     cost, 1, None, horizon_s=horizon, async_scheduling=async_scheduling, fold_held_arrivals=fold)
    return sim.run()


@settings(max_examples=int(os.environ.get("PROPERTY_EXAMPLES", 60)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(specs=specs_st, policy=st.sampled_from(["vllm", "sarathi", "sglang", "orca", "vllm_v0", "vllm_priority", "edf", "vtc", "trtllm"]),
       num_blocks=st.integers(12, 60), tied=st.booleans(), cache_decode=st.sampled_from(["scheduled", "finished"]),
       horizon=st.sampled_from([None, 5.0, 66.0]))
def test_folding_the_step_after_a_held_arrival_changes_no_result(specs, policy, num_blocks, tied, cache_decode,
                                                                  horizon):
    cost = FixedCost(0.25, 0.0) if tied else FixedCost(0.01, 0.0005)  # 0.25: exact sums, arrivals tie with steps
    reqs = requests(specs, 0.25 if tied else None)
    new = replay(reqs, policy, num_blocks, cost, True, cache_decode, horizon=horizon)
    old = replay(reqs, policy, num_blocks, cost, False, cache_decode, horizon=horizon)
    assert results(new, []) == results(old, [])
    assert plans(new) <= plans(old)


def test_a_steady_stream_takes_fewer_plans_with_the_same_results():
    """Arrivals between the steps of long decodes: each one's held step is folded into the run before it."""
    specs = [(0.29 * i, 8 + i % 7, 60 + (i * 7) % 25, (), "") for i in range(40)]
    reqs = requests(specs, None)
    cost = FixedCost(0.01, 0.0005)
    new = replay(reqs, "vllm", 400, cost, True, "scheduled")
    old = replay(reqs, "vllm", 400, cost, False, "scheduled")
    assert results(new, []) == results(old, [])
    assert plans(new) < plans(old) - 20, (plans(new), plans(old))
    # without async scheduling nothing is held back, and nothing is folded
    sync_new = replay(reqs, "vllm", 400, cost, True, "scheduled", async_scheduling=False)
    sync_old = replay(reqs, "vllm", 400, cost, False, "scheduled", async_scheduling=False)
    assert plans(sync_new) == plans(sync_old)
