"""The `sarathi` policy schedules what Sarathi-Serve schedules (microsoft/sarathi-serve, commit
96f9911; paths under sarathi/, abbreviated as in tests/sarathi_reference.py: SS the Sarathi
scheduler, BS the base scheduler, BM the base block space manager, SQ the sequence, SM the
base sequence manager).

Sarathi-Serve ships no scheduler tests, so these are crafted. Each scenario is driven step by
step through the policy inside the testbed's StepLoop and BlockManager (prefix caching off,
as Sarathi-Serve has none) and, in lockstep, through `RefSarathi`, a model of Sarathi-Serve's
own scheduler state (whole-prompt block tables, preempted sequences at the head of `waiting`,
reset for recompute after scheduling). Both must give the hand-derived decisions: the tokens
each request gets in every step and the requests preempted.
"""
from __future__ import annotations

from hydra import compose, initialize_config_dir

from conftest import FixedCost
from testbed.app.entry.cli import CONF_DIR  # registers the config schemas
from sarathi_reference import RefSarathi, RefSeq, random_scenario
from testbed.core.kv import BlockManager
from testbed.core.loop import SchedulerLimits, StepLoop
from testbed.core.request import Request, Status
from testbed.policies.sarathi import SarathiKnobs, SarathiPolicy
from testbed.sim.simulation import Simulation


def run_both(reqs, num_blocks, block_size, chunk, max_num_seqs=128, watermark=0.01):
    """reqs: (arrival step, prompt, output) tuples. Returns (ours, reference): per step
    ({request: tokens}, [preempted]); asserts every request finished on both sides."""
    kv = BlockManager(num_blocks, block_size, False)
    loop = StepLoop(SarathiPolicy(SarathiKnobs(token_budget=chunk, watermark=watermark)), kv,
                    SchedulerLimits(100_000, max_num_seqs, 100_000))
    ref = RefSarathi(num_blocks, block_size, chunk, max_num_seqs, watermark)
    ours, theirs = [], []
    step, last = 0, max(a for a, _, _ in reqs)
    while step <= last or loop.has_work:
        assert step < 2000, "not finished after 2000 steps"
        for i, (a, p, o) in enumerate(reqs):
            if a == step:
                assert loop.arrive(Request(i, float(a), p, o), float(step)).status is Status.WAITING
                ref.add(RefSeq(i, float(a), p, o))
        before = {i: s.num_preemptions for i, s in loop.live.items()}
        batch = loop.plan(float(step))
        ours.append(({s.req.id: n for s, n in batch.items} if batch else {},
                     sorted(i for i, n in before.items() if loop.live[i].num_preemptions > n)))
        if batch is not None:
            loop.complete(batch, step + 0.5)
        kv.check_invariants(loop.live.values())
        items, pre = ref.schedule()
        while not items and pre and ref.waiting:  # the loop asks again after a preempt-only plan
            items, more = ref.schedule()
            pre = pre + more
        theirs.append((items, sorted(pre)))
        ref.complete(items)
        step += 1
    assert all(s.status is Status.FINISHED for s in loop.states)
    assert not ref.running and not ref.waiting and kv.num_used_blocks == 0
    return ours, theirs


def check(expected, *args, **kw):
    ours, theirs = run_both(*args, **kw)
    assert theirs == expected, f"reference model\n got: {theirs}\nwant: {expected}"
    assert ours == expected, f"policy\n got: {ours}\nwant: {expected}"


def test_decodes_then_partial_prefills_then_new_chunked():
    """chunk 8, 64 blocks of 4 (watermark int(0.64) = 0). Each step: running decodes one token
    each (SS:141-160), partial prefills min(rest, chunk - tokens) (SS:91-94, 165-187), then new
    requests FCFS, chunked into what is left (SS:220-235), stopping at the first that gets 0
    (SS:224-225). Step 2: two decodes then 6 of R2's 20 tokens; step 3: R3 arrives and gets
    nothing (R0's decode + R2's 7 fill the chunk); step 4: R2's last 7 and 1 token of R3."""
    check([({0: 8}, []), ({0: 2, 1: 6}, []), ({0: 1, 1: 1, 2: 6}, []), ({0: 1, 2: 7}, []),
           ({2: 7, 3: 1}, []), ({2: 1, 3: 4}, [])],
          [(0, 10, 3), (0, 6, 2), (2, 20, 2), (3, 5, 1)], 64, 4, 8)


def test_preempts_with_no_free_block_though_the_decode_needs_none():
    """4 blocks of 4, chunk 16. Step 0 admits both 6-token prompts (2 blocks each: 4 - 2 >= 0,
    BM:82) and the cache is full. Step 1: R0's 7th token fits its 2nd block, but no block is
    free, so `can_append_slot` (free > 0, BM:94-96) fails and the newest running request, R1,
    is preempted (SS:141-146). R1 would fit again (2 free, 2 needed), yet nothing is admitted:
    the victim heads `waiting` (BS:122) and its prompt still counts as processed until the
    sequence manager resets it after scheduling (SM:70-71, SQ:175-182), so its chunk is 0 and
    admission stops (SS:224-225). Step 2 re-admits R1 with its 7 known tokens; step 3 preempts it
    again (R0's 9th token opens a 3rd block, then 1 block is free, short of R1's 2)."""
    check([({0: 6, 1: 6}, []), ({0: 1}, [1]), ({0: 1, 1: 7}, []), ({0: 1}, [1]), ({1: 8}, [])],
          [(0, 6, 4), (0, 6, 3)], 4, 4, 16)


def test_victim_is_the_newest_even_a_partial_prefill_and_is_readmitted_at_once():
    """7 blocks of 4, chunk 8. R0 (4 tokens) and R1 (20 tokens, 5 blocks taken whole at
    admission, BM:84-92) start together; R0's decode takes the last block in step 1. Step 2:
    R0 finds none free and preempts the last request of the running list, R1, a partial
    prefill (SS:142-146: victims are not limited to decodes). R1 gives back all 5 blocks and
    fits again (5 - 5 >= 0): as its prompt still reads 11 of 20 done, its chunk is min(9, 7) = 7
    (SS:91-94), computed from token 0 after the reset. So R1 restarts three times (steps 2-4)
    before R0's 9th token needs a block of its own (step 5) and R1 no longer fits."""
    check([({0: 4, 1: 4}, []), ({0: 1, 1: 7}, []), ({0: 1, 1: 7}, [1]), ({0: 1, 1: 7}, [1]),
           ({0: 1, 1: 7}, [1]), ({0: 1}, [1]), ({1: 8}, []), ({1: 8}, []), ({1: 4}, []), ({1: 1}, [])],
          [(0, 4, 6), (0, 20, 2)], 7, 4, 8)


def test_a_recompute_with_one_token_left_is_still_a_prefill():
    """6 blocks of 4, chunk 8. R1 (1-token prompt) is preempted in step 9 and recomputes its 8
    known tokens as a prompt (SQ:181): 7 in step 10 (R0's decode takes 1), leaving 1. That
    token is still prompt (SQ:105-106) although the testbed's `remaining` of 1 looks like a
    decode: when R0 preempts R1 in step 11, R1's chunk reads min(1, 7) = 1 and it is re-admitted
    at once (a decode's would read 0 and admit nothing)."""
    ours, theirs = run_both([(0, 4, 15), (2, 1, 20)], 6, 4, 8)
    assert ours == theirs
    assert ours[9:14] == [({0: 1}, [1]), ({0: 1, 1: 7}, []), ({0: 1, 1: 1}, [1]), ({0: 1, 1: 7}, [1]),
                          ({0: 1}, [1])]


def test_watermark_is_exact_and_applies_with_nothing_running():
    """200 blocks of 4: watermark int(0.01 * 200) = 2 blocks (BM:66). R0 (100 blocks) is
    admitted; R1 with 99 blocks would leave 1 < 2 and waits although it fits (BM:82), with 98
    it leaves exactly 2 and is admitted in the same step."""
    check([({0: 400}, []), ({0: 1}, []), ({1: 396}, []), ({1: 1}, [])],
          [(0, 400, 2), (0, 396, 2)], 200, 4, 512)
    check([({0: 400, 1: 112}, []), ({0: 1, 1: 280}, []), ({1: 1}, [])],
          [(0, 400, 2), (0, 392, 2)], 200, 4, 512)


def test_a_request_only_the_watermark_keeps_out_runs_alone():
    """The one place the policy admits what Sarathi-Serve would not: nothing runs and the head
    request fits the cache but not the watermark (199 of 200 blocks, 1 < 2). Sarathi-Serve would
    wait forever (no step frees a block); the policy admits it. With 198 blocks the rule itself
    admits it (2 >= 2)."""
    for prompt in (792, 796):
        loop = StepLoop(SarathiPolicy(SarathiKnobs()), BlockManager(200, 4, False), SchedulerLimits(100_000, 128, 100_000))
        loop.arrive(Request(0, 0.0, prompt, 4), 0.0)
        batch = loop.plan(0.0)
        assert [(s.req.id, n) for s, n in batch.items] == [(0, 512)]


def test_max_num_seqs_counts_running_partial_prefills():
    """max_num_seqs 2, chunk 32: in step 1 R0 decodes and R1 finishes its prompt (19 tokens), and
    R2 is not admitted although 13 tokens of the chunk are left: two requests run (SS:216-217)."""
    check([({0: 20, 1: 12}, []), ({0: 1, 1: 18}, []), ({0: 1, 1: 1}, []), ({2: 4}, [])],
          [(0, 20, 3), (0, 30, 2), (0, 4, 1)], 64, 4, 32, max_num_seqs=2)


def test_random_scenarios_match_the_reference_model():
    """600 seeded random scenarios (tight caches, small chunks, many preemptions): the policy's
    per-step decisions equal the model's in every step (checked: the policy fails this when its
    victims are taken among decodes only, when a decode preempts only if it needs a block, or
    when a step that preempted admits nothing)."""
    preemptions = readmitted = 0
    for seed in range(600):
        drawn = random_scenario(seed)
        if drawn is None:
            continue
        ours, theirs = run_both(*drawn)
        assert ours == theirs, (seed, next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b))
        preemptions += sum(len(p) for _, p in ours)
        readmitted += sum(1 for i, (items, p) in enumerate(ours) if set(p) & set(items))
    # the scenarios preempt, and re-admit partial-prefill victims in the step that preempted them
    assert preemptions > 300 and readmitted > 100, (preemptions, readmitted)


def test_fast_forward_stops_before_a_decode_finds_no_free_block():
    """`is_steady` lets the simulator merge all-decode steps; Sarathi-Serve preempts as soon as a
    decode finds no block free (BM:94-96), so merged runs must end before that: a tight cache
    gives the same preemptions and finish times with and without fast-forward."""
    reqs = [Request(i, 0.001 * i, 6, 40) for i in range(4)]
    out = []
    for ff in (False, True):
        pol = SarathiPolicy(SarathiKnobs(token_budget=16))
        cost = FixedCost(0.01, 0.0001)
        sim = Simulation(reqs, lambda: StepLoop(pol, BlockManager(30, 4, False), SchedulerLimits(64, 8, 10_000), cost),
                         cost, fast_forward=ff).run()
        states = sim.loops[0].states
        assert all(s.status is Status.FINISHED for s in states)
        out.append([(s.num_preemptions, round(s.finish_time, 9)) for s in states])
    assert out[0] == out[1] and sum(p for p, _ in out[0]) > 0


def test_preset_is_sarathi_serve_as_shipped():
    """policy=sarathi sets Sarathi-Serve's defaults (config/config.py:153-155 block size 16,
    179-184 max_num_seqs 128, 246-248 chunk 512, 340-342 memory 0.8; watermark 0.01, BM:57; no
    prefix cache); overrides still win; the budget experiment composes on it."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["policy=sarathi"])
        assert (cfg.policy.name, cfg.policy.token_budget, cfg.policy.watermark) == ("sarathi", 512, 0.01)
        assert (cfg.kv.block_size, cfg.kv.enable_prefix_caching, cfg.kv.memory_utilization) == (16, False, 0.8)
        assert cfg.scheduler.max_num_seqs == 128
        assert SarathiKnobs().token_budget == 512 and SarathiKnobs().watermark == 0.01
        cfg = compose("config", overrides=["policy=sarathi", "kv.enable_prefix_caching=true", "policy.token_budget=128"])
        assert cfg.kv.enable_prefix_caching and cfg.policy.token_budget == 128
        cfg = compose("config", overrides=["experiment=sarathi_budget"])
        assert cfg.policy.name == "sarathi" and not cfg.kv.enable_prefix_caching and cfg.kv.block_size == 16
