"""vLLM's own scheduler on the simulator's clock: `policy=vllm_native`.

A researcher who patches vLLM's scheduler wants to simulate the patch, and a model of vLLM's
rules (the `vllm` policy) is only trusted where it has been compared with vLLM's own code. Here
the decisions are vLLM's: the installed vLLM's V1 `Scheduler` (or `AsyncScheduler`, or the class
named by `policy.scheduler_cls`, vLLM's own `--scheduler-cls`) is built without a model, as
upstream's scheduler tests build it (vllm tests/v1/core/utils.py::create_scheduler): a VllmConfig,
a KVCacheConfig of one full-attention group sized as the simulator sizes the cache, no worker.
Each request is added when it arrives; `schedule()` decides each step; the cost model prices
the step; at its end the step's output (one sampled token per request whose scheduled tokens
reach its known ones, none for a partial prefill chunk) goes back through vLLM's own
`update_from_output`, and a request finishes when vLLM says so.

The engine core's loop is followed as written (vLLM 0.32 vllm/v1/engine/core.py): synchronously
(`EngineCore.step`: schedule, execute, update) or, with `backend.async_scheduling`, with two
batches in flight (`step_with_batch_queue`, L698-800): a batch is scheduled while the previous
one runs, and that one's output is taken only once the queue is full or nothing else can be
scheduled. So every effect of async scheduling (arrivals seen a step later, a finished request
holding its seat and blocks through the next schedule, output placeholders) is vLLM's own. The
GPU runs one batch at a time: a batch scheduled while another runs starts when it ends.

Prefix caching: vLLM names a full block by a hash chained over its tokens (`hash_block_tokens`);
here each request gets a `block_hasher` (vLLM's `Request(block_hasher=...)` hook) that names its
blocks exactly as the testbed's BlockManager keys them: inside the trace's hashed prefix, block j
is `prefix_block_keys(req)[j]` (the chain of the trace's hash ids up to its last token and that
token's offset: testbed/core/kv.py), as 8 bytes; past it (the prompt's own tail, the outputs), a
key of this request and block index, so that only the request itself, resumed after a
preemption, can hit it. The prompt's token ids are all 0: nothing reads them.
"""
from __future__ import annotations

import os
import tempfile
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from testbed.core.bounds import bounded
from testbed.core.cost import BatchShape, add_work
from testbed.core.event_run import Stopped, run_until
from testbed.core.kv import prefix_block_keys
from testbed.core.loop import ReplayOutcome, record_token
from testbed.core.policy import PolicyKnobs
from testbed.core.request import Request, RequestState, Status
from testbed.vllm_backend import require_vllm
from testbed.vllm_backend.recording import StepDecision
from testbed.vllm_backend.replay import KVStats, VLLMRun

NATIVE_POLICY = "vllm_native"
SAMPLED_TOKEN = 1000  # the token id every sampling step "generates" (upstream's scheduler tests use 1000 too)
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class VLLMNativeKnobs(PolicyKnobs):
    """`policy=vllm_native`'s knobs: vLLM's own scheduler settings, named as the `vllm` policy names them."""

    name: str = NATIVE_POLICY
    chunked_prefill: bool = True  # vLLM's enable_chunked_prefill
    long_prefill_token_threshold: int = bounded(0, ge=0)  # 0 = no cap on one request's prefill chunk
    reserve_full_isl: bool = True  # vLLM's scheduler_reserve_full_isl
    scheduling_policy: str = "fcfs"  # vLLM's --scheduling-policy: fcfs or priority (the trace's priorities)
    # vLLM's --scheduler-cls: a class by its qualified name ("my_pkg.sched.MyScheduler"), a subclass or patched
    # copy of vllm.v1.core.sched.scheduler.Scheduler; null: vLLM's own (AsyncScheduler under async scheduling)
    scheduler_cls: Optional[str] = None

    def __post_init__(self):
        super().__post_init__()
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy.scheduling_policy={self.scheduling_policy!r}: expected one of "
                             f"{', '.join(SCHEDULING_POLICIES)} (vLLM's --scheduling-policy)")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"policy.long_prefill_token_threshold={self.long_prefill_token_threshold}: must be >= 0")


@dataclass
class NativeSettings:
    """What vLLM's scheduler is built from (the app fills it from scheduler.*, kv.* and the knobs)."""

    num_blocks: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    knobs: VLLMNativeKnobs = field(default_factory=VLLMNativeKnobs)


def _stand_in_model(max_model_len: int) -> str:
    """A folder with a tiny Llama config: vLLM's ModelConfig wants one, the scheduler reads only its context
    length (the real model's size is the cost model's business, and the KV cache's size is passed in)."""
    from transformers import LlamaConfig

    folder = tempfile.mkdtemp(prefix="vllm-native-config-")
    LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=32, vocab_size=2048,
                intermediate_size=128, max_position_embeddings=max_model_len).save_pretrained(folder)
    return folder


def build_scheduler(s: NativeSettings):
    """vLLM's scheduler with no model: the class vLLM itself would pick (`SchedulerConfig.get_scheduler_cls`)."""
    require_vllm(f"policy={NATIVE_POLICY}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    k = s.knobs
    model_config = ModelConfig(model=_stand_in_model(s.max_model_len), dtype="float32", seed=0,
                               skip_tokenizer_init=True, max_model_len=s.max_model_len)
    try:
        scheduler_config = SchedulerConfig(
            max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=s.max_model_len, long_prefill_token_threshold=k.long_prefill_token_threshold,
            enable_chunked_prefill=k.chunked_prefill, scheduler_reserve_full_isl=k.reserve_full_isl,
            async_scheduling=s.async_scheduling, is_encoder_decoder=False, policy=k.scheduling_policy,
            scheduler_cls=k.scheduler_cls)
    except Exception as e:  # vLLM's own check of its settings, e.g. a budget under max_model_len without chunking
        raise ValueError(f"policy=vllm_native: vLLM refuses these scheduler settings: {e}") from None
    cache_config = CacheConfig(block_size=s.block_size, enable_prefix_caching=s.enable_prefix_caching)
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config)
    # on a CPU, vLLM's platform turns async scheduling off for its CPU executor (vllm/platforms/cpu.py L331 of
    # 0.32); no executor runs here, and the GPU engine being simulated has it on
    vllm_config.scheduler_config.async_scheduling = s.async_scheduling
    num_blocks = s.num_blocks + 1  # + vLLM's null block
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=s.block_size, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    cache_config.num_gpu_blocks = num_blocks
    try:
        cls = vllm_config.scheduler_config.get_scheduler_cls()
    except Exception as e:
        raise ValueError(f"policy.scheduler_cls={k.scheduler_cls!r}: vLLM cannot load it ({e}); name a class "
                         "by its qualified name, e.g. my_package.my_module.MyScheduler") from None
    sched = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                structured_output_manager=StructuredOutputManager(vllm_config),
                block_size=s.block_size, hash_block_size=s.block_size, log_stats=False)
    # what the scheduler runs with: vLLM's config post-init must not have changed a setting asked for
    sc = sched.scheduler_config
    ran = {"max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
           "long_prefill_token_threshold": sc.long_prefill_token_threshold,
           "enable_chunked_prefill": sc.enable_chunked_prefill, "async_scheduling": bool(sc.async_scheduling),
           "num_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks()}
    asked = {"max_num_batched_tokens": s.max_num_batched_tokens, "max_num_seqs": s.max_num_seqs,
             "long_prefill_token_threshold": k.long_prefill_token_threshold,
             "enable_chunked_prefill": k.chunked_prefill, "async_scheduling": s.async_scheduling,
             "num_blocks": s.num_blocks}
    changed = {key: (asked[key], ran[key]) for key in asked if asked[key] != ran[key]}
    if changed:
        raise ValueError("policy=vllm_native: vLLM's config changed settings it was given (asked, got): "
                         + ", ".join(f"{key} {a!r} -> {g!r}" for key, (a, g) in changed.items()))
    return sched


def block_hasher(req: Request, block_size: int):
    """vLLM's per-request block hasher naming its blocks as the testbed's BlockManager keys them."""
    from vllm.v1.core.kv_cache_utils import BlockHash

    shared = [BlockHash(key.to_bytes(8, "little", signed=True)) for key in prefix_block_keys(req, block_size)]
    own = req.id.to_bytes(8, "little", signed=True)

    def hashes(request) -> list:
        start, end = len(request.block_hashes), request.num_tokens // block_size
        return [shared[j] if j < len(shared) else BlockHash(own + j.to_bytes(4, "little")) for j in range(start, end)]

    return hashes


class NativeSimulation:
    """One replica whose scheduler is vLLM's, on a SimPy clock; the run ends as the other backends'
    do, in RequestStates and a StepSeries (`VLLMRun`), so `finish()` writes the same files.

    `on_step(decision)` (the referee's) sees each scheduled step as a `StepDecision` in trace ids: what
    vLLM decided, when the step ran, and how many requests had been handed to vLLM before it was
    scheduled; `delivered` lists (time, request) in the order they were handed over."""

    def __init__(self, requests: Sequence[Request], settings: NativeSettings, step_time: Callable[[BatchShape], float],
                 horizon_s: float | None = None, record_token_times: bool = False,
                 on_step: Callable[[StepDecision], None] | None = None, progress: Callable[[float, int], None] | None = None):
        if horizon_s is not None and horizon_s <= 0:
            raise ValueError(f"backend.horizon_s={horizon_s}: must be > 0 (or null for no horizon)")
        self.requests, self.settings, self.step_time = requests, settings, step_time
        self.horizon_s, self.record_token_times = horizon_s, record_token_times
        self.on_step, self.progress = on_step, progress
        self.sched = build_scheduler(settings)
        self.depth = 2 if settings.async_scheduling else 1  # EngineCore's batch_queue_size
        self.run_record = VLLMRun(KVStats(settings.num_blocks, settings.block_size))
        self.live: dict[str, RequestState] = {}
        self.delivered: list[tuple[float, Request]] = []
        self._idle = None
        self._arrivals_done = False
        self.stalled = False

    # --- vLLM's side -------------------------------------------------------------------------
    def _add(self, req: Request, now: float) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request as VRequest

        self.delivered.append((now, req))
        s = self.run_record.arrive(req, now, self.settings.max_model_len, self.record_token_times)
        if s.status is Status.REJECTED:
            return
        rid = str(req.id)
        self.live[rid] = s
        self.sched.add_request(VRequest(
            request_id=rid, prompt_token_ids=[0] * req.prompt_len,
            sampling_params=SamplingParams(max_tokens=req.output_len, ignore_eos=True), pooling_params=None,
            arrival_time=now, priority=req.priority, block_hasher=block_hasher(req, self.settings.block_size)))

    def _schedule(self, now: float, gpu_free: float):
        """vLLM's schedule(), recorded: the step row, each request's admission, preemption and prefix hit,
        the batch's shape; returns (output, the model's sampled tokens for it, when the step ends)."""
        sched, live, kv = self.sched, self.live, self.run_record.kv
        out = sched.schedule()
        tokens = out.num_scheduled_tokens
        preempted = out.preempted_req_ids or ()
        for rid in preempted:
            s = live[rid]
            s.num_preemptions += 1
            s.status = Status.WAITING
        admitted = [d.req_id for d in out.scheduled_new_reqs]
        admitted += out.scheduled_cached_reqs.resumed_req_ids
        requests = sched.requests
        for rid in admitted:
            r, s = requests[rid], live[rid]
            hit = r.num_computed_tokens - tokens[rid]
            s.status = Status.RUNNING
            s.prefix_hit_tokens += hit
            kv.hit_tokens += hit
            kv.queried_tokens += r.num_tokens
        sampled, work = [], []
        for rid, n in tokens.items():
            r = requests[rid]
            after = r.num_computed_tokens  # _update_after_schedule advanced it by n
            full = after >= r.num_tokens  # not a partial prefill chunk: the step samples a token
            sampled.append([SAMPLED_TOKEN] if full else [])
            work.append((after - n, n, n == 1 and full and after - n >= r.num_prompt_tokens))  # (offset, n, decode)
        shape = BatchShape()
        add_work(shape, work)  # the simulator's rule for a batch's features (testbed/core/cost.py)
        start = max(now, gpu_free)
        end = start + self.step_time(shape) if tokens else start
        for rid in admitted:
            s = live[rid]
            if s.first_scheduled < 0:
                s.first_scheduled = start
        if tokens or preempted:
            series = self.run_record.series
            series.start.append(start)
            series.duration.append(end - start)
            series.prefill_tokens.append(shape.num_prefill_tokens)
            series.decode_tokens.append(shape.num_decode_seqs)
            series.running.append(len(sched.running))
            series.waiting.append(len(sched.waiting))
            pool = sched.kv_cache_manager.block_pool
            series.kv_used_blocks.append(pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
            series.preemptions.append(len(preempted))
            series.steps.append(1)
            if self.on_step is not None:
                self.on_step(StepDecision(start, end, {live[rid].req.id: n for rid, n in tokens.items()},
                                          [live[rid].req.id for rid in preempted], len(self.delivered)))
        return out, list(tokens), sampled, end

    def _update(self, out, ids: list[str], sampled: list[list[int]], now: float) -> None:
        """The step's output through vLLM's update_from_output; its token and finish events onto the states."""
        from vllm.v1.outputs import ModelRunnerOutput

        result = self.sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)}, sampled_token_ids=sampled,
            logprobs=None, prompt_logprobs_dict={}, pooler_output=[]))
        live, itl = self.live, self.run_record.itl
        for outputs in result.values():
            for o in outputs.outputs:
                s = live.get(o.request_id)
                if s is None:
                    continue
                for _ in o.new_token_ids:
                    record_token(s, now, itl)
                if o.finish_reason is not None:
                    s.status, s.finish_time = Status.FINISHED, now
                    del live[o.request_id]

    # --- the processes ----------------------------------------------------------------------
    def run(self, stop: Callable[[], bool] | None = None) -> ReplayOutcome:
        import simpy

        self._stop = stop or (lambda: False)
        self.env = env = simpy.Environment()
        env.process(self._arrivals())
        env.process(self._engine())
        interrupted = run_until(env, self.horizon_s)
        reason = "interrupted" if interrupted else "stalled" if self.stalled else "unfinished at the horizon"
        for s in self.live.values():
            s.reject_reason = reason
        self.live.clear()
        not_arrived = list(self.requests[len(self.delivered):])
        return ReplayOutcome([self.run_record], not_arrived, env.now, self.stalled, interrupted)

    def _check_stop(self) -> None:
        if self._stop():
            raise Stopped

    def _arrivals(self):
        env = self.env
        for i, req in enumerate(self.requests):
            if req.arrival > env.now:
                yield env.timeout(req.arrival - env.now)
            self._check_stop()
            self._add(req, env.now)
            if self.progress is not None and not (i + 1) & 1023:
                self.progress(env.now, i + 1)
            self._wake()
        self._arrivals_done = True
        self._wake()

    def _wake(self) -> None:
        if self._idle is not None:
            ev, self._idle = self._idle, None
            ev.succeed()

    def _engine(self):
        """EngineCore's busy loop: `step` (depth 1) or `step_with_batch_queue` (depth 2), vllm/v1/engine/core.py."""
        env, sched, depth = self.env, self.sched, self.depth
        queue: deque = deque()
        gpu_free = 0.0
        while True:
            self._check_stop()
            if sched.has_requests() and len(queue) < depth:
                out, ids, sampled, end = self._call(self._schedule, env.now, gpu_free)
                queue.appendleft((out, ids, sampled, end))
                if ids:
                    gpu_free = end
                elif len(queue) == 1:  # nothing scheduled, nothing in flight: only an arrival changes anything
                    queue.pop()
                    self.sched.update_from_output(out, _empty_output())
                    if not (yield from self._wait_for_arrival()):
                        return
                    continue
                if len(queue) < depth and (ids or sched.has_requests()):
                    continue  # fill the batch queue before blocking on the oldest batch (core.py L754-759)
            elif not queue:
                if not (yield from self._wait_for_arrival()):
                    return
                continue
            out, ids, sampled, end = queue.pop()
            if end > env.now:
                yield env.timeout(end - env.now)
            self._call(self._update, out, ids, sampled, env.now)

    def _call(self, method, *args):
        """`method` (which calls vLLM's schedule() or update_from_output()); a failure inside names the scheduler
        class, the call and the simulated time (a patched scheduler's bug must not surface as a bare error)."""
        try:
            return method(*args)
        except Exception as e:
            call = "schedule()" if method == self._schedule else "update_from_output()"
            raise RuntimeError(f"policy={NATIVE_POLICY}: vLLM's scheduler {type(self.sched).__name__} failed in {call} "
                               f"at simulated time {self.env.now:.6f} s: {type(e).__name__}: {e}") from e

    def _wait_for_arrival(self):
        """Idle until the next arrival; False when none will come (a stall, if work is left)."""
        if self._arrivals_done:
            if self.live:
                self.stalled = True
            return False
        self._idle = self.env.event()
        yield self._idle
        return True


def _empty_output():
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=[])
