"""vLLM's async scheduling in the simulator: an arrival during a step waits one more step."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FixedCost, make_loop, make_requests
from testbed.app.analysis.metrics import request_table
from testbed.policies import make_policy
from testbed.sim.simulation import Simulation


def table(reqs, async_scheduling=True, horizon=None, fast_forward=True, policy="vllm", per_token=0.0, **loop_kw):
    cost = FixedCost(0.01, per_token)
    sim = Simulation(reqs, lambda: make_loop(make_policy(policy), cost=cost, **loop_kw), cost, horizon_s=horizon,
                     fast_forward=fast_forward, async_scheduling=async_scheduling)
    out = sim.run()
    return request_table([(0, s) for s in out.loops[0].states], out.not_arrived)


@pytest.mark.parametrize("fast_forward", [True, False])
def test_an_arrival_during_a_step_is_scheduled_a_step_later(fast_forward):
    # r0 decodes from t=0 in 10 ms steps; r1 arrives at 15 ms, during the step 10-20 ms.
    # Synchronous: planned at 20 ms, first token at 30 ms (TTFT 15). Async: the step 20-30 ms was
    # planned at 10 ms without it; r1 runs 30-40 ms (TTFT 25).
    reqs = make_requests([(0, 8, 10), (0.015, 4, 3)])
    sync, asyn = table(reqs, False, fast_forward=fast_forward), table(reqs, True, fast_forward=fast_forward)
    assert sync.ttft_ms[1] == pytest.approx(15) and asyn.ttft_ms[1] == pytest.approx(25)
    assert sync.ttft_ms[0] == asyn.ttft_ms[0] == pytest.approx(10)  # it arrived with nothing in flight


def test_an_arrival_to_an_idle_engine_is_scheduled_at_once():
    reqs = make_requests([(0, 8, 2), (0.5, 4, 3)])
    assert table(reqs, True).ttft_ms.tolist() == pytest.approx(table(reqs, False).ttft_ms.tolist())


def test_requests_held_back_at_the_horizon_are_accounted_for():
    reqs = make_requests([(0, 8, 100), (0.015, 4, 3), (0.016, 4, 3)])
    t = table(reqs, True, horizon=0.019)
    assert len(t) == 3 and (t.outcome == "unfinished").sum() == 3
    assert np.isnan(t.ttft_ms[1:]).all()


def test_orca_admits_an_arrival_held_back_at_the_plan_after_it():
    # r0 decodes from t=0 in 10 ms steps (long after); r1 arrives at 15 ms, during the step 10-20 ms, held
    # back past the plan of the step 20-30 ms. Orca's steady batch ignores its queue (nothing changes its
    # admission but an arrival or a finish), so that step must not run on as a decode run: the plan at
    # 30 ms admits r1 (first token at 40 ms, TTFT 25), not the one after r0's last token.
    reqs = make_requests([(0, 8, 40), (0.015, 4, 3)])
    for ff in (True, False):
        t = table(reqs, fast_forward=ff, policy="orca", num_blocks=256, block_size=1, prefix=False)
        assert t.ttft_ms[1] == pytest.approx(25), f"fast_forward={ff}: TTFT {t.ttft_ms[1]}"


@pytest.mark.parametrize("policy", ["orca", "static", "vllm_v0", "trtllm", "fastserve", "vllm", "sarathi", "sglang"])
def test_fast_forward_changes_no_result_under_async_scheduling(policy):
    # arrivals land during steps (held back to the plan after the next) at every load the trace passes
    # through; merging steady steps into runs must not move any request's tokens
    rng = np.random.default_rng(11)
    n = 80
    rows = zip(np.cumsum(rng.exponential(0.03, n)), rng.integers(4, 80, n), rng.integers(2, 60, n))
    reqs = make_requests([(float(t), int(p), int(o)) for t, p, o in rows])
    kw = dict(num_blocks=512, block_size=4, budget=128, max_seqs=16)
    if policy == "sglang":
        kw.update(block_size=1, num_blocks=2048, cache_decode_tokens="finished")
    runs, steps = (table(reqs, fast_forward=ff, policy=policy, per_token=1e-4, **kw) for ff in (True, False))
    assert runs.outcome.tolist() == steps.outcome.tolist()
    for col in ("ttft_ms", "e2el_ms"):
        np.testing.assert_array_equal(runs[col].to_numpy(), steps[col].to_numpy(), err_msg=f"{policy}: {col}")
