"""vLLM V1's default scheduler: FCFS with chunked prefill and recompute preemption.

Source: vLLM v0.32, `vllm/v1/core/sched/scheduler.py` (`Scheduler.schedule`, L591-1405) and
`vllm/v1/core/kv_cache_manager.py`; `testbed-referee` checks it step by step against that code.
Rule, per step, under a token budget:
1. `long_prefill_token_threshold` caps one request's chunk, unless the running and waiting
   requests number one in all: nobody to starve, so the cap is lifted (L640-648).
2. Running requests first, in admission order (L659): each takes what it still needs (the
   rest of its prefill, or one decode token), capped by the threshold and the remaining
   budget (L704-711). If its KV blocks do not fit, preempt the most recently admitted
   running request (`self.running.pop()` L834, recompute: `_preempt_request` L1571 frees its
   blocks and puts it back at the head of the waiting queue) and retry; if that was the
   request itself, stop (L776-848).
3. Only if nothing was preempted this step (L900): admit waiting requests FCFS while the
   sequence cap (L923), budget and KV allow, stopping at the first that does not fit
   (L1275). Its prefix-cache hit counts as computed (`get_computed_blocks`: full blocks,
   at most known length - 1; kv_cache_manager.py L264-296), including blocks registered
   earlier in this same step and not those this step's allocations evicted (the plan is
   made through `view.kv_preview()`). With `reserve_full_isl` (vLLM's default
   `scheduler_reserve_full_isl=True`) a request is admitted only if blocks for its whole
   known sequence are free (`allocate_slots(full_sequence_must_fit=...)`, L1270 and
   kv_cache_manager.py L522-538), though it takes only its chunk's. With
   `chunked_prefill=false`, a prompt that does not fit in the remaining budget waits and
   blocks the queue (L1160-1167); one longer than the whole budget is still chunked. The
   threshold caps the chunk before that check (L1155-1156), so a long prompt is admitted in
   threshold-sized pieces even then.
4. Under async scheduling (`backend.async_scheduling`, vLLM's default), the step is scheduled
   before the previous step's outputs are back: a request that finished in that step is still
   running, skipped (L664-676) but holding its seat (the L923 count) and its KV blocks, and may
   be the victim of a preemption (L834); it is freed once that schedule is done
   (`StepLoop.finishing`, testbed/core/loop.py). A block completed by a token still in flight
   (the output of the step before) is cached only once that output is back, after the schedule
   (allocate_slots caps caching at `request.num_tokens`, kv_cache_manager.py L612-616; the async
   scheduler caches the rest, async_scheduler.py L70-75), so a request that schedule preempts loses
   it (`StepLoop.in_flight`). An arrival during a step reaches the schedule after the next
   (testbed/sim/simulation.py).
The KV rules (every full block cached when scheduled, LRU free queue, null block) are the
BlockManager's (testbed/core/kv.py). Not modelled: speculative decoding, encoders, LoRA, KV
connectors, pipeline parallelism.
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.policies._passes import StepBudget, admit, run_running
from testbed.core.bounds import bounded
from testbed.core.plan import PREEMPT_MODES, RECOMPUTE, Plan
from testbed.core.policy import BasePolicy, PolicyKnobs, register


@dataclass
class VLLMKnobs(PolicyKnobs):
    name: str = "vllm"
    chunked_prefill: bool = True
    long_prefill_token_threshold: int = bounded(0, ge=0)  # 0 = no cap on one request's prefill chunk
    reserve_full_isl: bool = True  # vLLM's scheduler_reserve_full_isl: admit only if the whole sequence fits
    preemption_mode: str = RECOMPUTE  # "recompute" (V1) or "swap" (V0)

    def __post_init__(self):
        super().__post_init__()
        if self.preemption_mode not in PREEMPT_MODES:
            raise ValueError(f"policy.preemption_mode={self.preemption_mode!r}: expected one of {PREEMPT_MODES}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"policy.long_prefill_token_threshold={self.long_prefill_token_threshold}: must be >= 0")


@register
class VLLMPolicy(BasePolicy):
    name = "vllm"
    Knobs = VLLMKnobs
    models_async_scheduling = True  # the step loop applies vLLM's async-scheduling rule 4 under async scheduling

    def is_steady(self, view) -> bool:
        """With every running request decoding and nothing admitted or preempted (the loop checks both, and
        KV growth, so nothing is preempted later), the plan repeats until an arrival or a finish while nobody
        waits, and also while the queue's head stays shut out. By the sequence cap (rule 3, L923: admission
        stops there before it looks at the queue; the decodes keep their seats) it stays so. By the KV, it
        does under `reserve_full_isl`: the head needs blocks for its whole sequence less those of its prefix
        hit that running requests hold, and a decode run only takes free blocks (evicting cached ones, which
        can only shorten a hit), unless a running request caches a block the head may share during the run:
        a keyed block computed and not cached yet (under async scheduling a block completed by the step
        before is cached after the next schedule, rule 4) or a decoded block with shared keys (a session's
        parent turn, `hashes_span_output`). Without `reserve_full_isl` the head needs only its chunk's
        blocks beyond its hit, which an eviction can lower. The overloaded stages of a calibration run spend
        most of their steps with a full batch and a queue."""
        running = view.running
        if not view.waiting or len(running) >= view.max_num_seqs:
            return True
        if not self.knobs.reserve_full_isl:
            return False
        # shut out now, the step's blocks taken (and those of the requests the step before finished, freed after
        # the schedule, given back): the whole sequence's blocks less the hit others hold, as `admit` gates it
        head = next(iter(self.waiting_order(view)))
        if view.blocks_needed(head, view.num_new_tokens(head)) <= view.free_blocks:
            return False
        bs, keys = view.block_size, view.block_keys
        for s in running:
            if s.req.hashes_span_output:
                return False
            cached = s.num_cached_blocks
            if s.num_computed // bs > cached and len(keys(s)) > cached:
                return False
        return True

    def running_order(self, view) -> list:
        return view.running

    def waiting_order(self, view):
        return view.waiting

    def schedule(self, view) -> Plan:
        k = self.knobs
        plan, b = Plan(), StepBudget.of(view)
        cap = k.long_prefill_token_threshold if len(view.running) + len(view.waiting) > 1 else 0
        preview = view.kv_preview() if view.waiting else None
        run_running(view, plan, self.running_order(view), b, k.preemption_mode, cap or None, preview=preview)
        if not b.preempted and view.waiting:
            admit(view, plan, self.waiting_order(view), b, k.chunked_prefill, cap or None, preview=preview,
                  full_sequence_must_fit=k.reserve_full_isl)
        return plan
