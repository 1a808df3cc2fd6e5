"""`backend.scheduler=policy`: a vLLM V1 Scheduler whose `schedule()` asks a testbed policy.

The testbed's own step loop (`testbed.core.loop.StepLoop`: the policy, plan validation, KV
accounting, preemption and token bookkeeping, exactly as in the simulator) decides each step
on a BlockManager sized and blocked like vLLM's cache (its usable blocks, its block size).
This scheduler then carries the plan out in vLLM with vLLM's own primitives, in the order
upstream `Scheduler.schedule()` uses them (vllm/v1/core/sched/scheduler.py, v0.32):
`_preempt_request` for each request the loop preempted, `kv_cache_manager.allocate_slots`
for every scheduled request (decodes included), waiting requests moved to `running` with
status RUNNING, and the `SchedulerOutput` built as upstream builds it
(`NewRequestData.from_request`, `_make_cached_request_data`, `_update_after_schedule`).

What vLLM V1 cannot do is refused rather than faked: it preempts by recompute only
(`_preempt_request` frees the blocks; there is no swap space), so a policy knob asking for
swap preemption stops the run at start. Prefix caching is on or off on both sides alike
(`kv.enable_prefix_caching`): the loop's BlockManager caches every full block by content as
vLLM's block pool does, and each admission's hit is checked against vLLM's `get_computed_blocks`.
Speculative decoding, encoders, LoRA and KV connectors are not set up by this backend, and
upstream's handling of them is left out.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from testbed.core.loop import Batch, StepLoop
from testbed.core.request import Status


class PlanNotApplicable(RuntimeError):
    """vLLM's state disagrees with the testbed loop's: a bug here, never the policy's."""


@dataclass
class PolicyBridge:
    """What the scheduler and the replay share: the loop, the clock origin, the id map and the
    batch being run (None for a step with nothing scheduled)."""

    loop: StepLoop | None = None
    t0: float = 0.0
    clock: Callable[[], float] = time.perf_counter
    vllm_id: dict[int, str] = field(default_factory=dict)  # testbed request id -> vLLM's internal id
    testbed_id: dict[str, int] = field(default_factory=dict)  # and back (vLLM appends a suffix to ids)
    batch: Batch | None = None
    num_blocks: int = 0
    block_size: int = 0
    preemptions: dict[int, int] = field(default_factory=dict)  # testbed id -> the loop's preemptions applied in vLLM


def swap_knob_problem(knobs: dict, policy: str) -> str:
    """Why a policy's knobs ask for something vLLM V1 cannot do, or ''."""
    mode = knobs.get("preemption_mode")
    if mode is not None and mode != "recompute":
        return (f"policy.preemption_mode={mode}: backend=vllm runs vLLM V1, which preempts by recompute only "
                f"(vllm/v1/core/sched/scheduler.py `_preempt_request` frees the request's blocks; V1 has no swap "
                f"space); set policy.preemption_mode=recompute for policy {policy!r}")
    return ""


def scheduler_class(bridge: PolicyBridge):
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import RequestStatus

    class PolicyScheduler(Scheduler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            bridge.num_blocks = self.kv_cache_manager.block_pool.num_gpu_blocks - 1  # less the null block
            bridge.block_size = self.block_size

        def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
            self.current_step += 1
            self.kv_cache_manager.new_step_starts()
            loop = bridge.loop
            now = bridge.clock() - bridge.t0
            batch = loop.plan(now) if loop.has_work else None
            bridge.batch = batch
            # the loop's preemptions (this plan's, or an earlier preempt-only plan's), in vLLM; a request
            # the loop preempted and re-admitted within one plan (a preempt-only round, then the policy
            # asked again: Sarathi-Serve's victims) is running again there, so its preemption count tells
            stamp = time.monotonic()
            seen = bridge.preemptions
            for req in list(self.running):
                tid = bridge.testbed_id.get(req.request_id, -1)
                s = loop.live.get(tid)
                if s is not None and (s.status is Status.WAITING or s.num_preemptions != seen.get(tid, 0)):
                    seen[tid] = s.num_preemptions
                    self.running.remove(req)
                    self._preempt_request(req, stamp)
            new_reqs, resumed, running = [], [], []
            blocks, tokens = {}, {}
            for s, n in batch.items if batch is not None else ():
                rid = bridge.vllm_id[s.req.id]
                req = self.requests[rid]
                if req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                    if req.num_computed_tokens != 0:
                        raise PlanNotApplicable(f"request {s.req.id} re-enters vLLM with {req.num_computed_tokens} "
                                                "computed tokens; the testbed loop recomputes it from 0")
                    # vLLM's prefix-cache hit (its waiting pass, scheduler.py L967) must cover the one the
                    # loop's BlockManager gave (both cache every full block by content); the loop takes
                    # less of it when the plan asked for more tokens than the hit leaves, and so does vLLM
                    hit_blocks, hit, _ = self.kv_cache_manager.get_computed_blocks(req)
                    if hit < s.num_computed:
                        raise PlanNotApplicable(f"request {s.req.id}: vLLM's prefix cache hits {hit} tokens, the "
                                                f"testbed loop's {s.num_computed}")
                    if hit > s.num_computed:
                        hit_blocks = self.kv_cache_manager.truncate_computed_blocks(hit_blocks, s.num_computed)
                        hit = s.num_computed
                    if self.kv_cache_manager.allocate_slots(req, n, num_new_computed_tokens=hit,
                                                            new_computed_blocks=hit_blocks,
                                                            num_lookahead_tokens=self.num_lookahead_tokens,
                                                            has_scheduled_reqs=bool(self.running)) is None:
                        raise self._refused(s, n)
                    self.waiting.remove_request(req)
                    self.running.append(req)
                    (new_reqs if req.status == RequestStatus.WAITING else resumed).append(req)
                    req.status = RequestStatus.RUNNING
                    req.num_computed_tokens = hit
                    blocks[rid] = self.kv_cache_manager.get_blocks(rid)
                    if hit + n < req.num_tokens:
                        self._inflight_prefills.add(req)
                else:
                    if req.num_computed_tokens != s.num_computed:
                        raise PlanNotApplicable(f"request {s.req.id}: vLLM has {req.num_computed_tokens} tokens "
                                                f"computed, the testbed loop {s.num_computed}")
                    got = self.kv_cache_manager.allocate_slots(req, n, num_lookahead_tokens=self.num_lookahead_tokens)
                    if got is None:
                        raise self._refused(s, n)
                    blocks[rid] = got
                    running.append(req)
                tokens[rid] = n
            return self._output(new_reqs, resumed, running, blocks, tokens)

        def _refused(self, s, n) -> PlanNotApplicable:
            return PlanNotApplicable(
                f"vLLM's KV cache refused {n} tokens for request {s.req.id} that the testbed loop's accounting "
                f"placed ({self.kv_cache_manager.block_pool.get_num_free_blocks()} vLLM blocks free)")

        def _output(self, new_reqs, resumed, running, blocks, tokens) -> SchedulerOutput:
            """The SchedulerOutput as the tail of upstream `schedule()` builds it (no spec decode,
            encoder inputs, LoRA or connectors: this backend sets none of them up)."""
            if self.use_v2_model_runner:
                new_reqs = new_reqs + resumed
                resumed = []
                new_data = [NewRequestData.from_request(r, blocks[r.request_id].get_block_ids(), r._all_token_ids,
                                                        uses_mrope=self.model_uses_mrope) for r in new_reqs]
            else:
                new_data = [NewRequestData.from_request(r, blocks[r.request_id].get_block_ids(),
                                                        uses_mrope=self.model_uses_mrope) for r in new_reqs]
            cached = self._make_cached_request_data(running, resumed, tokens, {}, blocks)
            if not self.use_v2_model_runner:
                self.prev_step_scheduled_req_ids.clear()
                self.prev_step_scheduled_req_ids.update(tokens.keys())
            self.kv_cache_manager.take_boundary_state_offloads()
            copies, retained = self.kv_cache_manager.take_kv_cache_block_copies()
            if copies:
                self._free_cow_retained_blocks(retained, self.sched_step_seq + 1)
            total = sum(tokens.values())
            out = SchedulerOutput(
                scheduled_new_reqs=new_data, scheduled_cached_reqs=cached, num_scheduled_tokens=tokens,
                total_num_scheduled_tokens=total, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                scheduled_encoder_input_stats=None, preempted_req_ids=self.reset_preempted_req_ids,
                finished_req_ids=self.finished_req_ids,
                free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
                new_block_ids_to_zero=self._get_new_block_ids_to_zero(), has_sync_kv_loads=False,
                kv_cache_block_copies=copies or None, kv_connector_block_state=None,
                num_spec_tokens_to_schedule=self.num_spec_tokens,
                ec_manager_metadata=self.encoder_cache_manager.get_manager_metadata())
            if self.defer_block_free and total > 0:
                self.sched_step_seq += 1
            self._update_after_schedule(out)
            return out

    return PolicyScheduler
