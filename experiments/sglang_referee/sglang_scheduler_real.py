"""Drive SGLang 0.5.23's REAL scheduling code step by step, with no model.

Run:  /work/venv-sglang/bin/python experiments/sglang_referee/sglang_scheduler_real.py --scenario NAME
(see README.md for the venv).  Paths below are inside the sglang-0.5.23 wheel
(sglang/srt/...).  The per-step sequence is Scheduler.get_next_batch_to_run
(managers/scheduler.py:3894) -> _get_new_batch_prefill_raw (4079, PrefillAdder,
SchedulePolicy.calc_priority, add_chunked_req, add_one_req, ScheduleBatch.init_new,
prepare_for_extend) or update_running_batch (4459, check_decode_mem,
retract_decode, NewTokenRatioTracker) -- executed as the real Scheduler methods,
bound to a thin harness object that holds only the attributes they read
(feature flags off).  The only re-implemented piece is the "model result"
step (see `_process_result`), which mirrors
scheduler_components/batch_result_processor.py:258-430 (prefill) and 952-1040
(decode) for plain requests: append a fixed token, Req.update_finish_state,
release_kv_cache / checkpoint_kv_cache (mem_cache/common.py:271,400).
"""
import argparse
import json
import os
import sys
import types
from array import array

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bootstrap  # noqa: E402,F401  (must precede any sglang import)

import torch  # noqa: E402

from sglang.srt.runtime_context import get_context, get_schedule  # noqa: E402

BOUND = set()
DECODE_TOKEN = 7  # token id appended by every decode step

SCENARIOS = {
    # KV pressure: 3 requests whose decode outgrows the pool -> retract_decode.
    # (admission reserves new_token_ratio*max_new = 0.7*100 per request; both
    # then really grow to 110 tokens > 200/2)
    "retract": dict(pool_tokens=200, page_size=1, chunked_prefill_size=64,
                    max_prefill_tokens=64, policy="fcfs", max_running=8,
                    reqs=[(0, list(range(100, 110)), 100), (0, list(range(200, 210)), 100),
                          (0, list(range(300, 310)), 100)]),
    # One long prompt split by chunked prefill; a short one arrives meanwhile.
    "chunked": dict(pool_tokens=1024, page_size=1, chunked_prefill_size=64,
                    max_prefill_tokens=64, policy="fcfs", max_running=8,
                    reqs=[(0, list(range(1000, 1200)), 4), (1, list(range(2000, 2010)), 4)]),
    # lpm ordering: a warm-up request caches a prefix; later arrivals that share
    # it are admitted first under lpm.
    "lpm": dict(pool_tokens=1024, page_size=1, chunked_prefill_size=512,
                max_prefill_tokens=40, policy="lpm", max_running=8,
                reqs=[(0, list(range(500, 532)), 1),
                      (3, list(range(900, 930)), 2),
                      (3, list(range(500, 532)) + [1, 2, 3], 2),
                      (3, list(range(950, 980)), 2),
                      (3, list(range(500, 532)) + [4, 5], 2)]),
    # A request refused for KV (NO_TOKEN) and admitted once KV frees.
    "refused": dict(pool_tokens=128, page_size=1, chunked_prefill_size=256,
                    max_prefill_tokens=256, policy="fcfs", max_running=8,
                    reqs=[(0, list(range(100, 160)), 30), (1, list(range(300, 360)), 8)]),
}


def sglang_defaults():
    """The shipped defaults this driver reports (values read from the source)."""
    from sglang.srt.environ import envs
    return {
        "SGLANG_INIT_NEW_TOKEN_RATIO": envs.SGLANG_INIT_NEW_TOKEN_RATIO.get(),
        "SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR": envs.SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR.get(),
        "SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS": envs.SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS.get(),
        "SGLANG_RETRACT_DECODE_STEPS": envs.SGLANG_RETRACT_DECODE_STEPS.get(),
        "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": envs.SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION.get(),
        "schedule_conservativeness": get_schedule().schedule_conservativeness,
        "max_prefill_tokens": get_schedule().max_prefill_tokens,
        "schedule_policy": get_schedule().schedule_policy,
    }


class Harness:
    """Holds the Scheduler attributes the real methods below read."""

    from sglang.srt.managers.scheduler import Scheduler as _S
    get_next_batch_to_run = _S.get_next_batch_to_run
    get_new_batch_prefill = _S.get_new_batch_prefill
    _get_new_batch_prefill_raw = _S._get_new_batch_prefill_raw
    update_running_batch = _S.update_running_batch
    get_num_allocatable_reqs = _S.get_num_allocatable_reqs
    _add_request_to_queue = _S._add_request_to_queue
    del _S

    def __getattr__(self, name):
        # Any other Scheduler *method* the real code calls is the real one too,
        # bound to this harness (recorded in BOUND so the output can list them).
        from sglang.srt.managers.scheduler import Scheduler
        fn = getattr(Scheduler, name, None)
        if callable(fn) and not isinstance(fn, type):
            BOUND.add(name)
            return types.MethodType(fn, self)
        raise AttributeError(f"harness lacks Scheduler attribute {name!r}")


def build(sc):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import SchedulePolicy
    from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    ps = sc["page_size"]
    kv = MHATokenToKVPool(size=sc["pool_tokens"], page_size=ps, dtype=torch.float32, head_num=1,
                          head_dim=1, layer_num=1, device="cpu", enable_memory_saver=False)
    if ps == 1:
        alloc = TokenToKVPoolAllocator(sc["pool_tokens"], torch.float32, "cpu", kv, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(sc["pool_tokens"], ps, torch.float32, "cpu", kv, need_sort=False)
    r2t = ReqToTokenPool(size=sc["max_running"], max_context_len=4096, device="cpu",
                         enable_memory_saver=False)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=r2t,
                                      token_to_kv_pool_allocator=alloc, page_size=ps))
    h = Harness()
    h.__dict__.update(dict(
        waiting_queue=[], chunked_req=None, tree_cache=tree, token_to_kv_pool_allocator=alloc,
        req_to_token_pool=r2t, page_size=ps, max_prefill_tokens=sc["max_prefill_tokens"],
        chunked_prefill_size=sc["chunked_prefill_size"], max_running_requests=sc["max_running"],
        policy=SchedulePolicy(sc["policy"], tree, False, False, False),
        new_token_ratio_tracker=NewTokenRatioTracker.from_config(),
        running_batch=ScheduleBatch(reqs=[], batch_is_full=False),
    ))
    h.__dict__.update(_disabled_features())
    return h


class _Off:
    """A disabled scheduler component: identity for pass-through hooks."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def maybe_prepare_mlp_sync_batch(self, batch, need_sync=False):
        return batch

    def maybe_convert_decode_to_extend(self, batch):
        return batch

    def prepare_for_forward(self, batch, chunked_req=None):
        return batch

    def has_waiting_grammars(self):
        return False

    def pending_member_rows(self, batch):
        return 0

    def retire_group(self, req):
        pass

    def _get_num_pending_tokens(self, chunk_deduct=0):
        return 0


def _disabled_features():
    """Scheduler attributes for features this referee runs with OFF (their
    ServerArgs defaults): priority, LoRA, hicache, disaggregation, dLLM,
    speculative decoding, overlap, mixed chunk, prefill delayer, DP attention."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    return dict(
        enable_priority_scheduling=False, schedule_low_priority_values_first=False,
        abort_on_priority_when_disabled=False, enable_priority_preemption=False,
        priority_scheduling_preemption_threshold=10,
        disaggregation_mode=DisaggregationMode.NULL, max_queued_requests=None,
        processed_tokens_counter=0, dllm_config=None, enable_hisparse=False,
        is_hybrid_swa=False, min_free_slots_delayer=None, prefill_delayer=None,
        dynamic_chunk_sizer=None, is_mixed_chunk=False, enable_lora=False,
        enable_hicache_storage=False, enable_lmcache=False, enable_hierarchical_cache=False,
        enable_unified_cache_external_linker=False, truncation_align_size=None,
        enable_overlap=False, enable_overlap_mlx=False, spec_algorithm=SpeculativeAlgorithm.NONE,
        require_mlp_sync=False, decode_offload_manager=None, forward_ct=0,
        max_prefill_bs=10**9, model_config=types.SimpleNamespace(vocab_size=32000, is_encoder_decoder=False, is_multimodal=False, hf_config=None, context_len=4096, num_key_value_heads=1), hisparse_coordinator=None,
        dp_attn_adapter=_Off(), ngram_embedding_manager=_Off(), grammar_manager=_Off(),
        beam_coordinator=_Off(), load_inquirer=_Off(), metrics_reporter=_Off(num_retracted_reqs=0, enable_metrics=False),
        tp_worker=_Off(model_runner=_Off(attn_backend=_Off(), prefill_aware_swa=False)),
        enable_skip_finishing_decode=False, result_queue=[], scheduler_stage_metrics=None,
        _pending_chunked_abort_req=None, _prefill_decode_interval_remaining=0,
        prefill_decode_interval=0, prefill_decode_interval_min_bs=0,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    ap.add_argument("--max-steps", type=int, default=400)
    a = ap.parse_args()
    sc = SCENARIOS[a.scenario]
    get_context().override_server_args(
        page_size=sc["page_size"], chunked_prefill_size=sc["chunked_prefill_size"],
        max_prefill_tokens=sc["max_prefill_tokens"], schedule_policy=sc["policy"],
        max_running_requests=sc["max_running"]).install()
    print(json.dumps({"scenario": a.scenario, "config": {k: v for k, v in sc.items() if k != "reqs"},
                      "defaults": sglang_defaults()}))
    # scheduler.py:1237-1243: pp micro-batch size defaults to max_running_requests (pp_size 1)
    get_context().override("scheduler.pp_max_micro_batch_size_default",
                           pp_max_micro_batch_size=max(sc["max_running"], 1))
    h = build(sc)
    run(h, sc, a.max_steps)


def make_req(i, ids, max_new):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    sp.normalize(None)
    return Req(f"r{i}", "", array("q", ids), sp, vocab_size=32000)


def run(h, sc, max_steps):
    from sglang.srt.mem_cache.common import release_kv_cache, checkpoint_kv_cache
    pending = sorted(enumerate(sc["reqs"]), key=lambda x: x[1][0])
    last_batch = None
    finished = set()
    for step in range(max_steps):
        while pending and pending[0][1][0] <= step:  # arrivals (handle_generate_request)
            i, (_, ids, mx) = pending.pop(0)
            h._add_request_to_queue(make_req(i, ids, mx))
        if not pending and not h.waiting_queue and h.running_batch.is_empty() \
                and h.chunked_req is None and (last_batch is None or last_batch.is_empty()):
            break
        before_tokens = {}
        plan = h.get_next_batch_to_run(h.running_batch, last_batch)
        h.running_batch = plan.running_batch
        batch = plan.batch_to_run
        retracted = [r.rid for r in h.waiting_queue if r.is_retracted]
        rec = {"step": step, "ratio": round(h.new_token_ratio_tracker.current, 6)}
        if batch is None:
            rec.update(kind="idle")
            last_batch = None
            print(json.dumps(rec))
            continue
        ext = batch.forward_mode.is_extend()
        rec["kind"] = "prefill" if ext else "decode"
        if ext:
            rec["tokens"] = {r.rid: r.extend_len for r in batch.reqs}
            rec["cache_hit"] = {r.rid: r.prefix_len for r in batch.reqs}
        else:
            rec["tokens"] = {r.rid: 1 for r in batch.reqs}
        rec["retracted"] = retracted
        rec["waiting"] = [r.rid for r in h.waiting_queue]
        rec["free_kv"] = int(h.token_to_kv_pool_allocator.available_size())
        _process_result(h, batch, ext)
        rec["finished"] = [r.rid for r in batch.reqs if r.finished()]
        last_batch = batch if ext else None
        print(json.dumps(rec))


def _process_result(h, batch, ext):
    """No-model stand-in for the result processor (batch_result_processor.py)."""
    from sglang.srt.mem_cache.common import release_kv_cache, checkpoint_kv_cache
    for req in batch.reqs:
        if ext:
            if req.finished() or req.is_retracted:
                continue
            if req.inflight_middle_chunks <= 0:          # :351-392
                req.output_ids.append(DECODE_TOKEN)
                req.update_finish_state()
                if req.finished():
                    release_kv_cache(req, h.tree_cache, checkpoint=True)
                else:
                    checkpoint_kv_cache(req, h.tree_cache)
            else:                                         # :426-428
                req.inflight_middle_chunks -= 1
        else:                                             # :1010-1040
            req.output_ids.extend([DECODE_TOKEN])
            req.update_finish_state(1)
            if req.finished():
                release_kv_cache(req, h.tree_cache, checkpoint=True)


if __name__ == "__main__":
    main()
