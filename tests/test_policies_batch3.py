"""Length- and deadline-aware policies (sjf, srpt, ltr, edf, least_slack) and their
predictors, on tiny crafted traces where the rule decides the outcome: each test could
fail if the rule were wrong (FCFS, the usual counter-example, is run beside them)."""
from __future__ import annotations

import math
import statistics

import pytest

from conftest import FixedCost, make_loop, make_requests
from testbed.policies._predictors import PREDICTORS, make_predictor
from testbed.policies import make_policy
from testbed.core.request import Request
from testbed.sim.simulation import Simulation


def simulate(specs, policy, knobs=None, cost=None, fast_forward=False, **loop_kw):
    """Run (step by step unless asked), recording each plan: (now, [(id, tokens)], [preempted ids])."""
    cost = cost or FixedCost(0.01)
    pol = make_policy(policy, **(knobs or {}))
    steps = []
    inner = pol.schedule

    def schedule(view):
        plan = inner(view)
        steps.append((view.now, [(s.req.id, n) for s, n in plan.items], [s.req.id for s, _ in plan.preempt]))
        return plan

    pol.schedule = schedule
    reqs = make_requests(specs)
    out = Simulation(reqs, lambda: make_loop(pol, cost=cost, **loop_kw), cost, fast_forward=fast_forward).run()
    loop = out.loops[0]
    states = {s.req.id: s for s in loop.states}
    assert not out.stalled and all(s.status.value == "finished" for s in states.values())
    assert loop.kv.num_free_blocks == loop.kv.num_blocks  # nothing leaked
    return states, steps, pol


def finish_order(states):
    return [i for i, _ in sorted(states.items(), key=lambda kv: (kv[1].finish_time, kv[0]))]


def first_step(steps, rid):
    return next(i for i, (_, items, _) in enumerate(steps) if any(r == rid for r, _ in items))


# --- predictors -------------------------------------------------------------------------------------------

def _req(i, out):
    return Request(id=i, arrival=0.0, prompt_len=8, output_len=out)


def test_oracle_is_labelled_an_upper_bound():
    p = make_predictor("oracle")
    assert "upper bound" in p.label
    assert p.predict(_req(0, 123)) == 123


def test_noisy_oracle_is_deterministic_per_request_and_has_the_asked_sigma():
    reqs = [_req(i, 500) for i in range(4000)]
    a = make_predictor("noisy_oracle", sigma=0.7, seed=3)
    b = make_predictor("noisy_oracle", sigma=0.7, seed=3)
    forward = [a.predict(r) for r in reqs]
    backward = [b.predict(r) for r in reversed(reqs)][::-1]  # another instance, the other order
    assert forward == backward
    assert [a.predict(r) for r in reqs[:50]] == forward[:50]  # asking again changes nothing
    other = make_predictor("noisy_oracle", sigma=0.7, seed=4)
    assert sum(other.predict(r) != f for r, f in zip(reqs, forward)) > 3900  # the seed matters
    logs = [math.log(f / 500) for f in forward]
    assert statistics.fmean(logs) == pytest.approx(0.0, abs=0.05)
    assert statistics.stdev(logs) == pytest.approx(0.7, rel=0.05)
    assert make_predictor("noisy_oracle", sigma=0.0).predict(_req(1, 77)) == 77


def test_bucket_rounds_up_to_the_class_boundary():
    p = make_predictor("bucket", buckets=[16, 64, 256, 1024, 4096])
    got = [p.predict(_req(0, n)) for n in (1, 16, 17, 64, 65, 1000, 4096, 4097, 100_000)]
    assert got == [16, 16, 64, 64, 256, 1024, 4096, 8192, 8192]  # above the last: the open top class


@pytest.mark.parametrize("kwargs, words", [
    (dict(kind="bucket", buckets=[64, 16]), "increasing"),
    (dict(kind="bucket", buckets=[]), "empty"),
    (dict(kind="noisy_oracle", sigma=-1), "sigma"),
])
def test_bad_predictor_settings_fail_clearly(kwargs, words):
    with pytest.raises(ValueError, match=words):
        make_predictor(**kwargs)


def test_an_unknown_predictor_lists_the_options():
    with pytest.raises(ValueError) as e:
        make_predictor("neural")
    assert "'neural'" in str(e.value) and all(k in str(e.value) for k in PREDICTORS)
    for policy in ("sjf", "srpt", "ltr"):  # and a policy fails when built, not mid-run
        with pytest.raises(ValueError, match="policy.predictor"):
            make_policy(policy, predictor="neural")


# --- sjf ---------------------------------------------------------------------------------------------------

# max_num_seqs=1: r0 runs; a long r1 and then a short r2 queue up behind it.
BEHIND = [(0, 4, 5), (0.001, 4, 40), (0.002, 4, 3)]


def test_sjf_serves_a_short_request_queued_behind_a_long_one_first():
    states, _, _ = simulate(BEHIND, "sjf", max_seqs=1)
    assert finish_order(states) == [0, 2, 1]
    fcfs, _, _ = simulate(BEHIND, "vllm", max_seqs=1)
    assert finish_order(fcfs) == [0, 1, 2]


def test_sjf_does_not_displace_a_running_request():
    # The long r0 is already running when the short r1 arrives: sjf lets it finish.
    states, steps, _ = simulate([(0, 4, 30), (0.05, 4, 2)], "sjf", max_seqs=1)
    assert finish_order(states) == [0, 1]
    assert all(not pre for _, _, pre in steps)


def test_sjf_bucket_predictor_ties_within_a_class_go_fcfs():
    # 40 and 50 tokens are one class (64): FCFS between them; 3 tokens (class 16) first.
    specs = [(0, 4, 5), (0.001, 4, 50), (0.002, 4, 40), (0.003, 4, 3)]
    states, _, pol = simulate(specs, "sjf", dict(predictor="bucket"), max_seqs=1)
    assert finish_order(states) == [0, 3, 1, 2]
    oracle, _, _ = simulate(specs, "sjf", max_seqs=1)
    assert finish_order(oracle) == [0, 3, 2, 1]


# A long job (id 1) under a stream of short ones, one sequence at a time: shorter jobs are
# always waiting, so without aging it is served last.
STREAM = [(0, 4, 3), (0.001, 4, 30)] + [(0.002 + 0.02 * i, 4, 2) for i in range(60)]


@pytest.mark.parametrize("policy", ["sjf", "srpt"])
def test_starvation_promotion_serves_a_long_job_under_a_stream_of_short_ones(policy):
    starved, _, _ = simulate(STREAM, policy, dict(starvation_s=0), max_seqs=1)
    assert finish_order(starved)[-1] == 1
    states, steps, _ = simulate(STREAM, policy, dict(starvation_s=0.3), max_seqs=1)
    start = steps[first_step(steps, 1)][0]
    assert 0.3 < start - 0.001 < 0.36  # admitted once it has waited starvation_s (plus one step)
    assert finish_order(states).index(1) < 30  # long before the stream ends


# --- srpt --------------------------------------------------------------------------------------------------

def test_srpt_displaces_a_long_running_job_for_a_new_short_one_keeping_its_kv():
    # r0 (40 tokens) decodes alone; r1 (3 tokens) arrives; one sequence per step.
    states, steps, pol = simulate([(0, 4, 40), (0.05, 4, 3)], "srpt", max_seqs=1)
    i = first_step(steps, 1)
    assert steps[i][0] == pytest.approx(0.05, abs=0.011)  # the very next step
    assert [r for r, _ in steps[i][1]] == [1] and 0 not in [r for r, _ in steps[i][1]]
    assert finish_order(states) == [1, 0]
    assert states[0].num_preemptions == 0  # displaced, not preempted: it kept its KV
    fcfs, _, _ = simulate([(0, 4, 40), (0.05, 4, 3)], "vllm", max_seqs=1)
    assert finish_order(fcfs) == [0, 1]


def test_srpt_ranks_by_remaining_not_total_output():
    # r0 (30 tokens) has 5 left when r1 (10 tokens) arrives: r0 keeps running.
    states, steps, _ = simulate([(0, 4, 30), (0.255, 4, 10)], "srpt", max_seqs=1)
    assert finish_order(states) == [0, 1]
    sjf_like, _, _ = simulate([(0, 4, 30), (0.045, 4, 10)], "srpt", max_seqs=1)
    assert finish_order(sjf_like) == [1, 0]  # early on, r1's 10 < r0's remaining 26


def test_srpt_preempts_the_worst_ranked_running_job_when_kv_is_short():
    # 10 blocks of 4 tokens. r0 (prompt 16 + 40 out) grows to 10 blocks; r1 (prompt 16, 3 out)
    # needs 5 blocks when it arrives at 0.1 s: r0, ranked worse, is preempted by recompute.
    states, steps, _ = simulate([(0, 16, 22), (0.1, 16, 3)], "srpt", num_blocks=10, block_size=4)
    assert states[0].num_preemptions == 1 and states[1].num_preemptions == 0
    i = first_step(steps, 1)
    assert steps[i][2] == [0]
    assert finish_order(states) == [1, 0]


# --- ltr ---------------------------------------------------------------------------------------------------

def test_ltr_reranks_running_requests_every_step():
    # Two running requests outgrow a 12-block cache: vLLM preempts the last admitted (r1,
    # the short one); ltr preempts the worst-ranked (r0, the long one).
    specs = [(0, 8, 40), (0.001, 8, 20)]
    ltr, _, _ = simulate(specs, "ltr", num_blocks=12, block_size=4, max_seqs=2)
    vllm, _, _ = simulate(specs, "vllm", num_blocks=12, block_size=4, max_seqs=2)
    assert (ltr[0].num_preemptions, ltr[1].num_preemptions) == (1, 0)
    assert (vllm[0].num_preemptions, vllm[1].num_preemptions) == (0, 1)
    assert finish_order(ltr) == [1, 0] and finish_order(vllm) == [0, 1]


def test_ltr_admits_waiting_requests_in_rank_order():
    states, _, _ = simulate(BEHIND, "ltr", max_seqs=1)
    assert finish_order(states) == [0, 2, 1]


def test_ltr_preemptive_mode_displaces_for_a_better_ranked_arrival():
    states, steps, _ = simulate([(0, 4, 40), (0.05, 4, 3)], "ltr", dict(preemptive=True), max_seqs=1)
    assert finish_order(states) == [1, 0] and states[0].num_preemptions == 0
    default, _, _ = simulate([(0, 4, 40), (0.05, 4, 3)], "ltr", max_seqs=1)
    assert finish_order(default) == [0, 1]  # running first: no displacement


def _runs_and_gaps(flags):
    runs, gaps, i = [], [], 0
    while i < len(flags):
        j = i
        while j < len(flags) and flags[j] == flags[i]:
            j += 1
        (runs if flags[i] else gaps).append(j - i)
        i = j
    return runs, gaps


def test_ltr_starvation_counter_promotes_for_a_quantum():
    # preemptive, one sequence per step: r0 (40 tokens) ranks below r1 (30 tokens). r0 must
    # run in bursts of exactly `priority_quantum` steps, each after exactly
    # `starvation_threshold` steps unscheduled, until r1 is done.
    specs = [(0, 4, 40), (0.001, 4, 30)]
    knobs = dict(preemptive=True, starvation_threshold=5, priority_quantum=3)
    states, steps, _ = simulate(specs, "ltr", knobs, max_seqs=1)
    ran = [any(r == 0 for r, _ in items) for _, items, _ in steps if items]
    runs, gaps = _runs_and_gaps(ran)
    # step 0 prefills r0 (alone); then 5 steps of r1, 3 of r0, ... and r0's tail once r1 is done
    assert runs[0] == 1 and set(runs[1:-1]) == {3} and len(runs) > 4
    assert set(gaps) == {5}
    assert sum(s.num_preemptions for s in states.values()) == 0  # displaced, never preempted
    never, _, _ = simulate(specs, "ltr", dict(preemptive=True, starvation_threshold=0), max_seqs=1)
    assert finish_order(never) == [1, 0]
    running_first, steps, _ = simulate(specs, "ltr", dict(starvation_threshold=5, priority_quantum=3), max_seqs=1)
    assert finish_order(running_first) == [0, 1]  # default: a running request is never displaced


# --- edf / least_slack -------------------------------------------------------------------------------------

# Two long decodes fill both sequence slots; r2 arrives at 45 ms with a 500 ms TTFT SLO.
# FCFS holds it until one of them finishes (~2 s); EDF sees the decodes ahead of their
# 100 ms TPOT pace (deadline = first token + generated * TPOT) and gives r2 a slot.
PACE = [(0, 4, 200), (0, 4, 200), (0.045, 4, 5)]
SLO = dict(ttft_ms=500, tpot_ms=100)


def test_edf_meets_a_ttft_deadline_fcfs_misses_by_pacing_decodes():
    states, steps, _ = simulate(PACE, "edf", SLO, max_seqs=2, num_blocks=256)
    ttft = states[2].first_token_time - 0.045
    assert ttft < 0.5
    for i in (0, 1):  # the decodes still keep their pace, and were displaced, not preempted
        s = states[i]
        assert s.num_preemptions == 0
        assert (s.finish_time - s.first_token_time) / (s.num_generated - 1) <= 0.1
    fcfs, _, _ = simulate(PACE, "vllm", max_seqs=2, num_blocks=256)
    assert fcfs[2].first_token_time - 0.045 > 0.5


@pytest.mark.parametrize("policy", ["edf", "least_slack"])
def test_deadline_policies_do_not_ping_pong_under_kv_pressure(policy):
    # 64 blocks cannot hold both 204-token decodes: one is preempted. Pace deadlines move
    # with every token, so a resumed request that took a chunk of KV and then preempted its
    # rival as it grew would alternate with it (66 preemptions each before this was ruled
    # out); it returns only when its whole recompute fits, and nothing is preempted for it.
    states, _, _ = simulate(PACE, policy, SLO, max_seqs=2, num_blocks=64)
    assert sum(s.num_preemptions for s in states.values()) <= 2
    assert states[2].first_token_time - 0.045 < 0.5


def test_edf_orders_by_deadline():
    # r2 is due at 0.545 s. At the 50 ms step the decodes (first token at 10 ms, 5 tokens)
    # are due at 0.01 + 5 * 0.1 = 0.51 s: they keep both slots and r2 waits. At 60 ms
    # they are due at 0.61 s: r2 goes first and one decode yields its slot.
    _, steps, _ = simulate(PACE, "edf", SLO, max_seqs=2, num_blocks=256)
    i = first_step(steps, 2)
    (t0, before, _), (t1, at, _) = steps[i - 1], steps[i]
    assert t0 == pytest.approx(0.05) and sorted(r for r, _ in before) == [0, 1]
    assert t1 == pytest.approx(0.06) and at[0][0] == 2 and len(at) == 2


@pytest.mark.parametrize("policy", ["edf", "least_slack"])
def test_only_requests_that_can_still_make_their_deadline_preempt(policy):
    # Two 200-token decodes leave 12 free blocks at 1.8 s; r2 (60-token prompt, 15 blocks)
    # arrives mid-step. With a 2 s TTFT it can make it: a decode (later deadline) is
    # preempted for it. With a 1 ms TTFT it is already late when first planned: preempting
    # would not save its deadline, so it waits for free KV (one decode finishing).
    specs = [(0, 4, 200), (0, 4, 200), (1.805, 60, 5)]
    on_time, _, _ = simulate(specs, policy, dict(ttft_ms=2000, tpot_ms=100), max_seqs=4, num_blocks=104)
    assert sum(s.num_preemptions for s in on_time.values()) == 1
    assert on_time[2].first_token_time - 1.805 < 0.05
    late, _, _ = simulate(specs, policy, dict(ttft_ms=1, tpot_ms=100), max_seqs=4, num_blocks=104)
    assert sum(s.num_preemptions for s in late.values()) == 0
    assert late[2].first_token_time > min(late[0].finish_time, late[1].finish_time)


def test_edf_without_an_slo_uses_the_defaults():
    p = make_policy("edf")
    assert (p.ttft, p.tpot) == (2.0, 0.1)
    with pytest.raises(ValueError, match="ttft_ms"):
        make_policy("edf", ttft_ms=0)


def test_least_slack_prefers_the_request_with_least_slack():
    # r0 holds the only slot; r1 (4-token prompt) and r2 (500-token prompt) queue behind it.
    # r1's deadline is earlier (EDF's pick), but r2 needs ~0.51 s of prefill before its
    # first token (cost: 10 ms + 1 ms/token), which leaves it less slack.
    specs = [(0, 4, 3), (0.001, 4, 2), (0.002, 500, 2)]
    cost = FixedCost(0.01, 0.001)
    knobs = dict(ttft_ms=1000, tpot_ms=100)
    _, steps, _ = simulate(specs, "least_slack", knobs, cost=cost, max_seqs=1, num_blocks=256)
    assert first_step(steps, 2) < first_step(steps, 1)
    _, steps, _ = simulate(specs, "edf", knobs, cost=cost, max_seqs=1, num_blocks=256)
    assert first_step(steps, 1) < first_step(steps, 2)


def test_slo_interpolation_in_the_policy_configs():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from pathlib import Path

    from testbed.app.assembly.config import register_configs

    register_configs()
    conf = str(Path(__file__).resolve().parent.parent / "testbed" / "conf")
    with initialize_config_dir(config_dir=conf, version_base=None):
        for slo, want in (("mlperf_llama3_8b_interactive", (500, 30)), ("none", (None, None))):
            for name in ("edf", "least_slack"):
                cfg = compose("config", overrides=[f"policy={name}", f"slo={slo}"])
                knobs = OmegaConf.to_container(cfg.policy, resolve=True)
                assert (knobs["ttft_ms"], knobs["tpot_ms"]) == want
                pol = make_policy(name, **{k: v for k, v in knobs.items() if k != "name"})
                assert pol.ttft == (want[0] or 2000) / 1e3
        cfg = compose("config", overrides=["policy=sjf", "seed=7"])
        assert OmegaConf.to_container(cfg.policy, resolve=True)["seed"] == 7


# --- all of them ---------------------------------------------------------------------------------------------

LOADED = [(0.002 * i if i < 30 else 1.5 + 0.002 * i, 6 + 7 * i % 40, 2 + 11 * i % 57, (i % 3,) if i % 2 else ())
          for i in range(50)]


@pytest.mark.parametrize("policy, knobs", [
    ("sjf", dict(starvation_s=0.2)), ("srpt", dict(starvation_s=0.2)), ("ltr", dict(starvation_threshold=6)),
    ("ltr", dict(preemptive=True, starvation_threshold=6, priority_quantum=2)),
    ("edf", dict(ttft_ms=100, tpot_ms=20)), ("least_slack", dict(ttft_ms=100, tpot_ms=20)),
    ("sglang", dict(ignore_eos=False, init_new_token_ratio=0.1)),  # steady also while the batch is full and requests wait
])
def test_fast_forward_is_exact(policy, knobs):
    # is_steady lets the simulator merge steady decode steps: every request's times must
    # be what planning each step gives, under queueing, preemption and promotions.
    kw = dict(max_seqs=6, num_blocks=60, block_size=4, budget=32)
    slow, steps, _ = simulate(LOADED, policy, knobs, **kw)
    fast, fast_steps, _ = simulate(LOADED, policy, knobs, fast_forward=True, **kw)
    assert len(fast_steps) < len(steps)  # runs were merged
    for i, s in slow.items():
        f = fast[i]
        assert (f.first_token_time, f.finish_time, f.num_preemptions) == (s.first_token_time, s.finish_time,
                                                                          s.num_preemptions)
    assert sum(s.num_preemptions for s in slow.values()) > 0  # the scenario has KV pressure


def test_least_slack_without_a_cost_model_ranks_as_edf():
    from testbed.core.kv import BlockManager
    from testbed.core.loop import SchedulerLimits, StepLoop

    pol = make_policy("least_slack", ttft_ms=1000, tpot_ms=100)
    loop = StepLoop(pol, BlockManager(64, 4), SchedulerLimits(64, 8, 10_000), cost_model=None)
    s = loop.arrive(make_requests([(0.5, 40, 3)])[0], 0.5)
    assert pol.work(s, loop.view) == 0.0 and pol.rank(s, loop.view) == pytest.approx(1.5)
