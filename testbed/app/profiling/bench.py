"""Engine step-time benchmark (issue 4's table): decode steps, prefills, and a 256-request job,
each beside the same step in plain torch.

Usage (GPU):  python -m testbed.app.profiling.bench                      # Llama-3-8B shape, bf16, random weights
      (CPU):  python -m testbed.app.profiling.bench --model tiny_llama --device cpu --dtype float32 --small
Prints a table with the device, torch and transformers versions; `--out FILE` also writes it.
Each timing is the median of `--repeats` runs after warm-up; `execute()` returns host ints,
so every timing includes the device synchronisation.

The plain-torch column (`testbed/app/profiling/plain_llama.py`: a bare Llama forward, fused QKV, SDPA over
a flat cache, SwiGLU, with the engine's own weights) is the floor issue 4 set the engine's
targets against: decode steps within 1.3x of it, the job within 1.3x. It runs after the engine's
measurements, once the engine's KV cache is freed, with CUDA graphs for its decode steps when the
engine's have them; its job figure is composed as issue 4's was (prefills of 16 prompts, then
the decode steps at the job's middle context, each timed and summed). `--no-plain` leaves it out.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import transformers
from hydra import compose, initialize_config_dir

from testbed.engine.kv_cache import PagedKVCache
from testbed.engine.models import build_model
from testbed.engine.runner import ModelRunner
from testbed.core.kv import BlockManager
from testbed.core.request import Request, RequestState
from testbed.app.profiling.plain_llama import PlainLlama
from testbed.app.assembly.run_setup import resolve_model_spec
from testbed.app.analysis.tables import markdown_table


def _states(kv: BlockManager, n: int, context: int, first_id: int = 0) -> list[RequestState]:
    """n requests whose first `context` tokens are in the cache, ready to decode."""
    out = []
    for i in range(n):
        s = RequestState(Request(first_id + i, 0.0, context, 1_000_000))
        kv.allocate(s, context + 1)
        s.num_computed, s.num_generated = context, 1
        out.append(s)
    return out


def _time(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3_8b", help="a conf/model name")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--small", action="store_true", help="small sizes, for a CPU smoke run")
    ap.add_argument("--no-graphs", action="store_true", help="decode steps eagerly, without CUDA graphs")
    ap.add_argument("--no-plain", action="store_true", help="no plain-torch column")
    ap.add_argument("--out", help="also write the table to this file")
    args = ap.parse_args()

    from testbed.app.entry.cli import CONF_DIR  # registers the config schemas

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"model={args.model}"])
    spec = resolve_model_spec(cfg.model)
    device = torch.device(args.device)
    model = build_model(spec, args.dtype, device)
    bs = 16
    decode_batches, ctx = ((1, 4, 8), 128) if args.small else ((1, 32, 128), 1024)
    prefills = (64, 256) if args.small else (1024, 4096)
    job = (16, 64, 16) if args.small else (256, 512, 128)
    blocks = max(decode_batches) * (-(-(ctx + 2) // bs)) + job[0] * (-(-(job[1] + job[2]) // bs)) + 64
    graphs = device.type == "cuda" and not args.no_graphs
    cache = PagedKVCache.for_model(model.config, blocks, bs, model.dtype, device, scratch_block=graphs)
    runner = ModelRunner(model, cache)
    capture_s = None
    if graphs:
        t0 = time.perf_counter()
        runner.enable_decode_graphs(256, spec.max_model_len, use_graphs=True)
        capture_s = time.perf_counter() - t0
    kv = BlockManager(blocks, bs, enable_prefix_caching=False)
    rows = []  # name, engine seconds, of which input preparation, plain seconds
    for b in decode_batches:
        states = _states(kv, b, ctx)
        tokens = {s.req.id: [1] * (ctx + 1) for s in states}
        items = [(s, 1) for s in states]
        t = _time(lambda: runner.execute(items, tokens), args.repeats)
        rows.append([f"decode step, batch {b}, context {ctx}", t, runner.last_prepare_s, None])
        for s in states:
            kv.free(s)
    for n in prefills:
        s = RequestState(Request(10_000 + n, 0.0, n, 1))
        kv.allocate(s, n)
        tokens = {s.req.id: list(range(16, 16 + n))}
        t = _time(lambda: runner.execute([(s, n)], tokens), max(3, args.repeats // 2))
        rows.append([f"prefill {n} tokens", t, runner.last_prepare_s, None])
        kv.free(s)
    rows.append([f"{job[0]} x ({job[1]} in, {job[2]} out), all at once", _job(cfg, spec, runner, kv, cache, job), None,
                 None])
    engine_graphs = (f"CUDA graphs ({len(runner.decode_graphs.graphs)} captured in {capture_s:.1f} s)" if graphs
                     else "eager")

    plain_note = ""
    if not args.no_plain:
        del runner, cache, kv
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        plain = PlainLlama.from_hf(model)
        del model  # the weights the plain forward does not share (q/k/v, gate/up) are freed
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _plain_rows(plain, rows, decode_batches, ctx, prefills, job, graphs, args.repeats)
        n, p, o = job
        plain_note = (f"plain torch: a bare Llama forward (testbed/app/profiling/plain_llama.py), decode steps "
                      f"{'as CUDA graphs' if graphs else 'eager'}; its job figure is {-(-n // 16)} prefills of "
                      f"{min(n, 16)} x {p} tokens + {o - 1} decode steps at batch {n}, context {p + o // 2}, "
                      f"each timed and summed")

    header = (f"engine bench: {args.model} ({spec.num_params / 1e6:,.1f} M params), {args.dtype}, device "
              f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
              f"transformers {transformers.__version__}; engine decode steps: {engine_graphs}")
    fmt = lambda t: "" if t is None else (f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.2f} s")  # noqa: E731
    lines = [header] + ([plain_note] if plain_note else []) + [""]
    lines.append(markdown_table(["measurement", "engine", "of which host input preparation", "plain torch",
                                 "engine / plain"],
                                [(name, fmt(t), fmt(prep), fmt(plain_t), f"{t / plain_t:.2f}x" if plain_t else "")
                                 for name, t, prep, plain_t in rows]))
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


def _plain_rows(plain: PlainLlama, rows: list, decode_batches, ctx: int, prefills, job, graphs: bool,
                repeats: int) -> None:
    """The plain-torch time of each row, in place (rows in the order `main` made them)."""
    i = 0
    for b in decode_batches:
        rows[i][3] = _plain_decode(plain, b, ctx, graphs, repeats)
        i += 1
    for n in prefills:
        rows[i][3] = _plain_prefill(plain, 1, n, max(3, repeats // 2))
        i += 1
    n, p, o = job
    prefill = _plain_prefill(plain, min(n, 16), p, max(3, repeats // 2))
    decode = _plain_decode(plain, n, p + o // 2, graphs, repeats)
    rows[i][3] = -(-n // 16) * prefill + (o - 1) * decode


def _plain_prefill(plain: PlainLlama, batch: int, n: int, repeats: int) -> float:
    ids = torch.randint(16, plain.embed.shape[0], (batch, n), device=plain.device)
    with plain.cache(batch, n):
        return _time(lambda: plain.step(ids, 0).tolist(), repeats)


def _plain_decode(plain: PlainLlama, batch: int, context: int, graphs: bool, repeats: int) -> float:
    """A decode step of `batch` sequences at `context` tokens each; replayed as a CUDA graph when `graphs`."""
    ids = torch.ones(batch, 1, dtype=torch.long, device=plain.device)
    with plain.cache(batch, context + 1):
        if not graphs:
            return _time(lambda: plain.step(ids, context).tolist(), repeats)
        return _time(plain.captured_step(ids, context), repeats)


def _job(cfg, spec, runner, kv, cache, job) -> float:
    """All requests arrive at once and are served by the vLLM policy through the real replay loop."""
    from testbed.engine.prompts import PromptTokens
    from testbed.engine.replay import EngineReplay
    from testbed.core.loop import SchedulerLimits, StepLoop
    from testbed.app.assembly.plugins import make_policy

    n, p, o = job
    reqs = [Request(i, 0.0, p, o) for i in range(n)]
    loop = StepLoop(make_policy("vllm"), BlockManager(cache.num_blocks, cache.block_size, False),
                    SchedulerLimits(8192, 256, spec.max_model_len))
    replay = EngineReplay(reqs, loop, runner, PromptTokens(spec.vocab_size))
    t0 = time.perf_counter()
    out = replay.run()
    wall = time.perf_counter() - t0
    done = sum(s.status.value == "finished" for s in out.loops[0].states)
    if done != n:
        raise RuntimeError(f"the job finished {done} of {n} requests")
    return wall


if __name__ == "__main__":
    main()
