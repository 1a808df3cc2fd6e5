"""The simulator end to end on tiny traces whose every number is computed by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import FixedCost, make_loop, make_requests
from testbed.app.analysis.metrics import SLO, request_table, summarize
from testbed.policies import make_policy
from testbed.routers import make_router
from testbed.sim.simulation import Simulation


def simulate(reqs, policy="vllm", replicas=1, horizon=None, cost=None, **loop_kw):
    cost = cost or FixedCost(0.01)
    sim = Simulation(reqs, lambda: make_loop(make_policy(policy), cost=cost, **loop_kw), cost,
                     replicas=replicas, router=make_router("round_robin"), horizon_s=horizon)
    out = sim.run()
    states = [(i, s) for i, l in enumerate(out.loops) for s in l.states]
    table = request_table(states, out.not_arrived)
    itl = np.concatenate([np.asarray(l.itl) for l in out.loops])
    return out, table, itl


def test_metrics_match_hand_computation():
    # r0: prompt 8, 3 tokens, arrives 0; r1: prompt 4, 1 token, arrives 5 ms. Every step takes 10 ms.
    # t=0-10 ms: r0 prefill -> first token at 10 ms. t=10-20: r0 decode + r1 prefill -> r0 token 2,
    # r1's only token (finished) at 20 ms. t=20-30: r0 decode -> token 3, finished at 30 ms.
    _, table, itl = simulate(make_requests([(0, 8, 3), (0.005, 4, 1)]))
    r0, r1 = table.iloc[0], table.iloc[1]
    assert r0.ttft_ms == pytest.approx(10) and r0.e2el_ms == pytest.approx(30) and r0.tpot_ms == pytest.approx(10)
    assert r1.ttft_ms == pytest.approx(15) and r1.e2el_ms == pytest.approx(15) and math.isnan(r1.tpot_ms)
    assert r1.queue_ms == pytest.approx(5) and r0.queue_ms == pytest.approx(0)
    assert sorted(itl * 1e3) == pytest.approx([10, 10])
    s = summarize(table, itl, SLO(name="t", ttft_ms=12))
    assert s["completed"] == 2 and s["rejected"] == 0 and s["unfinished"] == 0
    assert s["duration_s"] == pytest.approx(0.03)
    assert s["request_throughput"] == pytest.approx(2 / 0.03)
    assert s["output_throughput"] == pytest.approx(4 / 0.03)
    assert s["total_token_throughput"] == pytest.approx(16 / 0.03)
    assert s["mean_ttft_ms"] == pytest.approx(12.5) and s["median_ttft_ms"] == pytest.approx(12.5)
    assert s["p99_ttft_ms"] == pytest.approx(10 + 5 * 0.99)
    assert s["mean_tpot_ms"] == pytest.approx(10) and s["mean_itl_ms"] == pytest.approx(10)
    assert s["good_requests"] == 1 and s["request_goodput"] == pytest.approx(1 / 0.03)
    assert s["slo_attainment"] == pytest.approx(0.5)
    assert s["slo_checks"]["p99_ttft_ms<=12"] is False and s["slo_pass"] is False


def test_rejections_are_counted_with_reasons():
    reqs = make_requests([(0, 8, 2), (0, 9000, 10), (0.1, 4, 2)])
    _, table, itl = simulate(reqs, max_len=8192)
    s = summarize(table, itl, SLO())
    assert (s["completed"], s["rejected"], s["unfinished"]) == (2, 1, 0)
    assert table.iloc[1].outcome == "rejected" and "max_model_len 8192" in table.iloc[1].reason
    assert s["reject_reasons"] == {"too-long": 1}
    # a request that could never fit in the KV cache, even alone, is rejected too
    _, table, _ = simulate(make_requests([(0, 100, 5)]), num_blocks=8, block_size=4)
    assert table.iloc[0].outcome == "rejected" and table.iloc[0].reason.startswith("exceeds-kv")


@pytest.mark.parametrize("policy", ["vllm", "static"])
def test_preemption_under_kv_pressure_finishes_everything(policy):
    # 12 requests of 20+30 tokens = 13 blocks each at block size 4, in a 32-block cache: decodes outgrow it.
    reqs = make_requests([(0.001 * i, 20, 30) for i in range(12)])
    out, table, itl = simulate(reqs, policy=policy, num_blocks=32, block_size=4, budget=64, max_seqs=8)
    assert (table.outcome == "finished").all()
    assert (table.generated == table.output_len).all()
    if policy == "vllm":
        assert table.preemptions.sum() > 0  # the point of the scenario
    else:
        assert table.preemptions.sum() == 0  # static batching reserves KV up front
    loop = out.loops[0]
    assert loop.kv.num_free_blocks == loop.kv.num_blocks  # nothing leaked


def test_swap_preemption_finishes_everything():
    reqs = make_requests([(0.001 * i, 20, 30) for i in range(12)])
    cost = FixedCost(0.01)
    sim = Simulation(reqs, lambda: make_loop(make_policy("vllm", preemption_mode="swap"), num_blocks=32,
                                             block_size=4, host_blocks=64, cost=cost), cost)
    out = sim.run()
    states = out.loops[0].states
    assert all(s.status.value == "finished" for s in states)
    assert sum(s.num_preemptions for s in states) > 0
    steps = out.loops[0].series
    assert sum(steps.preemptions) > 0


def test_horizon_leaves_requests_unfinished_and_accounted():
    reqs = make_requests([(0, 8, 50), (0.2, 8, 5), (10.0, 8, 5)])
    out, table, itl = simulate(reqs, horizon=0.3)
    s = summarize(table, itl, SLO())
    assert s["num_requests"] == 3
    assert s["completed"] + s["rejected"] + s["unfinished"] == 3
    assert table.iloc[2].reason == "arrives after the horizon"
    assert table.iloc[0].outcome == "unfinished"


def test_replicas_split_the_load():
    reqs = make_requests([(0.001 * i, 8, 4) for i in range(10)])
    out, table, _ = simulate(reqs, replicas=2)
    assert sorted(table.replica.unique()) == [0, 1]
    assert (table.outcome == "finished").all()


def test_same_seed_same_results():
    reqs = make_requests([(0.003 * i, 10 + i % 7, 3 + i % 5) for i in range(40)])
    a = simulate(reqs, num_blocks=24, block_size=4)[1]
    b = simulate(reqs, num_blocks=24, block_size=4)[1]
    assert a.equals(b)
