"""TensorRT-LLM's batch scheduler: a capacity scheduler, then the micro-batch scheduler.

Source: NVIDIA/TensorRT-LLM. Its release v1.2.1 is not in the index this was read from, so
these are the files at the commits the index holds (the rules cited are alike in every stored
version seen); `X:n` is a line of X at that commit:
- CAP = cpp/tensorrt_llm/batch_manager/capacityScheduler.cpp @02a10fed
- MBS = cpp/tensorrt_llm/batch_manager/microBatchScheduler.cpp @0a949d31
- SBM = cpp/tensorrt_llm/batch_manager/scheduledBlocksManager.cpp @ca64fd93
- KVM = cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp, `getRemainingBlocksToCompletion` and
  `getNeededBlocksOneStep` (by name: several stored versions, the same arithmetic)
- PYS = tensorrt_llm/_torch/pyexecutor/scheduler.py @034fffb0: the PyTorch backend (the default
  in 1.x) runs the C++ schedulers above through bindings (`SimpleScheduler` over
  `BindCapacityScheduler` and `BindMicroBatchScheduler`); the Python port
  (`SimpleUnifiedScheduler`) is opt-in (`TLLM_USE_PYTHON_SCHEDULER`, default off)
- PEC = tensorrt_llm/_torch/pyexecutor/py_executor_creator.py (chunk unit, chunking policy)
- ARGS = tensorrt_llm/llmapi/llm_args.py (defaults: see conf/policy/trtllm.yaml)

TensorRT-LLM keeps one list of active requests, in arrival order; a paused request returns to
the context phase and keeps its place. This policy rebuilds that list each step: running and
waiting requests by (arrival, id).

1. Capacity scheduler (`mode`; ARGS `SchedulerConfig.capacity_scheduler_policy`, default
   GUARANTEED_NO_EVICT); never more than `max_num_seqs` requests (CAP:367-370, 416-419, 551).
   - `guaranteed_no_evict` (`GuaranteedNoEvictScheduler::impl`, CAP:315-451): every request in
     the generation phase first, in list order, with no KV check, setting aside the blocks it
     still needs to finish (CAP:371-384); the others (context phase, chunked or not) wait for
     the second pass (CAP:389-392), which takes them in list order, each only if the blocks it
     needs to finish fit in what is left (CAP:422-432), and stops at the first that does not
     (CAP:441-445). "Blocks to finish" (SBM:34-51, KVM `getRemainingBlocksToCompletion`) is
     ceil((prompt + max new tokens) / block) less the blocks the request holds: a new request
     is charged its whole prompt and output, whatever part of its prompt is cached. The free
     blocks it starts from (SBM:28-32, `getNumFreeBlocksPerWindowSize`) count cached blocks no
     request holds. Nothing is ever paused.
   - `static_batch` (`StaticBatchScheduler`, CAP:184-190 -> impl<true>): the same, but the
     second pass runs only when no request is in the generation phase (CAP:397).
   - `max_utilization` (`MaxUtilizationScheduler::operator()`, CAP:460-544): the list in order,
     each request taken if the blocks of its next step fit with those taken so far
     (`trySchedulingRequestMaxUtilization`, CAP:546-578; SBM:65-86; KVM
     `getNeededBlocksOneStep`: a context request's first chunk is charged its whole prompt's
     blocks, a generation request its next token's). When one does not fit (or `max_num_seqs`
     is reached), the last *started* request (generation phase, or a context past its first
     chunk: CAP:480-484) from it to the end of the list is paused, its blocks given back, and
     the list cut there; the request is tried again (CAP:523-535). With no started request
     left, scheduling stops (CAP:536-539). A paused request is recomputed (`LlmRequest::pause`
     makes its output part of its prompt).
   With block reuse on (`kv.enable_prefix_caching`), a context request in its first chunk is
   skipped (a skip, not a stop) when the first block of its prompt not yet cached is one that a
   request taken earlier this step, or a chunked context already executing, will compute
   (`beneficialToSkip`, CAP:69-122 and 33-67; used at CAP:409-414 and 506-512): it waits a step
   to reuse that block.
2. Micro-batch scheduler (`MicroBatchScheduler::operator()`, MBS:185-329), on the capacity
   scheduler's requests in its order (generation first): a generation request takes one token,
   and the pass stops at the first that would exceed `max_num_tokens` (MBS:276-298); it also
   stops after `max_num_seqs` requests (MBS:300-303). Context and generation requests share a
   step.
   - `chunked_context: false` (ARGS `enable_chunked_prefill`, default False): a context request
     is charged its whole prompt (`getNumTokens`, whatever its prefix hit), and the pass stops at
     the first that does not fit in `max_num_tokens` (MBS:239-253).
   - `chunked_context: true`: context requests are set aside (MBS:255-274); if together they do
     not fit in what the generation requests left (MBS:306-309), they are chunked by
     `chunking_policy` (MBS:312-318; PEC: the chunk unit is `tokens_per_block`, the policy
     FIRST_COME_FIRST_SERVED unless set): `first_come_first_served` gives each, in order, what
     is left, rounded down to a whole number of blocks when cut, so a later prompt that fits
     whole still takes the remainder (MBS:131-158); `equal_progress` deals one block's worth of
     tokens to each in turn while any fits (MBS:98-129). A request given 0 tokens waits
     (MBS:320-329).
   A context chunk starts after the request's prefix hit (the loop's prefix match), but the
   budget is charged from its context position, as TensorRT-LLM sizes chunks before it looks
   the prefix up.

Not modeled: beam search, draft tokens, LoRA/PEFT pages, encoder-decoder (cross) KV, variable
window attention, disaggregated serving, attention DP, the overlap scheduler's two-step
lookahead, request priorities (the list here is FCFS), `max_context_length`, `trtllm-serve`'s
dynamic batch tuning, and the max output length: a request's `output_len` stands for its
`max_tokens`. TensorRT-LLM rejects a prompt longer than `max_num_tokens` when chunking is off
(llmapi/llm.py `_check_arguments`); a policy cannot reject, so such a prompt is prefilled here
in chunks of the budget left, and the pass stops after it. The loop allocates a chunked
prompt's blocks chunk by chunk, where TensorRT-LLM takes them all with the first chunk; under
`max_utilization` a context past its first chunk is charged here the blocks of its remaining
prompt (the ones TensorRT-LLM would already hold), so the decisions match unless decodes
earlier in the list take those blocks in between, in which case it is paused like any started
request.
"""
from __future__ import annotations

from dataclasses import dataclass

from testbed.policies._passes import arrival_order
from testbed.core.plan import RECOMPUTE, Plan
from testbed.core.policy import BasePolicy, PolicyKnobs, register
from testbed.core.request import Status

MODES = ("guaranteed_no_evict", "max_utilization", "static_batch")
CHUNKING = ("first_come_first_served", "equal_progress")


@dataclass
class TRTLLMKnobs(PolicyKnobs):
    name: str = "trtllm"
    mode: str = "guaranteed_no_evict"  # SchedulerConfig.capacity_scheduler_policy
    chunked_context: bool = False  # enable_chunked_prefill
    chunking_policy: str = "first_come_first_served"  # SchedulerConfig.context_chunking_policy

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in MODES:
            raise ValueError(f"policy.mode={self.mode!r}: expected one of {MODES}")
        if self.chunking_policy not in CHUNKING:
            raise ValueError(f"policy.chunking_policy={self.chunking_policy!r}: expected one of {CHUNKING}")



def _generating(s) -> bool:
    return s.status is Status.RUNNING and not s.is_prefill


def _context_left(s) -> int:
    """TensorRT-LLM's `getContextRemainingLength`: prompt (with any recomputed output) not yet
    computed, counted from the context position, so a prefix hit still counts."""
    return s.known_len - s.num_computed


def _blocks_to_finish(view, s) -> int:
    """KVM `getRemainingBlocksToCompletion`: blocks for prompt + max output, less those held."""
    return max(0, -(-s.req.total_len // view.block_size) - len(s.blocks))


@register
class TRTLLMPolicy(BasePolicy):
    name = "trtllm"
    Knobs = TRTLLMKnobs

    def is_steady(self, view) -> bool:
        """No-evict admission compares free blocks with what running requests still need:
        decodes lower both alike, so the verdict holds until an arrival or a finish. Max
        utilization only pauses on a shortage, and the loop checks that the run's decodes fit."""
        return self.knobs.mode != "max_utilization" or not view.waiting

    # --- capacity scheduler ----------------------------------------------------------------
    def _skip(self, view):
        """CAP `beneficialToSkip`: a first-chunk context request waits when the first block of
        its prompt not yet cached is one an earlier request this step will compute."""
        if not view.waiting:
            return None
        if not view.prefix_caching:
            return None
        bs = view.block_size
        contributed: set[int] = set()
        for s in view.running:  # chunked contexts already executing (CAP:33-67)
            if s.is_prefill and s.num_computed:
                keys = view.block_keys(s)
                j = s.num_computed // bs
                if j < len(keys):
                    contributed.add(keys[j])

        def skip(s) -> bool:
            if s.status is not Status.WAITING:
                return False
            keys = view.block_keys(s)
            j = view.prefix_hit_tokens(s) // bs
            if j >= len(keys):
                return False  # all its shared blocks are cached; the rest is its own
            if keys[j] in contributed:
                return True
            contributed.add(keys[j])
            return False
        return skip

    def _no_evict(self, view, active) -> list:
        limit = view.max_num_seqs
        skip = self._skip(view)
        fitting, pending = [], []
        avail = view.free_blocks
        for s in active:
            if len(fitting) >= limit:
                break
            if _generating(s):
                fitting.append(s)
                avail -= _blocks_to_finish(view, s)
            else:
                pending.append(s)
        if self.knobs.mode == "static_batch" and fitting:
            return fitting
        for s in pending:
            if skip is not None and skip(s):
                continue
            if len(fitting) >= limit:
                break
            need = _blocks_to_finish(view, s)
            if need > avail:
                break
            fitting.append(s)
            avail -= need
        return fitting

    def _max_utilization(self, view, active, plan) -> list:
        limit, bs = view.max_num_seqs, view.block_size
        skip = self._skip(view)
        fitting = []
        taken, free = 0, view.free_blocks
        end, i = len(active), 0
        while i < end:
            s = active[i]
            if skip is not None and skip(s):
                i += 1
                continue
            if len(fitting) < limit:
                if s.status is Status.WAITING:  # first context chunk: the whole prompt's blocks
                    need = -(-s.known_len // bs)
                elif _generating(s):
                    need = view.blocks_needed(s, 1)
                else:  # a context past its first chunk: the rest of its prompt's blocks
                    need = view.blocks_needed(s, _context_left(s))
                if taken + need <= free:
                    fitting.append(s)
                    taken += need
                    i += 1
                    continue
            j = end - 1
            while j >= i and active[j].status is not Status.RUNNING:
                j -= 1
            if j < i:
                break  # nothing started left to pause
            plan.preempt_request(active[j], RECOMPUTE)
            free += view.reclaimable_blocks(active[j])
            end = j
        return fitting

    # --- micro-batch scheduler ------------------------------------------------------------------
    def _chunks(self, contexts, capacity: int, unit: int) -> list[int]:
        left = [_context_left(s) for s in contexts]
        if self.knobs.chunking_policy == "first_come_first_served":
            sizes = []
            for want in left:
                n = min(want, capacity)
                if n != want:
                    n = n // unit * unit
                sizes.append(n)
                capacity -= n
            return sizes
        sizes = [0] * len(contexts)
        total, progress = 0, True
        while total < capacity and progress:
            progress = False
            for k, want in enumerate(left):
                n = min(sizes[k] + unit, want)
                if total + n - sizes[k] > capacity:
                    continue
                total += n - sizes[k]
                progress = progress or n > sizes[k]
                sizes[k] = n
        return sizes

    def schedule(self, view) -> Plan:
        plan = Plan()
        active = sorted(view.running + view.waiting, key=arrival_order)
        if self.knobs.mode == "max_utilization":
            fitting = self._max_utilization(view, active, plan)
        else:
            fitting = self._no_evict(view, active)
        budget, limit = view.token_budget, view.max_num_seqs
        tokens, count = 0, 0
        contexts = []
        for s in fitting:
            if _generating(s):
                if tokens + 1 > budget:
                    break
                plan.schedule(s, 1)
                tokens += 1
            elif self.knobs.chunked_context:
                contexts.append(s)
            else:
                want = _context_left(s)
                if tokens + want > budget:
                    if want > budget and budget - tokens > 0:  # TensorRT-LLM would have rejected it
                        plan.schedule(s, min(budget - tokens, view.num_new_tokens(s)))
                    break
                plan.schedule(s, view.num_new_tokens(s))
                tokens += want
            count += 1
            if count >= limit:
                break
        if contexts:
            capacity = budget - tokens
            if sum(_context_left(s) for s in contexts) > capacity:
                sizes = self._chunks(contexts, capacity, view.block_size)
            else:
                sizes = [_context_left(s) for s in contexts]
            for s, n in zip(contexts, sizes):
                if n > 0:
                    plan.schedule(s, min(n, view.num_new_tokens(s)))
        return plan
