"""The modelled HTTP/API front end: the engine sees requests late, the client sees tokens late.

Hand-computed runs on a fixed step cost check the shift in both directions (the engine's queue,
the client's clock); composed configs check `frontend=none` changes nothing, bad values and
non-simulator backends are refused, and a multi-replica run carries the delay through.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from conftest import FixedCost, make_loop, make_requests
from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.frontend import FrontendConfig, to_engine_queue
from testbed.app.analysis.metrics import SLO, request_table, summarize
from testbed.app.assembly.validate import ConfigError, check_config
from testbed.policies import make_policy
from testbed.routers import make_router
from testbed.sim.simulation import Simulation

STEP_S = 0.01


def simulate_with(reqs, frontend: FrontendConfig, replicas: int = 1):
    """(request table, summary) of a run whose every step takes STEP_S, behind `frontend`."""
    engine_reqs, clock = to_engine_queue(reqs, frontend)
    cost = FixedCost(STEP_S)
    out = Simulation(engine_reqs, lambda: make_loop(make_policy("vllm"), num_blocks=1024, budget=4096, cost=cost),
                     cost, replicas=replicas, router=make_router("round_robin")).run()
    table = request_table([(i, s) for i, l in enumerate(out.loops) for s in l.states], out.not_arrived, clock=clock)
    itl = np.concatenate([np.asarray(l.itl) for l in out.loops])
    return table, summarize(table, itl, SLO(), response_tail_s=clock.tail_s)


def config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_an_idle_server_adds_the_front_end_to_the_client_side_only():
    fe = FrontendConfig("t", request_s=0.02, output_token_s=0.003, completion_s=0.005)
    table, s = simulate_with(make_requests([(1.0, 8, 3)]), fe)
    r = table.iloc[0]
    assert r.arrival_s == 1.0 and r.engine_arrival_s == pytest.approx(1.02) and r.frontend_delay_ms == pytest.approx(20)
    # the engine: prefill at its own arrival, three tokens one step apart
    assert r.engine_queue_ms == pytest.approx(0) and r.engine_ttft_ms == pytest.approx(1e3 * STEP_S)
    assert r.engine_e2el_ms == pytest.approx(3e3 * STEP_S) and r.engine_tpot_ms == pytest.approx(1e3 * STEP_S)
    # the client: 20 ms before the queue, each token 3 ms late, the response's end 5 ms after the last
    assert r.ttft_ms == pytest.approx(r.engine_ttft_ms + 20 + 3)
    assert r.e2el_ms == pytest.approx(r.engine_e2el_ms + 20 + 3 + 5)
    assert r.tpot_ms == pytest.approx(r.engine_tpot_ms + 5 / 2)  # the end's delay spreads over the 2 later tokens
    assert r.queue_ms == pytest.approx(20)
    assert s["mean_ttft_ms"] == pytest.approx(s["engine_mean_ttft_ms"] + 23)
    assert s["p99_e2el_ms"] == pytest.approx(s["engine_p99_e2el_ms"] + 28)
    assert s["duration_s"] == pytest.approx(0.02 + 3 * STEP_S + 0.008)  # client's: arrival to the response's end
    assert s["mean_frontend_delay_ms"] == pytest.approx(20)


def test_the_engine_queue_follows_the_shifted_arrivals():
    # r0 is sent first with a long prompt; r1 a millisecond later with a short one. Tokenising
    # r0 takes 10 ms, r1 0.1 ms, so r1 reaches the engine's queue first and is served first.
    reqs = make_requests([(0.0, 1000, 4), (0.001, 10, 4)])
    engine_reqs, _ = to_engine_queue(reqs, FrontendConfig("t", prompt_token_s=1e-5))
    assert [r.id for r in engine_reqs] == [1, 0]
    table, _ = simulate_with(reqs, FrontendConfig("t", prompt_token_s=1e-5))
    r0, r1 = table.iloc[0], table.iloc[1]
    assert r1.engine_arrival_s == pytest.approx(0.0011) and r0.engine_arrival_s == pytest.approx(0.01)
    assert r1.first_scheduled_s == pytest.approx(r1.engine_arrival_s)  # an idle engine takes it at once
    assert r0.first_scheduled_s > r1.first_scheduled_s  # r0 arrived mid-step: it waits for the step's end
    assert r0.first_scheduled_s == pytest.approx(r1.engine_arrival_s + STEP_S)
    assert r0.engine_queue_ms == pytest.approx((r0.first_scheduled_s - r0.engine_arrival_s) * 1e3)
    # without the front end the trace's order holds
    plain, _ = simulate_with(reqs, FrontendConfig())
    assert plain.iloc[0].first_scheduled_s < plain.iloc[1].first_scheduled_s


def test_no_front_end_makes_client_and_engine_figures_equal():
    from testbed.app.analysis.results import format_table
    from testbed.app.assembly.run import simulate

    r = simulate(config("frontend=none", "trace.max_requests=300", "trace.rate_scale=4", "output.progress=false"))
    assert "engine" not in format_table(r.summary)
    for col in ("queue_ms", "ttft_ms", "tpot_ms", "e2el_ms"):
        assert r.requests[col].equals(r.requests[f"engine_{col}"]), col
    assert r.requests["arrival_s"].equals(r.requests["engine_arrival_s"])
    assert (r.requests["frontend_delay_ms"] == 0).all()
    s = r.summary
    assert s["frontend"] == "none" and s["completed"] == 300
    for metric in ("ttft", "tpot", "e2el", "queue"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert s[f"engine_{stat}_{metric}_ms"] == s[f"{stat}_{metric}_ms"], (stat, metric)


def test_a_front_end_on_several_replicas():
    from testbed.app.analysis.results import format_table
    from testbed.app.assembly.run import simulate

    r = simulate(config("trace.max_requests=300", "trace.rate_scale=4", "backend.replicas=2", "frontend=vllm_api",
                        "frontend.request_s=0.012", "frontend.output_token_s=0.001", "output.progress=false"))
    t, s = r.requests, r.summary
    table = format_table(s)
    assert "front end vllm_api" in table and "engine TTFT ms" in table and "engine E2E latency ms" in table
    assert s["frontend"] == "vllm_api" and s["completed"] == 300 and set(t["replica"]) == {0, 1}
    assert t["frontend_delay_ms"].to_numpy() == pytest.approx(12)
    assert (t["ttft_ms"] - t["engine_ttft_ms"]).to_numpy() == pytest.approx(13)
    assert (t["e2el_ms"] - t["engine_e2el_ms"]).to_numpy() == pytest.approx(13)
    assert s["mean_ttft_ms"] == pytest.approx(s["engine_mean_ttft_ms"] + 13)


@pytest.mark.parametrize("key", ["request_s", "prompt_token_s", "output_token_s", "completion_s"])
def test_a_negative_delay_is_refused_naming_the_key(key):
    with pytest.raises(ConfigError, match=rf"frontend\.{key}=-0\.5: must be >= 0"):
        check_config(config(f"frontend.{key}=-0.5"))
    with pytest.raises(ValueError, match=rf"frontend\.{key}=-0\.5: must be >= 0"):
        to_engine_queue(make_requests([(0, 4, 2)]), FrontendConfig(**{key: -0.5}))


@pytest.mark.parametrize("backend", ["engine", "vllm"])
def test_a_backend_without_an_http_front_end_refuses_one(backend):
    with pytest.raises(ConfigError) as e:
        check_config(config(f"backend={backend}", "frontend=vllm_api"))
    assert "frontend.request_s=0.0077: the simulator's only" in str(e.value)
    assert "frontend=none" in str(e.value)
    check_config(config(f"backend={backend}", "frontend=none"))  # the default is fine


def test_a_request_the_horizon_cuts_off_keeps_its_client_arrival():
    reqs = make_requests([(0.0, 8, 2), (5.0, 8, 2)])
    engine_reqs, clock = to_engine_queue(reqs, FrontendConfig("t", request_s=0.5))
    cost = FixedCost(STEP_S)
    out = Simulation(engine_reqs, lambda: make_loop(make_policy("vllm"), cost=cost), cost, horizon_s=5.2).run()
    table = request_table([(0, s) for s in out.loops[0].states], out.not_arrived, clock=clock)
    late = table.iloc[1]
    assert late.outcome == "unfinished" and late.arrival_s == 5.0 and late.engine_arrival_s == 5.5
    assert math.isnan(late.ttft_ms) and math.isnan(late.engine_ttft_ms)


def test_a_replay_without_the_front_end_refuses_a_configured_one():
    from testbed.app.assembly.run_setup import finish, prepare

    cfg = config("trace.max_requests=5", "frontend=vllm_api")
    setup = prepare(cfg)
    out = Simulation(setup.requests, lambda: setup.make_loop(cfg), setup.cost).run()  # the requests unshifted
    with pytest.raises(ValueError, match="frontend=vllm_api: backend=engine has no HTTP front end"):
        finish(cfg, setup, out, "engine", 0.0)
