"""Disaggregated prefill/decode: requests conserved across the pools, the transfer inside TTFT, the
decode side waiting for KV space, the co-located path untouched, bad config refused."""
from __future__ import annotations

import math

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FixedCost, make_loop, make_requests
from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.plugins import make_policy
from testbed.app.analysis.results import summary_json
from testbed.app.assembly.run import simulate
from testbed.app.assembly.validate import ConfigError, check_config
from testbed.core.request import Status
from testbed.sim.disaggregated import DisaggSimulation, Pool
from testbed.sim.kv_link import LINK_PRESETS, KVLink
from testbed.routers.round_robin import RoundRobin


def cell(text: str, table: str) -> bool:
    """`text` is a whole cell of a Markdown table in `table`, whatever its padding."""
    import re

    return re.search(r"\|\s*" + re.escape(text) + r"\s*\|", table) is not None


def config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        # no front end: the handoff's times are the engine's (a front end adds its delays on top: test_frontend.py)
        return compose("config", overrides=["output.progress=false", "frontend=none", *overrides])


DISAGG = ["disagg.enabled=true", "disagg.prefill.replicas=2", "disagg.decode.replicas=2"]


def spaced(n=6, prompt=2000, output=8, gap=30.0):
    """Requests far enough apart that none meets another on any replica."""
    return make_requests([(i * gap, prompt, output) for i in range(n)])


def accounted(result, rows):
    s, t = result.summary, result.requests
    assert s["num_requests"] == rows == len(t) == t["id"].nunique()
    assert s["completed"] + s["rejected"] + s["unfinished"] == rows


def test_every_request_is_accounted_for_once_across_the_pools():
    result = simulate(config("trace.max_requests=400", "trace.rate_scale=4", *DISAGG))
    accounted(result, 400)
    t = result.requests
    done = t[t["outcome"] == "finished"]
    assert len(done) == 400
    assert (done["prefill_replica"].between(0, 1) & done["decode_replica"].between(0, 1)).all()
    assert (done["replica"] == 2 + done["decode_replica"]).all()  # decode replicas numbered after the prefill ones
    assert (done["generated"] == done["output_len"]).all()  # the decode replica makes every token
    assert (done["kv_transfer_ms"] > 0).all()
    assert set(result.steps["pool"]) == {"prefill", "decode"}
    s = result.summary
    assert s["prefill_replicas"] == s["decode_replicas"] == 2 and 0 < s["prefill_utilization"] < 1
    assert 0 < s["decode_utilization"] < 1 and s["mean_kv_transfer_ms"] > 0


def test_ttft_includes_the_transfer_and_a_slower_link_adds_it_to_every_request():
    reqs = spaced()
    fast = simulate(config(*DISAGG, "disagg.link.name=nvlink"), requests=reqs).requests
    slow = simulate(config(*DISAGG, "disagg.link.name=roce", "disagg.link.bandwidth_GBps=2"), requests=reqs).requests
    extra = slow["kv_transfer_ms"] - fast["kv_transfer_ms"]
    assert (extra > 10).all()  # 2000 tokens of 128 KiB over 1.6 GB/s effective: about 160 ms
    assert (slow["ttft_ms"] - fast["ttft_ms"] >= extra - 1e-6).all()
    # the first token comes after prefill, the decode KV wait, the link and the transfer
    after = (slow["first_token_s"] - slow["prefilled_s"]) * 1e3
    assert (after > slow["kv_wait_ms"] + slow["kv_link_wait_ms"] + slow["kv_transfer_ms"]).all()


def test_with_an_instant_link_ttft_is_the_prefill_step_plus_the_first_decode_step():
    reqs = spaced()
    result = simulate(config(*DISAGG, "disagg.link.bandwidth_GBps=1e15", "disagg.link.latency_us=0"), requests=reqs)
    t, steps = result.requests, result.steps
    prefill = steps[steps["pool"] == "prefill"].sort_values("start")["duration"].to_numpy()
    first_decode = steps[(steps["pool"] == "decode") & (steps["prefill_tokens"] == 1)].sort_values("start")
    assert len(prefill) == len(first_decode) == len(reqs)  # one prefill and one recompute step each
    expected = (prefill + first_decode["duration"].to_numpy()) * 1e3
    assert t["ttft_ms"].to_numpy() == pytest.approx(expected, abs=1e-6)


def test_a_tiny_decode_kv_makes_requests_wait_for_space_and_all_finish():
    # 3 requests at once, 2000-token prompts (125 blocks of 16); the decode replica holds 300 blocks
    reqs = make_requests([(0.0, 2000, 64)] * 3)
    result = simulate(config("disagg.enabled=true", "disagg.decode.num_blocks=300"), requests=reqs)
    accounted(result, 3)
    t = result.requests
    assert (t["outcome"] == "finished").all()
    assert (t["kv_wait_ms"] > 0).sum() >= 1  # the third waits for the first to finish decoding
    assert result.summary["p99_kv_wait_ms"] > 0 and result.summary["decode_kv_blocks"] == 300


def test_a_request_the_decode_pool_can_never_hold_is_rejected_at_the_door():
    reqs = make_requests([(0.0, 2000, 64), (1.0, 100, 10)])
    result = simulate(config("disagg.enabled=true", "disagg.decode.num_blocks=100"), requests=reqs)
    accounted(result, 2)
    t = result.requests.set_index("id")
    assert t.loc[0, "outcome"] == "rejected" and "decode pool" in t.loc[0, "reason"]
    assert t.loc[1, "outcome"] == "finished"


def test_a_horizon_leaves_every_request_accounted_for_with_where_it_stopped():
    # the prefill KV fills with prompts waiting for a slow link: prefill replicas wait for it, never stall
    result = simulate(config("trace.max_requests=500", "trace.rate_scale=8", "backend.horizon_s=20",
                             "disagg.enabled=true", "disagg.prefill.num_blocks=1000", "disagg.link.bandwidth_GBps=0.5"))
    accounted(result, 500)
    s, t = result.summary, result.requests
    assert not s["stalled"] and 0 < s["completed"] < 500
    reasons = set(t.loc[t["outcome"] == "unfinished", "reason"])
    assert reasons <= {"unfinished at the horizon", "unfinished at the horizon (KV in transfer to the decode pool)",
                       "unfinished at the horizon (waiting for decode KV space)"}
    assert "unfinished at the horizon (KV in transfer to the decode pool)" in reasons


@pytest.mark.parametrize("extra", [[], ["policy=sarathi"], ["backend.replicas=3"]])
def test_disagg_keys_are_inert_when_disabled(extra):
    base = simulate(config("trace.max_requests=300", *extra)).summary
    off = simulate(config("trace.max_requests=300", "disagg.enabled=false", "disagg.prefill.replicas=3",
                          "disagg.link.name=nvlink", "disagg.decode.policy=sarathi", *extra)).summary
    assert summary_json(base) == summary_json(off)
    assert "disagg" not in base


def test_pools_take_their_own_hardware_parallelism_and_policy():
    s = simulate(config("trace.max_requests=100", "model=llama3_1_70b", "parallel.tensor_parallel_size=4",
                        "disagg.enabled=true", "disagg.prefill.hardware=h200", "disagg.decode.tensor_parallel_size=8",
                        "disagg.decode.policy=sarathi")).summary
    assert s["completed"] == 100
    assert (s["prefill_hardware"], s["decode_hardware"]) == ("h200-sxm", "h100-sxm")
    assert (s["prefill_tensor_parallel_size"], s["decode_tensor_parallel_size"]) == (4, 8)
    assert (s["prefill_gpus"], s["decode_gpus"]) == (4, 8)
    assert (s["prefill_policy"], s["decode_policy"]) == ("vllm", "sarathi")
    assert s["decode_kv_blocks"] > s["prefill_kv_blocks"]  # 8 GPUs hold more KV than 4


@pytest.mark.parametrize("overrides, message", [
    (["disagg.link.name=carrier_pigeon"], r"disagg.link.name='carrier_pigeon': expected one of nvlink, infiniband"),
    (["disagg.prefill.hardware=h900"], r"disagg.prefill: hardware='h900': no such preset; expected one of .*h100"),
    (["disagg.decode.policy=nope"], r"disagg.decode: .*nope"),
    (["disagg.decode.tensor_parallel_size=3"], r"disagg.decode: .*tensor_parallel_size"),
    (["backend.replicas=2"], r"backend.replicas=2: with disagg.enabled=true .*disagg.prefill.replicas"),
    (["backend.async_scheduling=true"], r"async_scheduling=true: not modelled with disagg"),
])
def test_bad_disagg_settings_get_clear_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        simulate(config("trace.max_requests=20", "disagg.enabled=true", *overrides))


@pytest.mark.parametrize("override, message", [
    ("disagg.prefill.replicas=0", r"disagg.prefill.replicas=0: must be >= 1"),
    ("disagg.link.latency_us=-1", r"disagg.link.latency_us=-1.*must be >= 0"),
    ("disagg.link.efficiency=1.5", r"disagg.link.efficiency=1.5: must be > 0 and <= 1"),
    ("+disagg.decode.replica=2", r"disagg.decode.replica: unknown key \(did you mean disagg.decode.replicas\?\)"),
])
def test_out_of_range_and_unknown_disagg_keys_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        check_config(config(override))


def test_the_engine_refuses_disaggregation():
    with pytest.raises(ConfigError, match=r"disagg.enabled=true: the simulator's only .*backend=engine would ignore it"):
        check_config(config("backend=engine", "model=tiny_llama", "disagg.enabled=true"))


def test_link_presets_and_overrides():
    assert set(LINK_PRESETS) == {"nvlink", "infiniband", "roce"}
    nv, ib = LINK_PRESETS["nvlink"], LINK_PRESETS["infiniband"]
    assert nv[0] > ib[0]  # NVLink carries more than one NIC
    link = KVLink("x", 50e9, 5e-6, 0.5, True)
    assert link.transfer_s(1000, 1000) == pytest.approx(5e-6 + 1e6 / 25e9)


# --- the simulation itself, on hand-made loops --------------------------------------------------------------

@st.composite
def workloads(draw):
    n = draw(st.integers(1, 25))
    gaps = draw(st.lists(st.floats(0, 0.2), min_size=n, max_size=n))
    t, specs = 0.0, []
    for g in gaps:
        t += g
        specs.append((t, draw(st.integers(1, 60)), draw(st.integers(1, 30))))
    return (make_requests(specs), draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(16, 64)),
            draw(st.integers(8, 64)), draw(st.booleans()))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_no_request_is_lost_or_duplicated_across_the_pools(work):
    reqs, n_prefill, n_decode, prefill_blocks, decode_blocks, serialize = work

    def pool(name, n, blocks):
        return Pool(name, [make_loop(make_policy("vllm"), num_blocks=blocks, max_seqs=4) for _ in range(n)],
                    FixedCost(0.01, 0.001), RoundRobin())

    sim = DisaggSimulation(reqs, pool("prefill", n_prefill, prefill_blocks), pool("decode", n_decode, decode_blocks),
                           KVLink("t", 1e6, 0.002, 1.0, serialize), kv_bytes_per_token=100)
    out = sim.run()
    assert [h.req.id for h in out.handoffs] == [r.id for r in reqs] and not out.not_arrived and not out.stalled
    prefill_ids = [s.req.id for loop in out.prefill.loops for s in loop.states]
    decode_ids = [s.req.id for loop in out.decode.loops for s in loop.states]
    assert len(set(prefill_ids)) == len(prefill_ids) and len(set(decode_ids)) == len(decode_ids)
    for h in out.handoffs:
        if h.rejected is not None:  # the decode pool could never hold it: no replica saw it
            assert h.req.id not in prefill_ids and h.req.id not in decode_ids
            assert h.req.total_len > decode_blocks * 4
            continue
        assert h.prefill.status is Status.FINISHED and h.decode.status is Status.FINISHED
        assert h.decode.num_generated == h.req.output_len
        assert h.prefilled_s <= h.reserved_s <= h.sending_s < h.landed_s <= h.decode.first_token_time
        assert h.decode.first_token_time >= h.req.arrival
    for loop in out.prefill.loops + out.decode.loops:  # every block back: nothing held past its transfer
        assert loop.kv.num_free_blocks == loop.kv.num_blocks and not loop.receiving
    assert all(math.isfinite(b) for b in out.prefill.busy_s + out.decode.busy_s)


def test_the_pool_ratio_search_tries_every_split_and_names_the_best(tmp_path):
    import json
    import os
    import subprocess
    import sys

    import pandas as pd

    out = tmp_path / "search"
    proc = subprocess.run([sys.executable, "-m", "testbed.app.analysis.disagg_search", "trace.max_requests=200",
                           "disagg.search_total_replicas=3", "disagg.search_rate_scales=[2]", "capacity.lo=1",
                           "capacity.hi=32", "capacity.rel_tol=0.3", f"output.dir={out}"],
                          capture_output=True, text=True, env={**os.environ, "HYDRA_FULL_ERROR": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((out / "search.json").read_text())
    assert [a["layout"] for a in res["layouts"]] == ["colocated x3", "1P:2D", "2P:1D"]
    for a in res["layouts"]:
        met = [c["rate_scale"] for c in a["curve"] if c["slo_attainment"] >= res["attainment_target"]]
        assert a["max_rate_scale"] == (max(met) if met else None)
    splits = [a for a in res["layouts"] if a["prefill_replicas"] and a["max_rate_scale"]]
    assert res["best_split"] == max(splits, key=lambda a: a["max_rate_scale"])["layout"]
    grid = pd.read_csv(out / "sweep_summary.csv")
    assert len(grid) == 3 and set(grid["rate_scale"]) == {2}
    assert "best prefill:decode split" in (out / "table.md").read_text() and cell("1P:2D", proc.stdout)


def test_speculative_decoding_runs_on_the_decode_pool_and_reports_its_figures():
    plain = simulate(config("trace.max_requests=200", *DISAGG))
    spec = simulate(config("trace.max_requests=200", *DISAGG, "spec_decode.method=ngram",
                           "spec_decode.acceptance_rate=1.0", "spec_decode.num_speculative_tokens=3"))
    accounted(spec, 200)
    s = spec.summary
    assert s["spec_decode_method"] == "ngram" and s["spec_num_drafts"] > 0
    assert 3.5 < s["spec_mean_acceptance_length"] <= 4.0  # every draft accepted: 4 tokens a step (fewer at the end)
    assert s["mean_tpot_ms"] < plain.summary["mean_tpot_ms"]
    assert "spec_decode_method" not in plain.summary
