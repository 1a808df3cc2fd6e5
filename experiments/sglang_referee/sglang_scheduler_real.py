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
HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS_FILE = os.path.join(HERE, "scenarios.json")
STEPS_FILE = os.path.join(HERE, "real_steps.jsonl")
DECODE_TOKEN_BASE = 30000  # request i samples token DECODE_TOKEN_BASE + i at every decode step
FIRST_TOKEN = 100  # prompt token ids are handed out from here, in scenario order


def prompt_tokens(scenario):
    """Token ids per request, so that two requests share exactly what our trace model says they
    share (testbed/core/kv.py `prefix_block_keys`): token t < min(prompt, len(ids) * B) of a
    request with prefix ids `ids` (trace blocks of B = prefix_block_tokens tokens) is named by
    (ids[:t // B + 1], t % B) -- equal across requests with the same ids up to that block; every
    other prompt token is unique to its request. Ids are handed out in scenario order."""
    next_id = [FIRST_TOKEN]
    named = {}

    def fresh():
        next_id[0] += 1
        return next_id[0] - 1

    out = {}
    for r in scenario["requests"]:
        ids, b, n = tuple(r.get("prefix_ids", ())), r.get("prefix_block_tokens", 1), r["prompt_len"]
        covered = min(n, len(ids) * b)
        toks = []
        for t in range(n):
            if t < covered:
                key = (ids[:t // b + 1], t % b)
                if key not in named:
                    named[key] = fresh()
                toks.append(named[key])
            else:
                toks.append(fresh())
        out[r["id"]] = toks
    assert next_id[0] < DECODE_TOKEN_BASE, "scenario too large for the token id space"
    return out


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

    ps, tokens, cap = sc["page_size"], sc["kv_tokens"], sc["max_running_requests"]
    kv = MHATokenToKVPool(size=tokens, page_size=ps, dtype=torch.float32, head_num=1,
                          head_dim=1, layer_num=1, device="cpu", enable_memory_saver=False)
    if ps == 1:
        alloc = TokenToKVPoolAllocator(tokens, torch.float32, "cpu", kv, need_sort=False)
    else:
        alloc = PagedTokenToKVPoolAllocator(tokens, ps, torch.float32, "cpu", kv, need_sort=False)
    r2t = ReqToTokenPool(size=cap, max_context_len=sc["context_len"] + 4, device="cpu",
                         enable_memory_saver=False)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=r2t,
                                      token_to_kv_pool_allocator=alloc, page_size=ps))
    h = Harness()
    h.__dict__.update(dict(
        waiting_queue=[], chunked_req=None, tree_cache=tree, token_to_kv_pool_allocator=alloc,
        req_to_token_pool=r2t, page_size=ps, max_prefill_tokens=sc["max_prefill_tokens"],
        chunked_prefill_size=sc["chunked_prefill_size"], max_running_requests=cap,
        policy=SchedulePolicy(sc["schedule_policy"], tree, False, False, False),
        new_token_ratio_tracker=NewTokenRatioTracker.from_config(),
        running_batch=ScheduleBatch(reqs=[], batch_is_full=False),
    ))
    h.__dict__.update(_disabled_features())
    h.model_config.context_len = sc["context_len"]
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


def load_scenarios(path=SCENARIOS_FILE):
    with open(path) as f:
        return json.load(f)


def run_scenario(sc, max_steps=2000):
    """Run one scenario through the real scheduler; returns its list of step records."""
    env = sc.get("env", {})
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    ov = get_context().override_server_args(
        page_size=sc["page_size"], chunked_prefill_size=sc["chunked_prefill_size"],
        max_prefill_tokens=sc["max_prefill_tokens"], schedule_policy=sc["schedule_policy"],
        max_running_requests=sc["max_running_requests"])
    ov.install()
    try:
        # scheduler.py:1237-1243: pp micro-batch size defaults to max_running_requests (pp_size 1)
        get_context().override("scheduler.pp_max_micro_batch_size_default",
                               pp_max_micro_batch_size=max(sc["max_running_requests"], 1))
        h = build(sc)
        return run(h, sc, max_steps)
    finally:
        ov.restore()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenarios", default=SCENARIOS_FILE, help="JSON list of scenarios")
    ap.add_argument("--scenario", help="run only this one and print its steps")
    ap.add_argument("--out", default=STEPS_FILE, help="where to write the steps (one line per scenario)")
    ap.add_argument("--check", action="store_true", help="re-run and diff against --out instead of writing it")
    ap.add_argument("--max-steps", type=int, default=2000)
    a = ap.parse_args()
    scenarios = load_scenarios(a.scenarios)
    if a.scenario:
        sc = next(s for s in scenarios if s["name"] == a.scenario)
        print(json.dumps({"scenario": sc["name"], "defaults": sglang_defaults()}))
        for rec in run_scenario(sc, a.max_steps):
            print(json.dumps(rec))
        return
    lines = []
    for sc in scenarios:
        steps = run_scenario(sc, a.max_steps)
        lines.append(json.dumps({"name": sc["name"], "steps": steps}))  # key order = batch order
    if not a.check:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")
        n = sum(len(json.loads(x)["steps"]) for x in lines)
        print(f"wrote {a.out}: {len(lines)} scenarios, {n} steps")
        return
    with open(a.out) as f:
        old = {json.loads(x)["name"]: x.strip() for x in f if x.strip()}
    new = {json.loads(x)["name"]: x for x in lines}
    bad = sorted(k for k in new.keys() | old.keys() if new.get(k) != old.get(k))
    for k in bad:
        o = json.loads(old[k])["steps"] if k in old else None
        n = json.loads(new[k])["steps"] if k in new else None
        if o is None or n is None:
            print(f"{k}: only in {'the re-run' if o is None else a.out}")
            continue
        d = next((i for i in range(max(len(o), len(n))) if i >= len(o) or i >= len(n) or o[i] != n[i]), None)
        print(f"{k}: first difference at step record {d}:\n  committed {o[d] if d < len(o) else None}\n  re-run    {n[d] if d < len(n) else None}")
    print("--check:", "all identical" if not bad else f"DIFFER in {len(bad)} scenario(s): {bad}")
    sys.exit(1 if bad else 0)


def make_req(rid, ids, max_new, ignore_eos):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos)
    sp.normalize(None)
    return Req(str(rid), "", array("q", ids), sp, vocab_size=32000)


def _fully_idle(h, last_batch):
    """Scheduler.is_fully_idle (scheduler.py:5337-5355) for this harness's features."""
    return (h.running_batch.is_empty() and h.chunked_req is None and not h.waiting_queue
            and (last_batch is None or last_batch.is_empty()))


def run(h, sc, max_steps):
    """The event loop (scheduler.py:2026-2059, non-overlap): arrivals due at this step, then
    get_next_batch_to_run, then the batch's result; no batch -> on_idle, whose only scheduling
    effect is NewTokenRatioTracker.reset() when fully idle (scheduler.py:5241-5318)."""
    toks = prompt_tokens(sc)
    index = {r["id"]: i for i, r in enumerate(sc["requests"])}
    pending = sorted(sc["requests"], key=lambda r: r["arrival_step"])  # stable: file order
    last_batch = None
    out = []
    for step in range(max_steps):
        while pending and pending[0]["arrival_step"] <= step:  # arrivals (handle_generate_request)
            r = pending.pop(0)
            h._add_request_to_queue(make_req(r["id"], toks[r["id"]], r["output_len"], sc["ignore_eos"]))
        if not pending and not h.waiting_queue and h.running_batch.is_empty() \
                and h.chunked_req is None and (last_batch is None or last_batch.is_empty()):
            break
        waiting_before = {id(r) for r in h.waiting_queue}
        plan = h.get_next_batch_to_run(h.running_batch, last_batch)
        h.running_batch = plan.running_batch
        batch = plan.batch_to_run
        # requests update_running_batch retracted this step (appended to the waiting queue)
        retracted = [r.rid for r in h.waiting_queue if r.is_retracted and id(r) not in waiting_before]
        rec = {"step": step}
        if batch is None:
            rec.update(kind="idle", waiting=[r.rid for r in h.waiting_queue])
            if _fully_idle(h, last_batch):
                h.new_token_ratio_tracker.reset()
            rec["ratio"] = round(h.new_token_ratio_tracker.current, 9)
            last_batch = None
            out.append(rec)
            continue
        ext = batch.forward_mode.is_extend()
        rec["kind"] = "prefill" if ext else "decode"
        if ext:
            rec["tokens"] = {r.rid: r.extend_len for r in batch.reqs}
            # the cached prefix each request admitted from the waiting queue this step matched
            # (a continuing chunked request is not an admission)
            rec["cache_hit"] = {r.rid: r.prefix_len for r in batch.reqs if id(r) in waiting_before}
        else:
            rec["tokens"] = {r.rid: 1 for r in batch.reqs}
        rec["retracted"] = retracted
        rec["waiting"] = [r.rid for r in h.waiting_queue]
        rec["ratio"] = round(h.new_token_ratio_tracker.current, 9)
        rec["free_kv"] = int(h.token_to_kv_pool_allocator.available_size())
        _process_result(h, batch, ext, lambda req: DECODE_TOKEN_BASE + index[int(req.rid)])
        rec["finished"] = [r.rid for r in batch.reqs if r.finished()]
        last_batch = batch if ext else None
        out.append(rec)
    else:
        raise RuntimeError(f"scenario {sc['name']}: not done after {max_steps} steps")
    return out


def _process_result(h, batch, ext, token_of):
    """No-model stand-in for the result processor (batch_result_processor.py)."""
    from sglang.srt.mem_cache.common import release_kv_cache, checkpoint_kv_cache
    for req in batch.reqs:
        if ext:
            if req.finished() or req.is_retracted:
                continue
            if req.inflight_middle_chunks <= 0:          # :351-392
                req.output_ids.append(token_of(req))
                req.update_finish_state()
                if req.finished():
                    release_kv_cache(req, h.tree_cache, checkpoint=True)
                else:
                    checkpoint_kv_cache(req, h.tree_cache)
            else:                                         # :426-428
                req.inflight_middle_chunks -= 1
        else:                                             # :1010-1040
            req.output_ids.extend([token_of(req)])
            req.update_finish_state(1)
            if req.finished():
                release_kv_cache(req, h.tree_cache, checkpoint=True)


if __name__ == "__main__":
    main()
