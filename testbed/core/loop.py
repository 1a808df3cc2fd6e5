"""The one step loop both backends drive: admit, plan, validate, apply, complete.

A backend calls `arrive()` as requests reach it, `plan()` to get the next validated
batch (with the `BatchShape` its cost model or GPU needs), runs the batch however it
runs batches, and then calls `complete()` with the time the step ended. All request
progress, KV accounting, preemption and time stamping happen here, so the simulator
and the engine cannot disagree about what a policy did.
"""
from __future__ import annotations

import bisect
from array import array
from dataclasses import dataclass, field
from operator import itemgetter

from testbed.core.compiled import mypyc_attr
from testbed.core.cost import BatchShape, CostModel, add_work, decode_run_ends
from testbed.core.kv import BlockManager, KVCapacityError
from testbed.core.plan import PREEMPT_MODES, RECOMPUTE, Plan, PlanError
from testbed.core.policy import BasePolicy, Policy
from testbed.core.request import Request, RequestState, Status
from testbed.core.spec_decode import Drafter
from testbed.core.view import SchedulerView

_WAITING, _RUNNING, _SWAPPED, _FINISHED = Status.WAITING, Status.RUNNING, Status.SWAPPED, Status.FINISHED
_state_of = itemgetter(0)  # of a plan's (request, tokens) item


@dataclass
class SchedulerLimits:
    """Per-step limits every policy works under (vLLM's engine arguments of the same names)."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 8192

    def validate(self) -> None:
        for key in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"scheduler.{key}={getattr(self, key)}: must be >= 1")


@dataclass(slots=True)
class Batch:
    """A validated plan, applied to KV, ready to run.

    `ends` is set when the loop fast-forwards a steady decode run: the end time of each
    of its steps (see `StepLoop.extend_decode_run`).
    """

    items: list[tuple[RequestState, int]]
    shape: BatchShape
    start: float
    ends: list[float] | None = None
    # KV moves the engine must carry out before the forward: (request, device blocks) pairs,
    # the blocks a swapped-out request held, and the blocks a swapped-in request now holds
    swap_out: list[tuple[RequestState, list[int]]] | None = None
    swap_in: list[tuple[RequestState, list[int]]] | None = None
    # speculative decoding: the draft tokens each item verifies after its decode token (see spec_decode)
    drafts: list[int] | None = None


@dataclass
class StepSeries:
    """One row per step: the time series every run writes and W&B plots."""

    start: list[float] = field(default_factory=list)
    duration: list[float] = field(default_factory=list)
    prefill_tokens: list[int] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    kv_used_blocks: list[int] = field(default_factory=list)
    preemptions: list[int] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # >1 for a fast-forwarded decode run


@mypyc_attr(allow_interpreted_subclasses=True)  # the tests subclass it (testbed.core.compiled)
class StepLoop:
    def __init__(self, policy: Policy, kv: BlockManager, limits: SchedulerLimits,
                 cost_model: CostModel | None = None, record_token_times: bool = False,
                 drafter: Drafter | None = None):
        limits.validate()
        self.drafter = drafter  # speculative decoding (testbed.core.spec_decode); None: off
        self.policy = policy
        self.policy_name = getattr(policy, "name", type(policy).__name__)
        self.kv = kv
        self.limits = limits
        self.cost_model = cost_model
        # a fast-forwarded run's step times in one call, when the backend steps with this cost model
        # and it offers that (looked up on its class: a wrapper's __getattr__ must not answer for it)
        run_ends = getattr(type(cost_model), "decode_run_ends", None)
        self._cost_step = cost_model.step_time if run_ends is not None else None
        self._run_ends = run_ends.__get__(cost_model) if run_ends is not None else None
        self.record_token_times = record_token_times
        self.live: dict[int, RequestState] = {}  # waiting, swapped and running requests by id
        self.states: list[RequestState] = []  # every request that reached this loop
        self.waiting: list[RequestState] = []  # sorted by (arrival, id)
        self.running: list[RequestState] = []  # admission order
        self.itl = array("d")  # every inter-token gap, for ITL percentiles: 8 bytes each (a list: 32)
        self.series = StepSeries()
        self.num_steps = 0  # engine steps completed (a fast-forwarded run counts each of its steps)
        self.view = SchedulerView(self)
        self._is_steady = getattr(policy, "is_steady", None)
        self._steady_steps = getattr(policy, "steady_steps", None)  # optional: cuts a run where the plan changes
        self._pending_swaps: tuple[list | None, int] = (None, 0)  # (swap-outs, blocks moved) not yet run
        self._preempted = 0  # preemptions of preempt-only plans not yet run, counted in the step that runs
        # kv.cache_decode_tokens="finished" (SGLang): prompt blocks a step computes enter the cache
        # when the step completes (the radix tree inserts a prefill's tokens after its forward:
        # sglang 0.5.23 checkpoint_kv_cache, batch_result_processor.py L393-394, and a chunk at
        # the next step, scheduler.py L3915-3919), so a request later in the same step cannot hit them
        self._register_at_completion: list[tuple[RequestState, int]] = []
        self._offload = hasattr(kv, "take_loaded_blocks")  # kv.offload_gb: admissions may load blocks from host
        self._on_arrival = _hook(policy, "on_arrival")
        self._on_finish = _hook(policy, "on_finish")
        # disaggregated prefill/decode (testbed/sim/disaggregated.py): a prefill replica keeps a
        # finished request's KV until its transfer is done; a decode replica holds the blocks of
        # prompts whose KV is on its way (by request id)
        self.hold_finished_kv = False
        self.receiving: dict[int, RequestState] = {}
        # vLLM's async scheduling (the backend sets it; the rule applies to a policy that models vLLM's
        # scheduler, `models_async_scheduling`): step N+1 is scheduled before step N's outputs are back, so a
        # request that finished in step N is still in the running set then, skipped but holding its seat
        # and its KV blocks, and is freed only after that schedule (vllm/v1/engine/core.py
        # step_with_batch_queue L698-800; scheduler.py L664-676 skips it; update_from_output frees it)
        self.async_scheduling = False
        self.models_async = bool(getattr(policy, "models_async_scheduling", False))
        self.finishing: list[RequestState] = []  # finished in the last step, freed after the next schedule
        # ... and the requests that sampled a token in the last step: that token is not back when the next
        # step is scheduled, so a block it completes is cached only once the outputs are (`_cache_landed`)
        self.in_flight: set[RequestState] | None = None

    # --- arrivals ---------------------------------------------------------------------
    def arrive(self, req: Request, now: float) -> RequestState:
        """Take a request in, or reject it at once when it can never be served."""
        s = RequestState(req)
        self.states.append(s)
        if self.record_token_times:
            s.token_times = []
        reason = reject_reason(req, self.limits.max_model_len, self.kv)
        if reason:
            s.status, s.reject_reason, s.finish_time = Status.REJECTED, reason, now
            return s
        self.live[req.id] = s
        self.waiting.append(s)  # arrivals come in time order, so this keeps the queue sorted
        if self._on_arrival is not None:
            self.view.now = now
            self._on_arrival(s, self.view)
        return s

    # --- KV computed elsewhere (disaggregated prefill) ----------------------------------------
    def reserve_remote_kv(self, req: Request) -> RequestState | None:
        """Take blocks for the prompt of a request another replica prefilled, before its KV is
        sent here, or None when its blocks or a sequence slot are not free now. vLLM's decode
        scheduler allocates them and parks the request as WAITING_FOR_REMOTE_KVS while the KV
        connector loads into them (vllm/v1/core/sched/scheduler.py L1321-1323, 0.32); a request
        waiting for remote KV is counted against max_num_seqs here, as it will run next, and so is
        every live one (a preempted request waiting to be re-admitted too): the request joins the
        running set when its KV lands, which must never take it past max_num_seqs."""
        kv = self.kv
        if (kv.blocks_for(req.prompt_len) > kv.num_free_blocks
                or len(self.live) + len(self.receiving) >= self.limits.max_num_seqs):
            return None
        s = RequestState(req)
        if self.record_token_times:
            s.token_times = []
        kv.allocate(s, req.prompt_len)
        self.states.append(s)
        self.receiving[req.id] = s
        return s

    def receive_remote_kv(self, s: RequestState, now: float) -> None:
        """The prompt's KV has landed in the blocks `reserve_remote_kv` took: the request runs with
        every prompt token computed but the last, which its next step recomputes to sample the first
        output token (vLLM sets num_computed_tokens = num_tokens - 1 after a full remote hit:
        scheduler.py L3170-3171)."""
        del self.receiving[s.req.id]
        s.num_computed = s.req.prompt_len - 1
        s.status = _RUNNING
        self.live[s.req.id] = s
        self.running.append(s)
        if self._on_arrival is not None:
            self.view.now = now
            self._on_arrival(s, self.view)

    def release_kv(self, s: RequestState) -> None:
        """Free the KV of a finished request kept by `hold_finished_kv` (its transfer is done)."""
        self.kv.free(s, finished=True)

    @property
    def has_work(self) -> bool:
        return bool(self.live)

    # --- one step -------------------------------------------------------------------------
    def plan(self, now: float) -> Batch | None:
        """Ask the policy for a plan, check it, apply preemptions and KV allocation.

        Returns None when the policy scheduled nothing (the backend then waits for an
        arrival). Raises PlanError naming the policy and the rule when the plan is invalid.
        """
        view = self.view
        view.now = now
        # swaps of preempt-only plans, carried to the batch that runs (across a None too:
        # the engine copies the blocks out then, and a swap-in needs that copy)
        swap_out, swap_blocks = self._pending_swaps
        self._pending_swaps = (None, 0)
        preempted, self._preempted = self._preempted, 0
        while True:
            plan = self.policy.schedule(view)
            if not isinstance(plan, Plan):
                raise PlanError(self.policy_name, "plan-type", f"schedule() returned {type(plan).__name__}, not a Plan")
            if plan.preempt or not self._plainly_valid(plan.items):
                self._validate(plan)  # every rule, raising the first one the plan breaks
            shape = BatchShape()
            shape.swap_blocks = swap_blocks
            swap_out, swap_in, admitted = self._apply(plan, shape, now, swap_out)
            preempted += len(plan.preempt)
            if self.in_flight:
                self._cache_landed()
            freed = bool(self.finishing)
            if freed:  # the outputs of the step before come back after this schedule: vLLM frees its finished
                self._free_finishing()
            if plan.items:
                break
            if not plan.preempt and not freed:
                self._pending_swaps = (swap_out, shape.swap_blocks)
                self._preempted = preempted
                return None
            # The preemptions (or the seats and blocks the step before's finished requests held until
            # now: an empty schedule of its own in vLLM) changed what the policy sees: ask again now rather
            # than wait for an arrival. Each round preempts at least one running request or frees the
            # finished ones (once a plan), so this ends. A loop, not a recursion: a policy may preempt one request a round with
            # a thousand running, past Python's recursion limit.
            swap_blocks = shape.swap_blocks
        drafts = None
        if self.drafter is not None:
            budget = self.limits.max_num_batched_tokens - plan.num_tokens
            drafts = self.drafter.widen(plan.items, budget, self.kv, shape)
        series = self.series
        series.start.append(now)
        series.prefill_tokens.append(shape.num_prefill_tokens)
        series.decode_tokens.append(shape.num_decode_seqs)
        series.running.append(len(self.running))
        series.waiting.append(len(self.waiting))
        series.kv_used_blocks.append(self.kv.num_used_blocks)
        series.preemptions.append(preempted)
        series.steps.append(1)
        self._steady = admitted == 0 and not plan.preempt
        return Batch(plan.items, shape, now, None, swap_out, swap_in, drafts)

    def _apply(self, plan: Plan, shape: BatchShape, now: float, swap_out: list | None):
        """Apply a validated plan: preemptions first (their blocks serve the same plan), then
        admission and KV allocation. Swap traffic and the items' work are added to `shape`.
        Returns the swap-outs (appended to `swap_out`), the swap-ins and the number of requests
        admitted."""
        swap_in = None
        kv = self.kv
        bs = kv.block_size
        tracks_lookups = kv.tracks_lookups
        if tracks_lookups:
            self._replay_lookups(plan)
        if plan.free_first:
            kv.evict_to_free(-(-plan.free_first // bs))
        for s, mode in plan.preempt:
            if mode != RECOMPUTE and s.status is not _FINISHED:
                swap_out = swap_out or []
                swap_out.append((s, list(s.blocks)))
            self._preempt(s, mode, shape)
            if plan.keep_free and s.req.id in plan.keep_free:
                kv.evict_to_free(-(-plan.keep_free[s.req.id] // bs))
        # SGLang's order: every admission locks its cached prefix before the batch's KV is
        # allocated (and the cache evicted for it: alloc_for_extend, mem_cache/allocation.py L374)
        if tracks_lookups:
            self._acquire_prefixes(plan)
        admitted = 0
        cache_decode = kv.cache_decode
        caching = kv.enable_prefix_caching  # without it `register` caches nothing: not called
        in_flight = self.in_flight
        front, ref, block_refs = kv._front, kv._ref, kv._block_refs  # `allocate`'s one-block case, inlined below
        plain_allocate = type(kv).allocate is BlockManager.allocate
        # The batch's features are summed in this same walk over the items, with `add_work`'s
        # arithmetic inlined (`_work_of` once an item is applied: a waiting one's offset is its
        # prefix hit): one pass per step instead of two, and no tuple or call per item (calling
        # `_work_of` and `add_work` here measured 1-2 s slower on the main command). Keep the two alike.
        prefill_tokens = prefill_seqs = decode_seqs = decode_kv = prefill_kv = 0
        pairs = 0.0
        for s, n in plan.items:
            status = s.status
            if status is not _RUNNING:
                if status is _SWAPPED:
                    moved = self._guard_kv(kv.swap_in, s)
                    shape.swap_blocks += moved
                    swap_in = swap_in or []
                    swap_in.append((s, s.blocks[:moved]))
                else:  # never more hit than leaves the plan's n tokens to compute
                    if not tracks_lookups:
                        s.num_computed = kv.acquire_prefix(s, s.known_len - n)
                        s.prefix_hit_tokens += s.num_computed
                    if self._offload:  # the host-tier blocks its hit loaded cross the host link before the step
                        shape.load_blocks += kv.take_loaded_blocks()
                s.status = _RUNNING
                if s.first_scheduled < 0:
                    s.first_scheduled = now
                self.running.append(s)
                admitted += 1
            offset = s.num_computed
            upto = offset + n
            blocks = s.blocks
            if upto > len(blocks) * bs:
                if n == 1 and front and offset <= len(blocks) * bs and plain_allocate:
                    # a decode's one block off the queue's head (page size 1: every decode, every step):
                    # `allocate`'s own fast case, without the call
                    b = front.pop()
                    if block_refs:
                        ref[b] = 1
                    blocks.append(b)
                else:
                    try:  # self._guard_kv(kv.allocate, s, n), one call less per allocation
                        kv.allocate(s, n)
                    except KVCapacityError as e:
                        raise PlanError(self.policy_name, "kv-capacity", f"request {s.req.id}: {e}") from None
            # (is_prefill inlined, asked last: SGLang's page size 1 reaches it for every decode)
            if caching and upto // bs > s.num_cached_blocks and (
                    cache_decode or s.req.prompt_len + s.num_generated - offset > 1 or s.num_generated == 0):
                if cache_decode:
                    if in_flight is not None and s in in_flight:  # async: its last token is not back yet
                        last = min(upto, s.req.prompt_len + s.num_generated - 1)
                        if last // bs > s.num_cached_blocks:  # else nothing new: register would return at once
                            kv.register(s, last)
                    else:
                        kv.register(s, upto)  # cached when scheduled, as vLLM's allocate_slots does
                else:
                    self._register_at_completion.append((s, upto))
            if n == 1 and s.num_generated > 0 and offset + 1 == s.req.prompt_len + s.num_generated:
                decode_seqs += 1
                decode_kv += offset + 1
            else:
                prefill_tokens += n
                prefill_seqs += 1
                prefill_kv += offset + n
                pairs += n * (offset + (n + 1) / 2)
        shape.num_prefill_tokens += prefill_tokens
        shape.num_prefill_seqs += prefill_seqs
        shape.prefill_attn_pairs += pairs
        shape.prefill_kv_tokens += prefill_kv
        shape.num_decode_seqs += decode_seqs
        shape.decode_kv_tokens += decode_kv
        if admitted:
            self._drop_admitted_from_waiting(admitted)
        return swap_out, swap_in, admitted

    def _replay_lookups(self, plan: Plan) -> None:
        """The plan's prefix lookups, in order, on a cache that orders eviction by them (SGLang's
        radix tree); without a list from the policy, each admission's own lookup."""
        kv = self.kv
        if plan.touch is not None:
            kv.touch_all(plan.touch)
        else:
            for s, n in plan.items:
                if s.status is _WAITING:
                    kv.touch(s, s.known_len - n)

    def _acquire_prefixes(self, plan: Plan) -> None:
        """Attach every admitted request's cached prefix before any of the plan's allocations."""
        kv = self.kv
        for s, n in plan.items:
            if s.status is _WAITING:
                s.num_computed = kv.acquire_prefix(s, s.known_len - n)
                s.prefix_hit_tokens += s.num_computed

    def extend_decode_run(self, batch: Batch, step_time, next_arrival: float, horizon: float,
                          allocate: bool = True, one_past=None) -> bool:
        """Turn a steady all-decode batch into a run of identical decode steps.

        When every running request decodes, nothing was admitted or preempted, and the
        policy says its plan would not change until something arrives or finishes
        (`is_steady`), the next plans are known: the same requests, one token each, with
        contexts one longer per step. The run covers the steps that start before the next
        arrival, end before the horizon, end no later than the first finish, and whose
        KV growth fits in the free blocks, and that the policy's optional `steady_steps(view,
        ends)` keeps (the leading steps its plan stays the same for, given the end time of
        each: step i + 1 starts at ends[i - 1]), so every token time, ITL and KV outcome equals
        what step-by-step planning would give. Step end times are summed one step at a
        time, as the clock would. Returns False (a plain step) when there is no run.
        `allocate=False` checks that the run's KV growth fits but leaves taking the blocks to
        the caller (testbed/sim/decode_runs.py takes them as the steps are reached).
        `one_past(start, end)`: the backend holds an arrival back until after the next plan (vLLM's async
        scheduling), so the step that starts after the arrival is planned without it, the same plan
        again; where a run stops at an arrival, it takes that step too when `one_past` says nothing else
        reaches the loop at the step's start or end (the backend then delivers the held arrivals as at its start).
        """
        items = batch.items
        if (self.drafter is not None or not self._steady or self._is_steady is None or len(items) != len(self.running)
                or batch.shape.num_prefill_seqs or not self._is_steady(self.view)):
            return False
        k_max = min([s.req.output_len - s.num_generated for s, _ in items])
        if k_max < 2:
            return False
        if self._cost_step is not None and step_time == self._cost_step:
            ends = self._run_ends(batch.shape, batch.start, k_max, next_arrival, horizon)
        else:
            ends = decode_run_ends(step_time, batch.shape, batch.start, k_max, next_arrival, horizon)
        if self._steady_steps is not None and len(ends) > 1:  # the policy's plan may change within the run
            del ends[max(1, self._steady_steps(self.view, ends)):]
        folded = False
        if (self._steady_steps is None and one_past is not None and allocate and 1 <= len(ends) < k_max
                and ends[-1] > next_arrival and not batch.shape.swap_blocks and not batch.shape.load_blocks
                and batch.start + (ends[-1] - batch.start) == ends[-1]):  # the run without it is one
            more = self._one_past(batch, step_time, ends, horizon, one_past)
            if more is not None:
                ends, folded = more, True
        k = len(ends)
        # the clock adds the run's length to now: stay bit-exact
        if k < 2 or batch.start + (ends[-1] - batch.start) != ends[-1]:
            return False
        lag = 1 if self.async_scheduling and self.models_async else 0
        if folded:  # the run that stopped at the arrival, then the plan after it
            if k > 2 and not self.kv.grow_decode_run([s for s, _ in items], k - 1, lag):
                raise AssertionError("a folded run's KV growth was checked to fit")
            self._apply_held_step(items, k - 1, lag == 1)
        elif allocate:  # async: the run's last token is not back when the next step is scheduled (`in_flight`)
            if not self.kv.grow_decode_run([s for s, _ in items], k, lag):
                return False
        else:  # only the check of `grow_decode_run`
            bs = self.kv.block_size
            if sum([max(0, -(-(s.num_computed + k) // bs) - len(s.blocks)) for s, _ in items]) > self.kv.num_free_blocks:
                return False
        batch.ends = ends
        self.series.steps[-1] = k
        return True

    def _one_past(self, batch: Batch, step_time, ends: list[float], horizon: float, one_past) -> list[float] | None:
        """`ends` and the step that starts at its last end, where its KV growth fits, the clock lands on its
        end both from the run's start and from its own (as a plain step's would), and `one_past` allows
        it (asked last: the backend takes its answer as the run's)."""
        if not self.async_scheduling:
            return None  # nothing is held back: the step after the arrival sees it
        k = len(ends)
        bs = self.kv.block_size
        if sum([max(0, -(-(s.num_computed + k + 1) // bs) - len(s.blocks)) for s, _ in batch.items]) \
                > self.kv.num_free_blocks:
            return None
        # the step's time is step_time's at its contexts, as every decode_run_ends sums it (and the run summed
        # the steps before it): one call, not the run again
        shape = batch.shape
        ctx0 = shape.decode_kv_tokens
        shape.decode_kv_tokens = ctx0 + k * shape.num_decode_seqs
        try:
            dt = step_time(shape)
        finally:
            shape.decode_kv_tokens = ctx0
        start = ends[-1]
        end = start + dt
        if (end >= horizon or start + (end - start) != end or batch.start + (end - batch.start) != end
                or not one_past(start, end)):
            return None
        return ends + [end]

    def _apply_held_step(self, items: list[tuple[RequestState, int]], k: int, lagging: bool) -> None:
        """The KV calls of the plan after a run of `k` steps (the same decode items), made now, in the order
        that plan makes them: `_apply`'s allocations and registrations, then (`lagging`: vLLM's async rule,
        every item's last token in flight) `_cache_landed`'s, in the order of the set `_complete_run` fills.
        Nothing reaches this loop's cache between the two (one replica; the arrivals are held), so the
        blocks come out the same."""
        kv = self.kv
        bs = kv.block_size
        cache_decode = kv.cache_decode
        for s, _ in items:  # the state the run leaves
            s.num_computed += k
            s.num_generated += k
        try:
            in_flight: set[RequestState] | None = None
            if cache_decode and lagging:
                in_flight = set()
                in_flight.update(s for s, _ in items)
            for s, _ in items:
                upto = s.num_computed + 1
                if upto > len(s.blocks) * bs:
                    kv.allocate(s, 1)
                if upto // bs > s.num_cached_blocks and (cache_decode or s.is_prefill):
                    if in_flight is not None:  # every item sampled in the run's last step
                        last = min(upto, s.req.prompt_len + s.num_generated - 1)
                        if last // bs > s.num_cached_blocks:  # else nothing new: register would return at once
                            kv.register(s, last)
                    elif cache_decode:
                        kv.register(s, upto)
                    else:
                        self._register_at_completion.append((s, upto))
            if in_flight is not None:
                for s in in_flight:
                    if s.blocks and s.num_computed // bs > s.num_cached_blocks:
                        kv.register(s, s.num_computed)
        finally:
            for s, _ in items:
                s.num_computed -= k
                s.num_generated -= k

    def complete(self, batch: Batch, now: float) -> None:
        """Advance every request in the batch by its tokens; sample, stamp, finish."""
        self.series.duration.append(now - batch.start)
        self.num_steps += len(batch.ends) if batch.ends is not None else 1
        if self._register_at_completion:
            for s, upto in self._register_at_completion:
                if s.status is _RUNNING:
                    self.kv.register(s, upto)
            self._register_at_completion = []
        if batch.ends is not None:
            self._complete_run(batch)
            return
        if batch.drafts is not None:
            self._complete_verify(batch, now)
            return
        append = self.itl.append
        any_finished = False
        in_flight = self._next_in_flight()
        for s, n in batch.items:
            computed = s.num_computed + n
            s.num_computed = computed
            req = s.req
            generated = s.num_generated
            if computed == req.prompt_len + generated:
                if in_flight is not None:
                    in_flight.add(s)
                # record_token(s, now, self.itl), inlined: once per request per step
                generated += 1
                s.num_generated = generated
                if s.first_token_time < 0:
                    s.first_token_time = now
                else:
                    append(now - s.last_token_time)
                s.last_token_time = now
                if s.token_times is not None:
                    s.token_times.append(now)
                if generated >= req.output_len:
                    self._finish(s, now)
                    any_finished = True
        if any_finished:
            self._after_finish(batch, now)

    def _complete_verify(self, batch: Batch, now: float) -> None:
        """A step whose decodes verified drafts: each emits its accepted drafts and one sampled token,
        all stamped at the step's end (inter-token gaps of 0 within a step, as vLLM streams them in
        one output); only their KV counts as computed (vLLM rolls back the rejected ones)."""
        itl, drafter = self.itl, self.drafter
        any_finished = False
        in_flight = self._next_in_flight()
        for (s, n), k in zip(batch.items, batch.drafts):
            emitted = 1 + drafter.accepted(s, k) if k else 1
            s.num_computed += n + emitted - 1
            if s.num_computed == s.req.prompt_len + s.num_generated + emitted - 1:
                if in_flight is not None:
                    in_flight.add(s)
                for _ in range(emitted):
                    record_token(s, now, itl)
                if s.num_generated >= s.req.output_len:
                    self._finish(s, now)
                    any_finished = True
        if any_finished:
            self._after_finish(batch, now)

    def _complete_run(self, batch: Batch) -> None:
        ends = batch.ends
        k = len(ends)
        gaps = array("d", [ends[i] - ends[i - 1] for i in range(1, k)])  # copied into `itl` once per request
        first, end = ends[0], ends[-1]
        append, extend = self.itl.append, self.itl.extend  # once per request per run
        any_finished = False
        in_flight = self._next_in_flight()
        if in_flight is not None:
            in_flight.update(s for s, _ in batch.items)
        for s, _ in batch.items:
            append(first - s.last_token_time)
            extend(gaps)
            if s.token_times is not None:
                s.token_times.extend(ends)
            s.num_computed += k
            s.num_generated += k
            s.last_token_time = end
            if s.num_generated >= s.req.output_len:
                self._finish(s, end)
                any_finished = True
        if any_finished:
            self._after_finish(batch, end)

    def _finish(self, s: RequestState, now: float) -> None:
        if self.async_scheduling and self.models_async and not self.hold_finished_kv:
            self.finishing.append(s)  # its seat and blocks are held until after the next schedule
        elif not self.hold_finished_kv:
            self.kv.free(s, finished=True)
        if self.drafter is not None:
            self.drafter.forget(s)
        s.status = Status.FINISHED
        s.finish_time = now
        del self.live[s.req.id]

    def _after_finish(self, batch: Batch, now: float) -> None:
        if self.finishing:
            if not self.live:  # nothing else to schedule: vLLM's next schedule is empty and the outputs free them
                if self.in_flight:
                    self._cache_landed()
                self._free_finishing()
            # else they keep their place in the running set, skipped by the next schedule
        else:
            self.running = [s for s in self.running if s.status is _RUNNING]
        if self._on_finish is not None:
            self.view.now = now
            for s, _ in batch.items:
                if s.status is Status.FINISHED and s.finish_time == now:
                    self._on_finish(s, self.view)

    def _next_in_flight(self) -> set[RequestState] | None:
        """A fresh set for the requests the completing step samples for, under vLLM's async scheduling; None
        otherwise. Their blocks up to the token before the sampled one are cached when the next step is
        scheduled (vLLM's allocate_slots caps what it caches at the tokens known, `request.num_tokens`:
        kv_cache_manager.py L612-616 of 0.32); the block the sampled token's own KV completes only when this
        step's outputs come back, after that schedule (AsyncScheduler._update_request_with_output caches
        num_computed_tokens - num_output_placeholders, async_scheduler.py L70-75), and never if that schedule
        preempted the request."""
        if self.async_scheduling and self.models_async and self.kv.cache_decode:
            self.in_flight = set()
            return self.in_flight
        return None

    def _cache_landed(self) -> None:
        """The last step's outputs are back (after the schedule that followed it): each request that sampled
        in it and was not preempted by that schedule caches the blocks its computed tokens fill."""
        kv = self.kv
        bs = kv.block_size
        for s in self.in_flight:  # the block test first: most fail it (a preempted one, holding none, too)
            if s.num_computed // bs > s.num_cached_blocks and s.blocks and (
                    s.status is _RUNNING or s.status is _FINISHED):
                kv.register(s, s.num_computed)
        self.in_flight = None  # the next step's completion makes its own

    def _free_finishing(self) -> None:
        """Free the requests that finished in the step before, in the order of its outputs (vLLM's
        update_from_output frees each finished request as it reaches it), and drop them from the running set."""
        free = self.kv.free
        for s in self.finishing:
            free(s, finished=True)
        self.finishing = []
        self.running = [s for s in self.running if s.status is _RUNNING]

    # --- helpers ------------------------------------------------------------------------
    def _plainly_valid(self, items: list) -> bool:
        """True when a plan with no preemptions keeps every rule of `_validate`: its checks, in one
        cheap pass (this runs every step). False sends the plan to `_validate`, which names the first
        rule broken, so a bad plan fails exactly as it always did. (`items` is left untyped: a policy's
        bad token count, 2.0, must reach the check, not fail the compiled build's type check.)"""
        if len(items) > self.limits.max_num_seqs:
            return False
        get = self.live.get
        total = 0
        for s, n in items:
            req = s.req
            if get(req.id) is not s or type(n) is not int or n < 1:
                return False
            known = req.prompt_len + s.num_generated
            if n > (known - s.num_computed if (s.blocks or s.status is _SWAPPED) else known):
                return False
            total += n
        return total <= self.limits.max_num_batched_tokens and len(set(map(_state_of, items))) == len(items)

    def _validate(self, plan: Plan) -> None:
        name, live = self.policy_name, self.live
        preempted = set()
        for s, mode in plan.preempt:
            finishing = s.status is _FINISHED and s in self.finishing  # still in vLLM's running set
            if not finishing and (live.get(s.req.id) is not s or s.status is not _RUNNING):
                raise PlanError(name, "preempt-not-running",
                                f"request {s.req.id} is {s.status.value}, only running requests can be preempted")
            if mode not in PREEMPT_MODES:
                raise PlanError(name, "preempt-mode", f"request {s.req.id}: mode {mode!r}, expected one of {PREEMPT_MODES}")
            if s in preempted:
                raise PlanError(name, "duplicate", f"request {s.req.id} is preempted twice")
            preempted.add(s)
        # token counts typed `object`: a policy's bad count (2.0) must reach the check below, not
        # fail the compiled build's (setup.py) type check of the items as a TypeError
        items: list[tuple[RequestState, object]] = plan.items
        if len(items) > self.limits.max_num_seqs:
            raise PlanError(name, "max-num-seqs",
                            f"{len(items)} requests scheduled, scheduler.max_num_seqs is {self.limits.max_num_seqs}")
        seen = set()
        total = 0
        for s, n in items:
            if live.get(s.req.id) is not s:
                raise PlanError(name, "unknown-request",
                                f"request {s.req.id} is not waiting or running here (status {s.status.value})")
            if s in seen:
                raise PlanError(name, "duplicate", f"request {s.req.id} is scheduled twice in one step")
            seen.add(s)
            if s in preempted:
                raise PlanError(name, "preempt-and-schedule", f"request {s.req.id} is both preempted and scheduled")
            if type(n) is not int or n < 1:
                raise PlanError(name, "token-count", f"request {s.req.id}: {n!r} tokens; a step gives a request an int >= 1")
            # a waiting request may be given all its known tokens: `_apply` then takes less of its prefix hit
            avail = s.remaining if (s.blocks or s.status is _SWAPPED) else s.known_len
            if n > avail:
                what = "a decode token before its prefill completes" if s.num_generated == 0 or s.remaining > 1 else "more than one decode token"
                raise PlanError(name, "beyond-known-tokens",
                                f"request {s.req.id}: {n} tokens scheduled but only {avail} can be computed now "
                                f"({what}, or a chunk past the known sequence)")
            total += n
        if total > self.limits.max_num_batched_tokens:
            raise PlanError(name, "token-budget",
                            f"{total} tokens scheduled, scheduler.max_num_batched_tokens is {self.limits.max_num_batched_tokens}")

    def _guard_kv(self, op, s: RequestState, *args) -> int | None:
        try:
            return op(s, *args)
        except KVCapacityError as e:
            raise PlanError(self.policy_name, "kv-capacity", f"request {s.req.id}: {e}") from None

    def _preempt(self, s: RequestState, mode: str, shape: BatchShape) -> None:
        if s.status is _FINISHED:  # finished in the step before, its outputs not back yet (async scheduling):
            # vLLM preempts it as any running request, freeing its blocks now (_preempt_request), and its
            # last token still arrives with those outputs, finishing it (scheduler.py L795-848)
            self.kv.free(s, finished=True)
            s.num_preemptions += 1
            self.running.remove(s)
            self.finishing.remove(s)
            return
        if mode == RECOMPUTE:
            self.kv.free(s)
            s.num_computed = 0
            s.status = _WAITING
        else:
            shape.swap_blocks += self._guard_kv(self.kv.swap_out, s)
            s.status = _SWAPPED
        s.num_preemptions += 1
        self.running.remove(s)
        bisect.insort(self.waiting, s, key=_arrival_order)

    def _drop_admitted_from_waiting(self, admitted: int) -> None:
        w = self.waiting
        if all(w[i].status is _RUNNING for i in range(admitted)):
            del w[:admitted]  # the common FCFS case: the head of the queue was admitted
        else:
            self.waiting = [s for s in w if s.status is not _RUNNING]

    def shape_of(self, items: list[tuple[RequestState, int]]) -> BatchShape:
        """The batch features of planned items, as they stand before the step runs (with the drafts
        their decodes would verify, KV permitting)."""
        shape = BatchShape()
        self._add_to_shape(shape, items, predicting=True)
        if self.drafter is not None:
            budget = self.limits.max_num_batched_tokens - sum(n for _, n in items)
            self.drafter.predict(items, budget, (self._work_of(s, n, True)[0] for s, n in items), shape)
        if self._offload:
            kv = self.kv
            shape.load_blocks = sum(kv.loads_for(s, n) for s, n in items if s.status is _WAITING and not s.blocks)
        return shape

    def _add_to_shape(self, shape: BatchShape, items, predicting: bool = False) -> None:
        add_work(shape, (self._work_of(s, n, predicting) for s, n in items))

    def _work_of(self, s: RequestState, n: int, predicting: bool) -> tuple[int, int, bool]:
        """(offset, tokens, is_decode) of one planned item; a waiting request predicted at its prefix hit."""
        offset = s.num_computed
        if predicting and s.status is _WAITING and not s.blocks:
            offset = self.kv.match_prefix(s)
        return offset, n, n == 1 and s.num_generated > 0 and offset + 1 == s.req.prompt_len + s.num_generated

    # --- the end of a run -----------------------------------------------------------------
    def abandon(self, reason: str) -> None:
        """Stop: every live request stays unfinished with this reason (KV is released)."""
        for s in list(self.live.values()):
            if s.blocks:
                self.kv.free(s)
            s.reject_reason = reason
        for s in self.receiving.values():
            self.kv.free(s)
            s.reject_reason = f"{reason} (its KV still in transfer)"
        self.receiving.clear()
        self.live.clear()
        self.waiting = []
        self.running = []
        self._pending_swaps = (None, 0)
        self._preempted = 0
        self._register_at_completion = []


@dataclass
class ReplayOutcome:
    """What a backend hands back after replaying a trace: its loops and what never arrived."""

    loops: list[StepLoop]
    not_arrived: list[Request] = field(default_factory=list)  # arrivals after the horizon (or an interrupt)
    end_time: float = 0.0
    stalled: bool = False
    interrupted: bool = False
    not_arrived_reasons: dict[int, str] = field(default_factory=dict)  # id -> why, where not the run's reason


TOO_LONG = "too-long"  # the reason kind of a request longer than the context: the SLO check leaves it out


def reject_reason(req: Request, max_model_len: int, kv) -> str:
    """Why a request can never be served (longer than the context, or than the whole KV cache), or ''."""
    total = req.prompt_len + req.output_len
    if total > max_model_len:
        return (f"{TOO_LONG}: prompt {req.prompt_len} + output {req.output_len} = {total} tokens "
                f"> max_model_len {max_model_len}")
    need = kv.blocks_for(total)
    if need > kv.num_blocks:
        return f"exceeds-kv: needs {need} KV blocks, the cache has {kv.num_blocks}"
    return ""


def record_token(s: RequestState, now: float, itl: "array[float] | list[float]") -> None:
    """A request's next token came out at `now`: its TTFT or one more inter-token gap."""
    s.num_generated += 1
    if s.first_token_time < 0:
        s.first_token_time = now
    else:
        itl.append(now - s.last_token_time)
    s.last_token_time = now
    if s.token_times is not None:
        s.token_times.append(now)


def _hook(policy: Policy, name: str):
    """The policy's hook, or None where it has none or keeps BasePolicy's no-op (not worth a call
    per arrival or per finished request, nor a walk over the finishing step's items)."""
    hook = getattr(policy, name, None)
    return None if getattr(hook, "__func__", None) is getattr(BasePolicy, name) else hook


def _arrival_order(s: RequestState) -> tuple[float, int]:
    return (s.req.arrival, s.req.id)
