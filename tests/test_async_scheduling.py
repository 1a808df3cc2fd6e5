"""vLLM's async scheduling in the simulator: an arrival during a step waits one more step."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import FixedCost, make_loop, make_requests
from testbed.app.analysis.metrics import request_table
from testbed.policies import make_policy
from testbed.sim.simulation import Simulation


def table(reqs, async_scheduling, horizon=None, fast_forward=True):
    cost = FixedCost(0.01)
    sim = Simulation(reqs, lambda: make_loop(make_policy("vllm"), cost=cost), cost, horizon_s=horizon,
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
