"""`trtllm` schedules what TensorRT-LLM schedules, `orca` what the Orca paper's Algorithm 1 says.

TensorRT-LLM scenarios are ported from its own unit tests (NVIDIA/TensorRT-LLM as the search index
stores them; release v1.2.1 itself was not in the index; the policy's docstring names the commits
of the scheduler sources, CAP = capacityScheduler.cpp, MBS = microBatchScheduler.cpp,
SBM = scheduledBlocksManager.cpp, cited `file:line`):
- cpp/tests/unit_tests/batch_manager/capacitySchedulerTest.cpp @ the index's version (91,149
  characters; test names cited). Its `runTest` drives the capacity scheduler alone: every
  request it returns runs, a context request its whole prompt (or the chunk the test set), and
  generates one token at the end of its context, then one per iteration; a paused request is
  `pause`d (back to the context phase, its output folded into its prompt) and its blocks freed.
  `ExpectedState{itBegin, itEnd, activeIds, {{id, maxNewTokens, promptLen, numGenTokensBegin,
  contextPosition}}}` lists the requests scheduled in iterations [itBegin, itEnd). Here the
  micro-batch scheduler runs too, with a token budget large enough to pass everything through,
  so the scheduled sets are the capacity scheduler's.
- cpp/tests/unit_tests/batch_manager/microBatchSchedulerTest.cpp, `ContextChunkingTest`
  (lengths, chunk unit, token capacity -> context positions after each iteration).
Their KV cache: `kvCacheMaxNumTokens / tokensPerBlock` blocks, no block reuse (the helper's
default), one iteration per engine step. Here: the testbed's BlockManager with that many blocks,
prefix caching off, and a fixed step time so arrivals land before a chosen step.

Orca has no code: the scenarios are crafted from Yu et al., OSDI'22, Algorithm 1 (`Select`: the
pool by arrival; stop at max_bs; a request in its initiation phase joins only if
n_rsrv + max_tokens <= n_slots, else stop) and section 4 (selective batching: initiation and
increment phases share an iteration; no preemption).
"""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from conftest import FixedCost, make_loop, make_requests
from testbed.app.entry.cli import CONF_DIR
from testbed.policies import make_policy
from testbed.sim.simulation import Simulation

STEP = 0.01  # FixedCost(STEP, 0): step k starts at k * STEP


def simulate(specs, policy, knobs=None, *, num_blocks, block_size, budget, max_seqs, prefix=False, block_tokens=512):
    """Run to completion; returns per-step ({request: tokens}, [requests preempted])."""
    pol = make_policy(policy, **(knobs or {}))
    steps = []
    inner = pol.schedule

    def schedule(view):
        plan = inner(view)
        steps.append(({s.req.id: n for s, n in plan.items}, [s.req.id for s, _ in plan.preempt]))
        return plan
    pol.schedule = schedule
    cost = FixedCost(STEP, 0.0)
    reqs = make_requests(specs, block_tokens=block_tokens)
    out = Simulation(reqs, lambda: make_loop(pol, num_blocks=num_blocks, block_size=block_size, budget=budget,
                                             max_seqs=max_seqs, prefix=prefix, cost=cost), cost,
                     fast_forward=False).run()
    loop = out.loops[0]
    assert all(s.status.value == "finished" for s in loop.states), [s.status for s in loop.states]
    return steps


def runs(steps):
    """Consecutive equal plans merged: [(repeat, {request: tokens})]."""
    out = []
    for plan, _ in steps:
        if out and out[-1][1] == plan:
            out[-1][0] += 1
        else:
            out.append([1, plan])
    return [tuple(r) for r in out]


def preempted(steps):
    return {k: p for k, (_, p) in enumerate(steps) if p}


def scheduled_sets(steps, ranges):
    """The ExpectedState form: for each [begin, end), the set of requests scheduled in every step."""
    for begin, end, ids in ranges:
        for k in range(begin, end):
            assert set(steps[k][0]) == set(ids), (k, steps[k][0], ids)


# ---- TensorRT-LLM: capacitySchedulerTest.cpp ---------------------------------------------------

@pytest.mark.parametrize("mode", ["guaranteed_no_evict", "max_utilization", "static_batch"])
def test_trt_simple_should_fit(mode):
    # capacitySchedulerTest.cpp TEST_F(CapacitySchedulerTest, SimpleShouldFit): 200 tokens / 10 per
    # block, maxNumRequests 2, two requests prompt 10 + 80 new: ExpectedState{0, 80, {0, 1}, both};
    # EXPECT_EQ(numIterations, 80)
    steps = simulate([(0, 10, 80), (0, 10, 80)], "trtllm", {"mode": mode},
                     num_blocks=20, block_size=10, budget=1000, max_seqs=2)
    assert runs(steps) == [(1, {0: 10, 1: 10}), (79, {0: 1, 1: 1})]
    assert not preempted(steps)


def test_trt_simple_doesnt_fit_guaranteed_completion():
    # TEST_F(CapacitySchedulerTest, SimpleDoesntFitGuaranteedCompletion): 100 tokens (10 blocks);
    # each request needs 9 blocks to finish, so no-evict runs one at a time, in list order:
    # ExpectedState{0, 80, {0, 1}, {{0, 80, 10, 0}}}, {80, 160, {1}, {{1, 80, 10, 0}}}; 160 iterations
    steps = simulate([(0, 10, 80), (0, 10, 80)], "trtllm", {"mode": "guaranteed_no_evict"},
                     num_blocks=10, block_size=10, budget=1000, max_seqs=2)
    assert runs(steps) == [(1, {0: 10}), (79, {0: 1}), (1, {1: 10}), (79, {1: 1})]
    assert not preempted(steps)


def test_trt_simple_doesnt_fit_max_utilization():
    # TEST_F(CapacitySchedulerTest, SimpleDoesntFitMaxUtilization): the same two requests, 10 blocks,
    # MAX_UTILIZATION: both run until iteration 41, when req 0 finds no block for its next token and
    # the last started request (req 1) is paused; req 1 comes back at 80 with prompt 51 (10 + 41
    # generated) and 39 tokens to go: ExpectedState{0, 41, both}, {41, 80, {{0, 80, 10, 41, 10}}},
    # {80, 120, {{1, 39, 51, 0}}}; EXPECT_EQ(numIterations, 119)
    steps = simulate([(0, 10, 80), (0, 10, 80)], "trtllm", {"mode": "max_utilization"},
                     num_blocks=10, block_size=10, budget=1000, max_seqs=2)
    assert runs(steps) == [(1, {0: 10, 1: 10}), (40, {0: 1, 1: 1}), (39, {0: 1}), (1, {1: 51}), (38, {1: 1})]
    assert preempted(steps) == {41: [1]}
    assert len(steps) == 119


@pytest.mark.parametrize("mode", ["guaranteed_no_evict", "max_utilization", "static_batch"])
def test_trt_simple_should_fit_in_chunk(mode):
    # TEST_F(CapacitySchedulerTest, SimpleShouldFitInChunk): 20 blocks of 10, prompt 50 + 40 new,
    # context chunk 20: positions 0, 20, 40, then 50 with the first token; 42 iterations. The test
    # sets the chunk by hand (setContextChunkSize(20)); here the micro-batch scheduler's
    # EQUAL_PROGRESS chunking with a 40-token budget and 10-token blocks hands out the same chunks.
    steps = simulate([(0, 50, 40), (0, 50, 40)], "trtllm",
                     {"mode": mode, "chunked_context": True, "chunking_policy": "equal_progress"},
                     num_blocks=20, block_size=10, budget=40, max_seqs=2)
    assert runs(steps) == [(2, {0: 20, 1: 20}), (1, {0: 10, 1: 10}), (39, {0: 1, 1: 1})]
    assert len(steps) == 42


def test_trt_simple_doesnt_fit_guaranteed_completion_in_chunk():
    # TEST_F(CapacitySchedulerTest, SimpleDoesntFitGuaranteedCompletionInChunk): 10 blocks, prompt 30
    # + 60 new (9 blocks each), chunk 20: req 0 alone (positions 0, 20, then 30 with its first
    # token), done at 61; then req 1 the same way; EXPECT_EQ(numIterations, 122). A 20-token budget
    # makes the same chunks here (first come first served, 10-token blocks).
    steps = simulate([(0, 30, 60), (0, 30, 60)], "trtllm", {"chunked_context": True},
                     num_blocks=10, block_size=10, budget=20, max_seqs=2)
    assert runs(steps) == [(1, {0: 20}), (1, {0: 10}), (59, {0: 1}), (1, {1: 20}), (1, {1: 10}), (59, {1: 1})]
    assert len(steps) == 122


def test_trt_simple_doesnt_fit_adding_new_requests_max_utilization():
    # TEST_F(CapacitySchedulerTest, SimpleDoesntFitAddingNewRequestsMaxUtilization): 10 blocks,
    # maxNumRequests 4, reqs 0 and 1 (prompt 10 + 80 new) at iteration 0, reqs 2 and 3 (the same) added
    # at iteration 10. The expected states, iteration ranges -> requests scheduled:
    #   [0,10) {0,1}; [10,21) {0,1,2,3}; [21,41) {0,1} (3 and 2 paused); [41,80) {0} (1 paused);
    #   [80,90) {1 (prompt 51, 39 new), 2 (prompt 21)}; [90,119) {1} (2 paused);
    #   [119,139) {2 (prompt 31, 59 new), 3 (prompt 21, 69 new)}; [139,177) {2} (3 paused);
    #   [178,227) {3 (prompt 41, 49 new)}; EXPECT_EQ(numIterations, 227).
    # Paused, in the order the rule picks them (the last started request from the one that does
    # not fit to the end of the list, CAP:523-535): 21: 3 then 2; 41: 1; 90: 2; 139: 3.
    late = 9.5 * STEP  # after step 9 starts, before step 10
    steps = simulate([(0, 10, 80), (0, 10, 80), (late, 10, 80), (late, 10, 80)], "trtllm",
                     {"mode": "max_utilization"}, num_blocks=10, block_size=10, budget=1000, max_seqs=4)
    scheduled_sets(steps, [(0, 10, {0, 1}), (10, 21, {0, 1, 2, 3}), (21, 41, {0, 1}), (41, 80, {0}),
                           (80, 90, {1, 2}), (90, 119, {1}), (119, 139, {2, 3}), (139, 178, {2}),
                           (178, 227, {3})])
    assert len(steps) == 227
    assert preempted(steps) == {21: [3, 2], 41: [1], 90: [2], 139: [3]}
    # re-admissions prefill the prompt plus what was generated (LlmRequest::pause)
    assert steps[80][0] == {1: 51, 2: 21}
    assert steps[119][0] == {2: 31, 3: 21}
    assert steps[178][0] == {3: 41}


# ---- TensorRT-LLM: microBatchSchedulerTest.cpp, ContextChunkingTest ----------------------------

@pytest.mark.parametrize("lengths, unit, capacity, policy, positions", [
    # TEST_F(ContextChunkingTest, TokenCapacitySmallerThanContext)
    ((25, 25), 20, 20, "equal_progress", [(20, 0), (25, 0), (25, 20), (25, 25)]),
    ((25, 25), 20, 20, "first_come_first_served", [(20, 0), (25, 0), (25, 20), (25, 25)]),
    # TEST_F(ContextChunkingTest, SchedulingOrder)
    ((25, 25), 5, 30, "equal_progress", [(15, 15), (25, 25)]),
    ((25, 25), 5, 30, "first_come_first_served", [(25, 5), (25, 25)]),
    # TEST_F(ContextChunkingTest, CompletionOrder)
    ((25, 15), 5, 30, "equal_progress", [(15, 15), (25, 15)]),
    ((25, 15), 5, 30, "first_come_first_served", [(25, 5), (25, 15)]),
    # TEST_F(ContextChunkingTest, FrontPriority)
    ((25, 25), 5, 15, "equal_progress", [(10, 5), (20, 10), (25, 20), (25, 25)]),
    ((25, 25), 5, 15, "first_come_first_served", [(15, 0), (25, 5), (25, 20), (25, 25)]),
])
def test_trt_context_chunking(lengths, unit, capacity, policy, positions):
    # chunk unit = tokens_per_block (py_executor_creator.py), so the block size is the test's unit;
    # one output token each, so a request leaves when its context is done and only contexts compete
    specs = [(0, n, 1) for n in lengths]
    steps = simulate(specs, "trtllm", {"chunked_context": True, "chunking_policy": policy},
                     num_blocks=100, block_size=unit, budget=capacity, max_seqs=8)
    done = [0] * len(lengths)
    got = []
    for plan, _ in steps:
        for rid, n in plan.items():
            done[rid] += n
        got.append(tuple(done))
    assert got == positions


# ---- TensorRT-LLM: rules with no unit test of their own, crafted from the source ----------------

def test_trt_no_chunking_stops_at_the_first_prompt_that_does_not_fit():
    # MBS:239-253: without chunking (enable_chunked_prefill defaults to False) a context request is
    # charged its whole prompt and the pass stops at the first that exceeds max_num_tokens: the
    # 4-token prompt behind the second 25-token one waits, though it would fit
    steps = simulate([(0, 25, 3), (0, 25, 3), (0, 4, 3)], "trtllm", num_blocks=100, block_size=4,
                     budget=30, max_seqs=8)
    assert steps[0][0] == {0: 25}
    assert steps[1][0] == {0: 1, 1: 25, 2: 4}


def test_trt_fcfs_chunking_rounds_a_cut_chunk_down_to_whole_blocks():
    # MBS:131-158: the chunk of a context that does not fit is the capacity left rounded down to a
    # multiple of the chunk unit (tokens_per_block); what is left over still goes to a later
    # context that fits whole: 40 tokens, 16-token blocks -> 32 for the long prompt, 8 for the short
    steps = simulate([(0, 100, 2), (0, 8, 2)], "trtllm", {"chunked_context": True},
                     num_blocks=100, block_size=16, budget=40, max_seqs=8)
    assert steps[0][0] == {0: 32, 1: 8}
    assert steps[1][0] == {0: 32, 1: 1}


def test_trt_no_evict_charges_the_whole_request_and_takes_decodes_first():
    # CAP:371-384 then 422-445: running generations set aside what they still need to finish
    # (ceil((prompt + max new) / block) - held), whatever the free blocks are now; a new request is
    # charged its whole prompt + output. 12 blocks of 4: req 0 (8 + 24 -> 8 blocks) runs; req 1
    # (8 + 8 -> 4 blocks) fits beside it, req 2 (4 + 4 -> 2 blocks) waits though 8 blocks are free
    # at step 1, and is admitted as soon as req 1 finishes (its 4 blocks no longer owed).
    steps = simulate([(0, 8, 24), (0.5 * STEP, 8, 8), (0.5 * STEP, 4, 4)], "trtllm", num_blocks=12,
                     block_size=4, budget=100, max_seqs=8)
    assert steps[0][0] == {0: 8}
    assert steps[1][0] == {0: 1, 1: 8}
    first = {rid: k for k in reversed(range(len(steps))) for rid in steps[k][0]}
    last = {rid: k for k in range(len(steps)) for rid in steps[k][0]}
    assert first[2] == last[1] + 1
    assert not preempted(steps)


def test_trt_block_reuse_skips_a_request_whose_next_block_another_is_computing():
    # CAP:69-122, used at 409-414 (`beneficialToSkip`) with block reuse on: req 1 shares req 0's prompt, none of it
    # cached yet, so it waits a step (skipped, not a stop: req 2, another prompt, still joins) and
    # then finds 3 of its 4 blocks cached (the last token is always computed)
    a, b = (11, 12, 13, 14), (21, 22, 23, 24)
    steps = simulate([(0, 16, 4, a), (0, 16, 4, a), (0, 16, 4, b)], "trtllm", num_blocks=100,
                     block_size=4, budget=100, max_seqs=8, prefix=True, block_tokens=4)
    assert steps[0][0] == {0: 16, 2: 16}
    assert steps[1][0] == {0: 1, 2: 1, 1: 4}
    off = simulate([(0, 16, 4, a), (0, 16, 4, a), (0, 16, 4, b)], "trtllm", num_blocks=100,
                   block_size=4, budget=100, max_seqs=8, prefix=False, block_tokens=4)
    assert off[0][0] == {0: 16, 1: 16, 2: 16}  # without reuse there is nothing to wait for


def test_trt_max_utilization_charges_a_first_chunk_its_whole_prompt():
    # CAP:546-578 (SBM:65-86) with KVM `getNeededBlocksOneStep`: a context request in its first chunk is charged
    # the blocks of its whole prompt, not of the chunk. 10 blocks of 4: req 0 (8 + 8) holds 3 at
    # step 1; req 1's 32-token prompt (8 blocks) does not fit in the 7 free, though its first
    # 8-token chunk would: it waits, nothing started after it to pause, until req 0 is done
    steps = simulate([(0, 8, 8), (0.5 * STEP, 32, 4)], "trtllm", {"mode": "max_utilization", "chunked_context": True},
                     num_blocks=10, block_size=4, budget=9, max_seqs=4)
    assert runs(steps) == [(1, {0: 8}), (7, {0: 1}), (4, {1: 8}), (3, {1: 1})]
    assert not preempted(steps)


# ---- Orca: Algorithm 1 ------------------------------------------------------------------------

def test_orca_reserves_max_tokens_at_admission():
    # Algorithm 1, Select: a request in its initiation phase joins only if n_rsrv + max_tokens <=
    # n_slots; n_rsrv drops by max_tokens only when a request finishes. 100 token slots (block
    # size 1): A and B reserve 50 each (prompt 20 + 30 new); C (10 + 10) waits though A and B hold
    # 42 slots after their first iteration, and joins right after A finishes
    steps = simulate([(0, 20, 30), (0, 20, 30), (0.5 * STEP, 10, 10)], "orca", num_blocks=100,
                     block_size=1, budget=1000, max_seqs=8)
    assert steps[0][0] == {0: 20, 1: 20}
    assert all(2 not in plan for plan, _ in steps[:30])
    assert steps[30][0] == {2: 10}  # A and B generated their 30 tokens in steps 0..29
    assert not preempted(steps)


def test_orca_fcfs_stops_at_the_first_request_that_does_not_fit():
    # Algorithm 1, Select: the pool sorted by arrival, `break` (not skip) at the first request whose
    # reservation does not fit: C would fit beside A, but B is first in line
    steps = simulate([(0, 10, 70), (0, 10, 20), (0, 5, 5)], "orca", num_blocks=100, block_size=1,
                     budget=1000, max_seqs=8)
    assert steps[0][0] == {0: 10}
    assert all(set(plan) == {0} for plan, _ in steps[:70])
    assert steps[70][0] == {1: 10, 2: 5}


def test_orca_mixes_initiation_and_increment_and_caps_the_batch():
    # section 4 (selective batching): a new request's whole prompt runs in the same iteration as the
    # running requests' next tokens; Select stops at max_bs requests, running ones included
    steps = simulate([(0, 8, 20), (0.5 * STEP, 8, 20), (0.5 * STEP, 8, 20)], "orca", {"max_batch_size": 2},
                     num_blocks=1000, block_size=1, budget=1000, max_seqs=8)
    assert steps[0][0] == {0: 8}
    assert steps[1][0] == {0: 1, 1: 8}
    assert all(2 not in plan for plan, _ in steps[:20])
    assert steps[20][0] == {1: 1, 2: 8}


# ---- presets ----------------------------------------------------------------------------------

def _config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_presets_are_the_shipped_defaults_and_overrides_still_win():
    trt = _config("policy=trtllm")
    assert (trt.policy.mode, trt.policy.chunked_context, trt.policy.chunking_policy) == (
        "guaranteed_no_evict", False, "first_come_first_served")
    assert (trt.kv.block_size, trt.kv.enable_prefix_caching) == (32, True)
    assert (trt.scheduler.max_num_seqs, trt.scheduler.max_num_batched_tokens) == (2048, 8192)
    orca = _config("policy=orca")
    assert (orca.kv.block_size, orca.kv.enable_prefix_caching) == (1, False)
    assert _config("policy=orca", "kv.block_size=16").kv.block_size == 16
    assert _config("policy=trtllm", "policy.mode=max_utilization").policy.mode == "max_utilization"
    knobs = make_policy("trtllm").knobs  # the dataclass defaults are the preset's
    assert (knobs.mode, knobs.chunked_context, knobs.chunking_policy) == (
        trt.policy.mode, trt.policy.chunked_context, trt.policy.chunking_policy)


def test_bad_trtllm_knobs_name_the_key():
    with pytest.raises(ValueError, match="policy.chunking_policy"):
        make_policy("trtllm", chunking_policy="fifo")
    with pytest.raises(ValueError, match="policy.mode"):
        make_policy("trtllm", mode="eager")
