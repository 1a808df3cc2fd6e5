"""Inputs of the scenarios ported from vLLM's scheduler tests, as plain data.

Read by two programs, so both run exactly the same scenarios:
- `tests/test_vllm_ported.py` runs each through the testbed's `vllm` policy and step loop
  (system Python, no vLLM) and compares with the step-by-step result recorded there;
- `experiments/vllm_referee/ported_scenarios_real.py` runs each through REAL vLLM 0.32's
  `Scheduler` (the vLLM venv) and prints what it schedules: the recorded results come from there.

A scenario: `config` (the scheduler's and cache's settings; `num_blocks` counts USABLE blocks:
vLLM gets one more, its null block) and `requests`: (id, prompt, max_tokens, arrive_step) where
the prompt is a list of (token id, count) runs (equal runs = equal content = a shareable prefix)
and the request is added just before the scheduler's step number `arrive_step` (0-based).
Every run goes on until every request has finished.

A scenario under vLLM's `--scheduling-policy priority` also has `policy: "priority"` and
`priority`: {id: (priority, arrival_time)} for every request (vLLM's `Request(priority=...,
arrival_time=...)`; the testbed's `Request.priority` and `arrival`). Its steps are recorded
as ordered (request, tokens) pairs, so the order in which vLLM scheduled them is compared too.
A scenario without `policy` is FCFS (vLLM's default).
"""
from __future__ import annotations

DEFAULTS = dict(
    num_blocks=10_000,  # usable blocks (vLLM: num_blocks + 1, the null block)
    block_size=16,
    max_num_batched_tokens=8192,
    max_num_seqs=16,
    max_model_len=8192,
    enable_prefix_caching=True,
    long_prefill_token_threshold=0,
    enable_chunked_prefill=True,
    reserve_full_isl=True,  # vLLM 0.32's scheduler_reserve_full_isl default
)


def _scenario(config=None, requests=()):
    return dict(config={**DEFAULTS, **(config or {})}, requests=list(requests))


def _priority(config, requests, prio):
    """A scenario under --scheduling-policy priority; `prio`: {id: (priority, arrival_time)}.
    Upstream's create_scheduler_with_priority turns prefix caching off unless asked."""
    sc = _scenario({"enable_prefix_caching": False, **config}, requests)
    assert set(prio) == {r[0] for r in sc["requests"]}
    return dict(sc, policy="priority", priority={k: tuple(v) for k, v in prio.items()})


def _upstream_prio(priorities, arrivals, num_tokens=10, max_tokens=16, config=None, ids=None):
    """Upstream's create_requests_with_priority: request i has the prompt [i] * num_tokens, all
    added before the first step."""
    ids = ids or [str(i) for i in range(len(priorities))]
    reqs = [(rid, [(100 + i, num_tokens)], max_tokens, 0) for i, rid in enumerate(ids)]
    return _priority(config or {}, reqs, {rid: (p, a) for rid, p, a in zip(ids, priorities, arrivals)})


def _distinct(n, num_tokens, max_tokens, arrive=0, first_id=0, ids=None):
    """n requests with distinct prompts ([i] * num_tokens, as upstream's create_requests)."""
    ids = ids or [str(first_id + i) for i in range(n)]
    return [(rid, [(100 + first_id + i, num_tokens)], max_tokens, arrive) for i, rid in enumerate(ids)]


SCENARIOS = {
    # upstream test_schedule: ten 10-token prompts all fit in one step
    "schedule_apc_off": _scenario(dict(enable_prefix_caching=False), _distinct(10, 10, 16)),
    "schedule_apc_on": _scenario(dict(enable_prefix_caching=True), _distinct(10, 10, 16)),
    # upstream test_schedule_concurrent_partial_requests
    "concurrent_partial_apc_off": _scenario(
        dict(max_num_batched_tokens=1024, max_model_len=1024, long_prefill_token_threshold=400,
             enable_prefix_caching=False), _distinct(3, 800, 16)),
    "concurrent_partial_apc_on": _scenario(
        dict(max_num_batched_tokens=1024, max_model_len=1024, long_prefill_token_threshold=400,
             enable_prefix_caching=True), _distinct(3, 800, 16)),
    # upstream test_schedule_order[True/False]: two long prompts, then two short ones
    "order_chunked": _scenario(
        dict(max_num_batched_tokens=1024, max_model_len=1024, max_num_seqs=3),
        _distinct(2, 800, 16, ids=["1", "2"]) + _distinct(2, 10, 16, first_id=2, ids=["3", "4"])),
    "order_unchunked": _scenario(
        dict(max_num_batched_tokens=1024, max_model_len=1024, max_num_seqs=3, enable_chunked_prefill=False),
        _distinct(2, 800, 16, ids=["1", "2"]) + _distinct(2, 10, 16, first_id=2, ids=["3", "4"])),
    # without chunked prefill but with long_prefill_token_threshold: the threshold caps the 1000-token prompt to
    # 256 before the no-chunking check (vLLM 0.32 scheduler.py L1155-1167), so it is admitted beside the short one
    # in the first step and goes on in 256-token pieces (issue 24: ours had compared the whole prompt and stalled)
    "threshold_unchunked": _scenario(
        dict(max_num_batched_tokens=1024, max_model_len=1024, long_prefill_token_threshold=256,
             enable_chunked_prefill=False),
        _distinct(1, 100, 8, ids=["short"]) + _distinct(1, 1000, 4, first_id=1, ids=["long"])),
    # async scheduling (vLLM's default since 0.14): the next step is scheduled before the last one's outputs
    # are back, so a request finishing in step N still holds its seat and its KV blocks in the schedule of
    # step N+1, where it is skipped (vLLM 0.32 scheduler.py L664-676), and is freed only after it
    "async_limited_slots": _scenario(
        dict(max_num_batched_tokens=1000, max_model_len=1000, max_num_seqs=2, async_scheduling=True),
        _distinct(4, 10, 16)),
    "async_limited_slots_staggered": _scenario(
        dict(max_num_batched_tokens=1000, max_model_len=1000, max_num_seqs=2, async_scheduling=True),
        _distinct(1, 10, 8) + _distinct(1, 10, 16, first_id=1) + _distinct(1, 10, 4, arrive=2, first_id=2)),
    "async_kv_held": _scenario(
        dict(num_blocks=8, max_num_batched_tokens=256, max_model_len=256, enable_prefix_caching=False,
             async_scheduling=True),
        _distinct(1, 60, 5) + _distinct(1, 60, 30, first_id=1) + _distinct(1, 60, 4, arrive=2, first_id=2)),
    # ... and a block completed by a token still in flight is cached only once that step's outputs are back,
    # after the next schedule: the request preempted by that schedule loses it, and resumes with one block less
    # hit (allocate_slots caches up to request.num_tokens, kv_cache_manager.py L612-616; the async scheduler's
    # _update_request_with_output the rest, async_scheduler.py L70-75, for a request still running)
    # (found by a random search against real vLLM: tests/test_vllm_native.py has the GPU-scale check)
    "async_inflight_block": _scenario(
        dict(num_blocks=6, max_num_seqs=2, max_num_batched_tokens=256, max_model_len=256, async_scheduling=True),
        [("0", [(7, 16), (100, 27)], 8, 1), ("1", [(101, 31)], 29, 6)]),
    # ... and may be the victim: the newest running request, finished in the step before, is preempted (its
    # blocks freed at once) when the long one needs a block, where a synchronous vLLM had freed it already
    "async_finishing_victim": _scenario(
        dict(num_blocks=8, max_num_batched_tokens=256, max_model_len=256, enable_prefix_caching=False,
             async_scheduling=True),
        _distinct(1, 60, 40) + _distinct(1, 60, 5, first_id=1)),
    # the same under --scheduling-policy priority: the victim is the worst (priority, arrival) running request,
    # which may be one that finished in the step before
    "async_prio_finishing_victim": _priority(
        dict(num_blocks=8, max_num_batched_tokens=256, max_model_len=256, async_scheduling=True),
        [("A", [(100, 60)], 40, 0), ("B", [(101, 60)], 5, 0)], {"A": (0, 1.0), "B": (1, 2.0)}),
    "async_arrival": _scenario(
        dict(async_scheduling=True), _distinct(1, 10, 6) + _distinct(1, 10, 3, arrive=3, first_id=1)),
    # upstream test_priority_scheduling_with_limited_slots, FCFS: max_num_seqs=2 caps the batch
    "limited_slots": _scenario(
        dict(max_num_seqs=2, max_num_batched_tokens=1000, max_model_len=1000), _distinct(4, 10, 16)),
    # upstream test_priority_scheduling_preemption_and_resumption_when_out_of_kv, FCFS:
    # 4 usable 16-token blocks; A (30 tokens) runs, B (32) joins, A's 33rd token needs a
    # third block: B (the newest) is preempted. C (4 tokens) arrives in the preempting step.
    "preempt_newest_apc_off": _scenario(
        dict(num_blocks=4, max_num_seqs=2, max_num_batched_tokens=200, max_model_len=200,
             enable_prefix_caching=False),
        [("A", [(1, 30)], 16, 0), ("B", [(2, 32)], 16, 1), ("C", [(3, 4)], 4, 2)]),
    "preempt_newest_apc_on": _scenario(
        dict(num_blocks=4, max_num_seqs=2, max_num_batched_tokens=200, max_model_len=200,
             enable_prefix_caching=True),
        [("A", [(1, 30)], 16, 0), ("B", [(2, 32)], 16, 1), ("C", [(3, 4)], 4, 2)]),
    # upstream test_kv_connector_handles_preemption, without the connector: 6 usable 2-token
    # blocks, two 5-token prompts, 4 output tokens each; the second is preempted and re-admitted
    "small_blocks_preemption_apc_on": _scenario(
        dict(num_blocks=6, block_size=2, enable_prefix_caching=True), _distinct(2, 5, 4)),
    "small_blocks_preemption_apc_off": _scenario(
        dict(num_blocks=6, block_size=2, enable_prefix_caching=False), _distinct(2, 5, 4)),
    # FCFS victim choice with three running requests: the oldest (A) needs a block, the newest
    # (C) is preempted although B is the one next to it in the batch; B keeps running
    "preempt_newest_of_three": _scenario(
        dict(num_blocks=6, block_size=4, enable_prefix_caching=False),
        [("A", [(1, 8)], 8, 0), ("B", [(2, 6)], 8, 0), ("C", [(3, 6)], 8, 0)]),
    # a recompute-preempted request re-hits its own cached blocks when re-admitted, output
    # tokens included (every full block of every request is cached, not only prompt blocks):
    # 8 usable 4-token blocks; B (4-token prompt) preempts itself at step 9 holding 3 full
    # blocks (12 tokens: 4 prompt + 8 output); A finishes at step 10 without taking them
    "preempt_rehit_output_blocks": _scenario(
        dict(num_blocks=8, block_size=4, enable_prefix_caching=True),
        [("A", [(1, 8)], 11, 0), ("B", [(2, 4)], 20, 0)]),
    # upstream test_spec_decode_padding_first_decode_step (an identical 33-token prompt hits 32 =
    # num_prompt_tokens - 1) and test_prefix_cache_stats_counted_once_for_retried_then_scheduled_request
    # (a 48-token prompt behind a cached 32-token one hits 32): a seed request fills the cache and
    # finishes; then prompts of 33, 32, 40 (32 shared) and 16 tokens arrive together.
    "prefix_hit_capped": _scenario(
        dict(enable_prefix_caching=True),
        [("seed", [(7, 33)], 2, 0),
         ("same33", [(7, 33)], 2, 2), ("same32", [(7, 32)], 2, 2), ("ext40", [(7, 32), (9, 8)], 2, 2),
         ("same16", [(7, 16)], 2, 2)]),
    # eviction takes blocks that hold no cached content first (vLLM's block_pool.free_blocks puts
    # them at the FRONT of the free queue), cached ones after, least recently freed first: in 3
    # usable 4-token blocks the seed S leaves 2 cached blocks, T's partial block is freed after
    # them, and V takes T's block, not S's, so X still hits both of S's blocks (8 tokens)
    "evict_uncached_first": _scenario(
        dict(num_blocks=3, block_size=4, enable_prefix_caching=True),
        [("S", [(7, 8)], 1, 0), ("T", [(8, 2)], 1, 1), ("V", [(10, 3)], 1, 2), ("X", [(7, 9)], 1, 3)]),
    # prefix blocks are cached when scheduled: the second of two identical 48-token prompts
    # arriving together hits the first's blocks in the same step
    "prefix_hit_same_step": _scenario(
        dict(enable_prefix_caching=True), [("A", [(5, 48)], 3, 0), ("B", [(5, 48)], 3, 0)]),
    # upstream test_kv_connector_unable_to_allocate, without the connector: 9 usable 4-token
    # blocks, two 24-token prompts (6 blocks each): the second runs only once the first finished
    "finish_frees_blocks": _scenario(
        dict(num_blocks=9, block_size=4, enable_prefix_caching=True), _distinct(2, 24, 2)),
    # upstream test_memory_leak: five 10-token requests added one per step, 10 tokens each
    "memory_leak": _scenario(
        dict(enable_prefix_caching=True),
        [(str(i), [(100 + i, 10)], 10, i) for i in range(5)]),
    # long_prefill_token_threshold is lifted while a single request is running + waiting
    "threshold_single_request": _scenario(
        dict(max_num_batched_tokens=1024, max_model_len=1024, long_prefill_token_threshold=400),
        _distinct(1, 800, 4)),
    "threshold_lifted_when_alone": _scenario(
        dict(max_num_batched_tokens=1024, max_model_len=4096, long_prefill_token_threshold=400),
        [("short", [(1, 10)], 2, 0), ("long", [(2, 2000)], 2, 0)]),
    # ... but not while another request waits (here behind max_num_seqs=1): running + waiting counts
    "threshold_kept_with_waiting": _scenario(
        dict(max_num_batched_tokens=1024, max_model_len=4096, long_prefill_token_threshold=400, max_num_seqs=1),
        [("long", [(2, 1000)], 2, 0), ("short", [(1, 10)], 2, 0)]),
    # the whole-prompt admission gate (scheduler_reserve_full_isl): 10 usable 16-token blocks,
    # a 64-token budget, two 100-token prompts (7 blocks each)
    "full_isl_gate": _scenario(
        dict(num_blocks=10, max_num_batched_tokens=64, max_model_len=256, enable_prefix_caching=False),
        _distinct(2, 100, 4)),
    "full_isl_gate_off": _scenario(
        dict(num_blocks=10, max_num_batched_tokens=64, max_model_len=256, enable_prefix_caching=False,
             reserve_full_isl=False),
        _distinct(2, 100, 4)),
    # the gate counts a prefix hit on blocks a running request holds: X (100 tokens, 7 blocks)
    # shares its first 64 tokens with the running R, so it needs only 3 new blocks of the 5 free
    "full_isl_gate_counts_hit": _scenario(
        dict(num_blocks=10, max_num_batched_tokens=256, max_model_len=256, enable_prefix_caching=True),
        [("R", [(7, 64), (8, 16)], 8, 0), ("X", [(7, 64), (9, 36)], 4, 2)]),
    # ... and a hit on cached blocks nobody holds (a finished seed's), which admitting revives
    "full_isl_gate_evictable_hit": _scenario(
        dict(num_blocks=10, max_num_batched_tokens=256, max_model_len=256, enable_prefix_caching=True),
        [("S", [(7, 64)], 1, 0), ("R", [(8, 80)], 20, 1), ("X", [(7, 64), (9, 36)], 4, 2)]),
    # --- --scheduling-policy priority (vLLM's PriorityRequestQueue; a lower value is served first) ---
    # upstream test_priority_scheduling_basic_ordering / _arrival_time_tiebreaker /
    # _mixed_priority_and_arrival / _fcfs_fallback: all fit; admitted in (priority, arrival) order
    "prio_basic_ordering": _upstream_prio([2, 0, 1], [1.0, 2.0, 3.0]),
    "prio_arrival_tiebreaker": _upstream_prio([1, 1, 1], [3.0, 1.0, 2.0]),
    "prio_mixed_priority_and_arrival": _upstream_prio([2, 1, 1, 0], [1.0, 3.0, 2.0, 4.0]),
    "prio_fcfs_fallback": _upstream_prio([1, 1, 1, 1], [4.0, 1.0, 3.0, 2.0]),
    # upstream _preemption_victim_selection / _equal_priority_preemption / _waiting_queue_order /
    # _heap_property: max_num_seqs=1 serves one at a time, in heap order
    "prio_victim_selection": _upstream_prio([3, 2, 0], [1.0, 2.0, 3.0], config=dict(max_num_seqs=1)),
    "prio_equal_priority": _upstream_prio([2, 2, 2], [3.0, 1.0, 2.0], config=dict(max_num_seqs=1)),
    "prio_waiting_queue_order": _upstream_prio([3, 1, 2, 0], [1.0, 2.0, 3.0, 4.0], config=dict(max_num_seqs=1)),
    "prio_heap_property": _upstream_prio([5, 1, 8, 3, 2, 7, 4, 6], [float(i) for i in range(8)], max_tokens=1,
                                         config=dict(max_num_seqs=1)),
    # upstream _with_limited_slots: max_num_seqs=2 admits the two best of four
    "prio_limited_slots": _upstream_prio([3, 1, 2, 0], [1.0, 2.0, 3.0, 4.0],
                                         config=dict(max_num_seqs=2, max_num_batched_tokens=1000, max_model_len=1000)),
    # upstream _no_preemption_when_space_available: two low-priority 30-token requests run, a
    # high-priority one joins without preempting anybody
    "prio_no_preemption_when_space": _priority(
        dict(max_num_seqs=3, max_num_batched_tokens=200, max_model_len=200),
        [("lo1", [(1, 30)], 16, 0), ("lo2", [(2, 30)], 16, 0), ("hi1", [(3, 30)], 16, 1)],
        {"lo1": (5, 1.0), "lo2": (5, 2.0), "hi1": (0, 3.0)}),
    # upstream _preemption (skipped upstream, "needs investigation"): the same with 5 usable blocks
    "prio_preemption": _priority(
        dict(num_blocks=5, max_num_seqs=3, max_num_batched_tokens=200, max_model_len=200),
        [("lo1", [(1, 30)], 16, 0), ("lo2", [(2, 30)], 16, 0), ("hi1", [(3, 30)], 16, 1)],
        {"lo1": (5, 1.0), "lo2": (5, 2.0), "hi1": (0, 3.0)}),
    # upstream _preemption_and_resumption_when_out_of_kv (without its KV connector): 4 usable
    # blocks; low (30 tokens) runs, high (32) joins; at the third step low is scheduled first,
    # then high needs a third block and the victim is low, ALREADY SCHEDULED in this step
    "prio_preempt_resume_out_of_kv": _priority(
        dict(num_blocks=4, max_num_seqs=2, max_num_batched_tokens=200, max_model_len=200),
        [("0", [(100, 30)], 16, 0), ("1", [(101, 32)], 16, 1)],
        {"0": (1, 0.0), "1": (0, 1.0)}),
    # crafted: running order, not priority order, hands out the token budget: A (priority 5) was
    # admitted first, B (priority 0) later; with a 64-token budget A's decode comes before B's chunk
    "prio_running_order_budget": _priority(
        dict(max_num_batched_tokens=64, max_model_len=256),
        [("A", [(1, 100)], 4, 0), ("B", [(2, 100)], 4, 1)],
        {"A": (5, 0.0), "B": (0, 1.0)}),
    # crafted: the victim is a request scheduled earlier in the step, with one between: A (worst)
    # was admitted first; B and C (better) later; when C needs a block, A gives back its token and blocks
    "prio_victim_scheduled_earlier": _priority(
        dict(num_blocks=7, block_size=4),
        [("A", [(1, 6)], 12, 0), ("B", [(2, 4)], 12, 1), ("C", [(3, 4)], 12, 1)],
        {"A": (3, 0.0), "B": (0, 1.0), "C": (1, 1.5)}),
    # crafted: the first running request is the worst and preempts itself: the pass stops and the
    # better request behind it is not scheduled in that step
    "prio_self_preempt_first": _priority(
        dict(num_blocks=4, block_size=4),
        [("A", [(1, 4)], 12, 0), ("B", [(2, 4)], 6, 1)],
        {"A": (5, 0.0), "B": (0, 1.0)}),
}


def prompt_tokens(runs) -> list[int]:
    return [tok for tok, count in runs for _ in range(count)]


def rle(steps: list[dict]) -> list[tuple[int, dict]]:
    """Runs of equal consecutive steps as (repeat, step) pairs: how EXPECTED writes them."""
    out: list[tuple[int, dict]] = []
    for n in steps:
        if out and out[-1][1] == n:
            out[-1] = (out[-1][0] + 1, n)
        else:
            out.append((1, n))
    return out
