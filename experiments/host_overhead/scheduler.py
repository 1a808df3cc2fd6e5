"""vLLM's engine-core scheduler on the host, per decode step, against batch size B: `Scheduler.schedule()`
and `Scheduler.update_from_output()`, no model.

Built as vLLM's own tests build it (tests/v1/core/utils.py::create_scheduler; as in
experiments/vllm_referee/ported_scenarios_real.py): a VllmConfig and a KVCacheConfig of one
full-attention group of `--num-blocks` 16-token blocks (GPU scale: Llama-3-8B's KV cache on an 80 GB
H100 at gpu_memory_utilization 0.9 is about 29,000 such blocks), prefix caching on with the engine's
own block hasher (vllm/v1/engine/core.py: get_hash_fn_by_name(prefix_caching_hash_algo),
init_none_hash, get_request_block_hasher), and `log_stats=True` (a server's default: `make_stats`
runs in every update_from_output).

For each mode, context length L and batch size B, one scheduler gets B requests with distinct random
L-token prompts, prefilled (not timed). Then `--steps` decode steps are timed in every scheduler, each
scheduling one token per request and feeding back a ModelRunnerOutput built by hand with one sampled
token per request (built outside the timed calls: in vLLM the model runner builds it). The schedulers
take turns step by step (in a new random order each round), so that the shared machine's changing speed
falls on every case alike and the a + b*B fits see one machine. Taking turns also leaves each
scheduler's code and data cold in the caches, as in the engine loop, where the model runner runs between
two scheduler calls; `--warm` times each case alone instead (written as `scheduler-warm_<version>.csv`).

Two modes:
- `sync`: `Scheduler`, schedule(N) then update_from_output(N) (EngineCore.step, async scheduling off);
- `async`: `AsyncScheduler`, pipelined as EngineCore.step_with_batch_queue runs it with a batch queue
  of 2: schedule(N+1) is called before update_from_output(N) (placeholders for the in-flight token).

Writes `scheduler_<version>.csv` (one row per mode, L, B and part: schedule, update, both; wall time
and the thread's CPU time) and
`scheduler_<version>.json` (machine, versions, load).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 /work/venvs/vllm/bin/python experiments/host_overhead/scheduler.py
"""
from __future__ import annotations

import argparse
import gc
import inspect
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BATCHES, QUIET, machine, stats_us, tiny_model_dir, version_tag, write_csv, write_meta  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
BLOCK = 16


def _kwargs(fn, **kw):
    """Only the keyword arguments `fn` accepts (the two vLLM versions differ a little)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kw.items() if k in params}


def make_scheduler(model_dir: str, num_blocks: int, max_model_len: int, async_: bool, max_num_seqs: int):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_config = ModelConfig(model=model_dir, dtype="float32", seed=0, skip_tokenizer_init=True,
                               max_model_len=max_model_len)
    fields = set(inspect.signature(SchedulerConfig).parameters)  # InitVars (max_model_len, ...) included
    sc_kw = dict(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, max_model_len=max_model_len,
                 enable_chunked_prefill=True, async_scheduling=async_, is_encoder_decoder=False)
    scheduler_config = SchedulerConfig(**{k: v for k, v in sc_kw.items() if k in fields})
    cache_config = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config)
    # one full-attention group, shaped like Llama-3-8B's (8 KV heads of 128, bf16): the shape only sizes blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    cache_config.num_gpu_blocks = num_blocks + 1
    cls = AsyncScheduler if async_ else Scheduler
    sched = cls(**_kwargs(Scheduler.__init__, vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK,
                          hash_block_size=BLOCK, include_finished_set=False, log_stats=True))
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == num_blocks
    return sched, cache_config


def block_hasher(cache_config):
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    try:
        from vllm.utils.hashing import get_hash_fn_by_name
    except ImportError:  # older layout
        from vllm.utils import get_hash_fn_by_name
    fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
    init_none_hash(fn)
    return get_request_block_hasher(BLOCK, fn)


def runner_output(sched_out, rng):
    """One sampled token for every request whose scheduled tokens reach its known length."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(sched_out.num_scheduled_tokens)
    return ModelRunnerOutput(**_kwargs(ModelRunnerOutput, req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                       sampled_token_ids=[[rng.randrange(32000)] for _ in ids], logprobs=None,
                                       prompt_logprobs_dict={}, pooler_output=[]))


class Case:
    """One scheduler holding B decoding requests of context L, stepped one decode step at a time."""

    def __init__(self, model_dir, B, L, mode, rounds, num_blocks, seed=0):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.B, self.L, self.mode = B, L, mode
        max_model_len = 4096 if L + rounds + 8 <= 4096 else L + rounds + 64
        sched, cache_config = make_scheduler(model_dir, num_blocks, max_model_len, mode == "async", max(256, B))
        hasher = block_hasher(cache_config)
        self.rng = rng = random.Random(seed)
        for i in range(B):
            prompt = [rng.randrange(32000) for _ in range(L)]
            sched.add_request(Request(**_kwargs(Request.__init__, request_id=f"r{i}", prompt_token_ids=prompt,
                                                sampling_params=SamplingParams(max_tokens=max_model_len - L,
                                                                               ignore_eos=True),
                                                pooling_params=None, block_hasher=hasher, arrival_time=time.time(),
                                                eos_token_id=2)))  # 0.15.1 needs it; ignore_eos anyway
        # prefill (not timed): schedule/update until every request decodes one token a step
        for _ in range(10_000):
            out = sched.schedule()
            sched.update_from_output(out, runner_output_for_prefill(sched, out, rng))
            if len(out.num_scheduled_tokens) == B and all(n == 1 for n in out.num_scheduled_tokens.values()):
                break
        else:
            raise RuntimeError("prefill did not finish")
        self.sched, self.num_blocks = sched, num_blocks
        self.prev = sched.schedule() if mode == "async" else None
        self.samples = [[], [], [], []]  # schedule wall, schedule CPU, update wall, update CPU (ns)

    def step(self, record: bool) -> None:
        """sync: schedule(N), update(N) (EngineCore.step); async: schedule(N+1), then update(N)
        (EngineCore.step_with_batch_queue's order)."""
        pc, tt, sched = time.perf_counter_ns, time.thread_time_ns, self.sched
        c0, t0 = tt(), pc()
        out = sched.schedule()
        t1, c1 = pc(), tt()
        assert len(out.num_scheduled_tokens) == self.B, len(out.num_scheduled_tokens)
        done = out if self.mode == "sync" else self.prev
        mro = runner_output(done, self.rng)
        c2, t2 = tt(), pc()
        sched.update_from_output(done, mro)
        t3, c3 = pc(), tt()
        self.prev = out
        if record:
            for lst, v in zip(self.samples, (t1 - t0, c1 - c0, t3 - t2, c3 - c2)):
                lst.append(v)

    def blocks_in_use(self) -> int:
        return self.num_blocks - self.sched.kv_cache_manager.block_pool.get_num_free_blocks()


def run_cases(cases: list, steps: int, warmup: int) -> None:
    """Step every case once per round, in a new random order each round, so that the machine's
    changing speed (a shared, loaded machine) falls on all cases alike, and so do the caches' states
    (a case run right after the largest one finds the caches coldest)."""
    gc.collect()
    gc.freeze()  # as vLLM freezes its heap after start-up (freeze_gc_heap, vllm/v1/engine/core.py)
    order = list(cases)
    shuffle = random.Random(1).shuffle
    with QUIET():
        for k in range(warmup + steps):
            shuffle(order)  # a new order each round: no case always follows the same (e.g. the largest) one
            for c in order:
                # the youngest generation collected before each case (not timed), so that a collection
                # owed to the previous case's allocations does not land in this one's timing
                gc.collect(0)
                c.step(k >= warmup)


def runner_output_for_prefill(sched, out, rng):
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = sched.requests[rid]
        done = r.num_computed_tokens + getattr(r, "num_output_placeholders", 0) * 0 >= r.num_tokens
        sampled.append([rng.randrange(32000)] if done else [])
    return ModelRunnerOutput(**_kwargs(ModelRunnerOutput, req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                       sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                       pooler_output=[]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--num-blocks", type=int, default=50_000)
    ap.add_argument("--warm", action="store_true",
                    help="time each case alone, back to back (its code and data stay in the caches), into "
                         "scheduler-warm_<version>.csv, instead of taking turns")
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    meta = machine()
    meta.update(num_blocks=a.num_blocks, block_size=BLOCK, steps=a.steps, warmup=a.warmup, log_stats=True,
                prefix_caching=True, command=" ".join(sys.argv))
    model_dir = tiny_model_dir()
    cases = [Case(model_dir, B, L, mode, a.warmup + a.steps, a.num_blocks)
             for mode in a.modes.split(",") for L in map(int, a.contexts.split(",")) for B in map(int, a.batches.split(","))]
    if a.warm:
        for c in cases:
            run_cases([c], a.steps, a.warmup)
    else:
        run_cases(cases, a.steps, a.warmup)
    rows = []
    for c in cases:
        ts, cs, tu, cu = c.samples
        both, cboth = [x + y for x, y in zip(ts, tu)], [x + y for x, y in zip(cs, cu)]
        for part, xs, ys in (("schedule", ts, cs), ("update", tu, cu), ("both", both, cboth)):
            rows.append(dict(vllm=meta["vllm"], mode=c.mode, context=c.L, batch=c.B, part=part,
                             blocks_in_use=c.blocks_in_use(), **stats_us(xs, ys)))
        r = rows[-1]
        print(f"{c.mode} L={c.L} B={c.B}: schedule {rows[-3]['median_us']} us, update {rows[-2]['median_us']} us, "
              f"both {r['median_us']} us (p10 {r['p10_us']}, p90 {r['p90_us']}; CPU time {r['cpu_median_us']}); "
              f"blocks in use {r['blocks_in_use']}", flush=True)
    meta["loads"] = QUIET.summary()
    tag = version_tag()
    name = "scheduler-warm" if a.warm else "scheduler"
    write_csv(os.path.join(a.out, f"{name}_{tag}.csv"), rows)
    write_meta(os.path.join(a.out, f"{name}_{tag}.json"), meta)
    print(QUIET.summary())


if __name__ == "__main__":
    main()
