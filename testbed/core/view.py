"""What a policy may see each step: one long-lived, read-only window onto the loop.

The view is created once per loop and reads the loop's live structures, so a step
costs nothing to "snapshot". Policies must treat `waiting` and `running` as read-only.
The helper methods answer the questions every KV-aware policy asks (how many tokens
does this request still need now, how many blocks would that take, how many would
preempting it give back) with the same arithmetic the loop will apply.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from testbed.core.cost import BatchShape, CostModel
from testbed.core.request import RequestState, Status

_RUNNING = Status.RUNNING

if TYPE_CHECKING:
    from testbed.core.kv import BlockManager, KVPreview
    from testbed.core.plan import Plan


class Limits(Protocol):
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int


class LoopState(Protocol):
    """What the view reads of the loop that builds it (`core/loop.py`'s `StepLoop`). Named here, not
    imported from there, so that the loop imports the view and the view nothing of the loop: no two
    files import each other, not even for an annotation."""

    kv: "BlockManager"
    limits: Limits
    waiting: list[RequestState]
    running: list[RequestState]
    num_steps: int
    cost_model: CostModel | None

    def shape_of(self, items: list[tuple[RequestState, int]]) -> BatchShape: ...


class SchedulerView:
    __slots__ = ("_loop", "_kv", "now")

    def __init__(self, loop: LoopState):
        self._loop = loop
        self._kv = loop.kv
        self.now = 0.0

    def close(self) -> None:
        """The loop's run is over: let go of it. The loop holds its view and the view its loop, a cycle
        that kept every request state of a finished run alive until the cyclic GC found it: 28 calibration
        replays in one process (as a `testbed-validate` fit's worker runs them) spent 7.6-8.5 s in the GC
        with the cycle, 3.0-3.5 s without (two runs each)."""
        del self._loop

    # --- queues -----------------------------------------------------------------------
    @property
    def waiting(self) -> list[RequestState]:
        """Arrived requests holding no device KV (new, recompute-preempted, swapped), by arrival."""
        return self._loop.waiting

    @property
    def running(self) -> list[RequestState]:
        """Requests holding device KV, in admission order (the last admitted is last)."""
        return self._loop.running

    @property
    def steps_done(self) -> int:
        """Engine steps completed so far: lets a policy that counts steps (SGLang's ratio decay)
        stay exact when the simulator fast-forwards a run of decode steps."""
        return self._loop.num_steps

    # --- limits -----------------------------------------------------------------------
    @property
    def token_budget(self) -> int:
        return self._loop.limits.max_num_batched_tokens

    @property
    def max_num_seqs(self) -> int:
        return self._loop.limits.max_num_seqs

    @property
    def max_model_len(self) -> int:
        return self._loop.limits.max_model_len

    @property
    def block_size(self) -> int:
        return self._kv.block_size

    @property
    def num_blocks(self) -> int:
        return self._kv.num_blocks

    @property
    def prefix_caching(self) -> bool:
        """Whether the prefix cache is on (a cache-aware order has nothing to go on without it)."""
        return self._kv.enable_prefix_caching

    @property
    def free_blocks(self) -> int:
        return self._kv.num_free_blocks

    @property
    def free_host_blocks(self) -> int:
        return self._kv.num_free_host_blocks

    # --- per-request arithmetic ---------------------------------------------------------
    def prefix_hit_tokens(self, s: RequestState) -> int:
        """Prompt tokens of a waiting request already in the prefix cache (0 if it holds KV)."""
        if s.status is Status.WAITING and not s.blocks:
            return self._kv.match_prefix(s)
        return 0

    def prefix_hits(self, states: list[RequestState]) -> list[int]:
        """`prefix_hit_tokens` of each request, in one call (a cache-aware order asks it of its whole queue
        at every plan): a request that can hit nothing (`may_hit`: no shared prefix, never held a block) is
        not looked up."""
        kv, waiting = self._kv, Status.WAITING
        match, may_hit = kv.match_prefix, kv.may_hit
        return [match(s) if s.status is waiting and not s.blocks and may_hit(s) else 0 for s in states]

    def lookup_candidates(self, states: list[RequestState]) -> list[RequestState]:
        """The requests among `states` whose prefix lookup can match anything (`kv.may_hit`): one with no
        shared prefix that never held a block hits nothing, and its lookup stamps nothing."""
        return self._kv.may_hit_among(states)

    def block_keys(self, s: RequestState) -> tuple[int, ...]:
        """Content keys of the request's full blocks inside its trace's shared prefix: two
        requests' blocks at one index hold the same tokens when their keys are equal."""
        return self._kv.prefix_keys(s)

    def num_new_tokens(self, s: RequestState) -> int:
        """Tokens the request can compute now: the rest of its prefill, or 1 for a decode."""
        if s.status is Status.WAITING and not s.blocks:
            return s.known_len - self._kv.match_prefix(s)
        return s.remaining

    def blocks_needed(self, s: RequestState, num_tokens: int) -> int:
        """Free blocks that scheduling `num_tokens` of this request would consume."""
        if s.status is _RUNNING:  # kv.blocks_needed, inlined: policies ask this per request per step
            need = -(-(s.num_computed + num_tokens) // self._kv.block_size) - len(s.blocks)
            return need if need > 0 else 0
        if s.status is Status.SWAPPED:
            return self._kv.blocks_for(s.num_computed + num_tokens)
        return self._kv.admission_blocks(s, num_tokens)

    def kv_preview(self) -> "KVPreview":
        """A read-only preview of the cache that follows this step's plan as it is built, for
        admissions that must see the prefix blocks earlier items register (see KVPreview)."""
        return self._kv.preview()

    def reclaimable_blocks(self, s: RequestState) -> int:
        """Blocks that preempting this running request would return to the free pool."""
        return self._kv.num_exclusive_blocks(s)

    # --- cost model -------------------------------------------------------------------
    def shape_of(self, plan: "Plan") -> BatchShape:
        return self._loop.shape_of(plan.items)

    def predict_step_time(self, plan: "Plan") -> float:
        """The backend's cost model's prediction for this plan (the fitted one on the engine)."""
        cost = self._loop.cost_model
        if cost is None:
            raise RuntimeError("this loop has no cost model to predict step times with")
        return cost.step_time(self.shape_of(plan))
