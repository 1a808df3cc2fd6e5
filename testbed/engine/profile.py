"""Profile the engine: measured step times over a grid of batch shapes, for the fitted cost model.

The measuring half of `testbed-profile` (`testbed.app.profiling.profile` is the entry point that builds
the engine from a config, walks the grid and fits a cost model to the file).

Every point is a batch built the way the step loop builds one (`RequestState`s holding KV
blocks, `num_computed` tokens already cached) and run through exactly the engine's code
path, `ModelRunner.execute`: input preparation, forward, greedy sampling up to the token
ids on the host (so the device is synchronised). Each point is timed `repeats` times after
`warmup` runs and its median recorded, with the medians of the preparation and forward
parts. The grid:

- prefill: one chunk of c tokens at context offset o (o tokens already cached), and
  several fresh chunks in one step (k chunks of c tokens);
- decode: B sequences of context L each;
- mixed: one fresh prefill chunk plus B decodes of context L;
- host: the step loop's own cost per step (`StepLoop.plan` with the policy, then
  `complete`) for N running decodes, with no model at all, so that a fitted cost model
  carries the host share of a real iteration and a slow policy shows up as one.

The file is a CSV with `# key: value` header lines (device, model, dtype, block size, the
machine and software: CPU model, usable CPUs, torch threads, torch/transformers/Python versions,
the testbed's version and commit (`engine/machine.py`); date, grid, ...), then one row per point: its kind, the
`BatchShape` fields, and the measured seconds (`seconds`: the median wall time; its
`prepare_s` and `forward_s` parts; `min_s`; on a CPU `cpu_s`, the median CPU time of the
thread). On a CPU, a point whose wall time exceeds its CPU time by more than 10% lost the
core to another process and is measured again (`profile.retries`); `contended` marks a
point where every attempt was disturbed.
"""
from __future__ import annotations

import datetime
import json
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from omegaconf import DictConfig

from testbed.engine.profile_config import ProfileConfig
from testbed.core.cost import BatchShape
from testbed.core.kv import BlockManager
from testbed.core.request import Request, RequestState


def lost_the_core(seconds: float, cpu_s: float) -> bool:
    """A measurement another process slowed: wall time over 1.1 x this thread's CPU time (+20 us).
    Unknown (NaN) CPU time counts as not slowed."""
    return cpu_s == cpu_s and seconds > 1.1 * cpu_s + 20e-6


SHAPE_FIELDS = [f.name for f in fields(BatchShape)]
COLUMNS = ["kind", *SHAPE_FIELDS, "seconds", "prepare_s", "forward_s", "min_s", "cpu_s", "repeats", "contended"]
FORMAT_VERSION = 1
_BIG = 1 << 30  # an output length no profile point ever reaches


@dataclass
class Point:
    kind: str  # prefill, decode, mixed or host
    chunks: list[tuple[int, int]] = field(default_factory=list)  # (tokens, offset) of each prefill sequence
    decode_batch: int = 0
    decode_context: int = 0

    @property
    def kv_tokens(self) -> int:
        return sum(c + o for c, o in self.chunks) + self.decode_batch * (self.decode_context + 1)

    def blocks(self, bs: int) -> int:
        return sum(-(-(c + o) // bs) for c, o in self.chunks) + self.decode_batch * -(-(self.decode_context + 1) // bs)


def grid_points(pc: ProfileConfig, max_len: int, num_blocks: int, block_size: int,
                max_batched_tokens: int | None = None) -> tuple[list[Point], int]:
    """The grid's points that fit (context, KV cache, max_kv_tokens), and how many were skipped."""
    pts: list[Point] = []
    for c in pc.prefill_chunks:
        for o in pc.prefill_offsets:
            pts.append(Point("prefill", [(c, o)]))
    for k in pc.prefill_seqs:
        for c in pc.prefill_seq_chunks:
            pts.append(Point("prefill", [(c, 0)] * k))
    for b in pc.decode_batches:
        for L in pc.decode_contexts:
            pts.append(Point("decode", [], b, L))
    for c in pc.mixed_chunks:
        for b in pc.mixed_batches:
            for L in pc.mixed_contexts:
                pts.append(Point("mixed", [(c, 0)], b, L))
    keep = []
    for p in pts:
        too_long = any(c + o > max_len for c, o in p.chunks) or p.decode_context + 1 > max_len
        tokens = sum(c for c, _ in p.chunks) + p.decode_batch
        over_budget = max_batched_tokens is not None and tokens > max_batched_tokens
        if too_long or over_budget or p.kv_tokens > pc.max_kv_tokens or p.blocks(block_size) > num_blocks:
            continue
        keep.append(p)
    hosts = [Point("host", [], n, 16) for n in pc.host_batches]
    hosts += [Point("host", [(c, 0)], n, 16) for c in pc.host_prompts for n in pc.host_batches[::3]]
    return keep + hosts, len(pts) - len(keep)


def _measure(step, repeats: int, warmup: int, min_time_s: float, retries: int) -> dict:
    """Time `step()` (which returns its (prepare, forward) parts, or None): `warmup` untimed calls,
    then at least `repeats` timed ones (more for short steps, until `min_time_s` was timed); the
    medians of wall time, of the parts and of the thread's CPU time.

    With `retries` (a CPU device), an attempt whose median wall time exceeds its median CPU time
    by more than 10% lost the core to another process; it is measured again, up to `retries` more
    times, and the least disturbed attempt is kept (`contended` says whether even that one was)."""
    best = None
    for attempt in range(1 + retries):
        for _ in range(warmup):
            step()
        wall, cpu, prep, fwd = [], [], [], []
        while len(wall) < repeats or (sum(wall) < min_time_s and len(wall) < 10 * repeats):
            t0, c0 = time.perf_counter(), time.thread_time()
            parts = step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
            if parts is not None:
                prep.append(parts[0])
                fwd.append(parts[1])
        med = statistics.median
        m = {"seconds": med(wall), "prepare_s": med(prep) if prep else float("nan"),
             "forward_s": med(fwd) if fwd else float("nan"), "min_s": min(wall), "cpu_s": med(cpu),
             "repeats": len(wall)}
        m["contended"] = int(lost_the_core(m["seconds"], m["cpu_s"]))
        if best is None or m["seconds"] / max(m["cpu_s"], 1e-9) < best["seconds"] / max(best["cpu_s"], 1e-9):
            best = m
        if not retries or not m["contended"]:
            break
    return best


def _batch(kv: BlockManager, p: Point, vocab: int):
    """The point's batch as the step loop would hand it over: states holding KV blocks, their
    `num_computed` tokens already cached, and their known token ids."""
    states, items, tokens = [], [], {}
    rid = 0
    for c, o in p.chunks:
        s = RequestState(Request(rid, 0.0, o + c, _BIG))
        kv.allocate(s, o + c)
        s.num_computed = o
        tokens[rid] = [16 + (i * 7919) % (vocab - 16) for i in range(o + c)]  # sampled at the chunk's end
        states.append(s)
        items.append((s, c))
        rid += 1
    if p.decode_batch:
        L = p.decode_context
        shared = [16 + (i * 7919) % (vocab - 16) for i in range(L + 1)]
        for _ in range(p.decode_batch):
            s = RequestState(Request(rid, 0.0, L, _BIG))
            kv.allocate(s, L + 1)
            s.num_computed, s.num_generated = L, 1
            tokens[rid] = shared
            states.append(s)
            items.append((s, 1))
            rid += 1
    return states, items, tokens


def time_point(runner, kv: BlockManager, shape_of, p: Point, pc: ProfileConfig, vocab: int,
               retries: int) -> tuple[BatchShape, dict]:
    """`runner.execute` on this point's batch: exactly the engine's step (prepare, forward, sampling)."""
    states, items, tokens = _batch(kv, p, vocab)
    try:
        def step():
            runner.execute(items, tokens)
            return runner.last_prepare_s, runner.last_forward_s

        return shape_of(items), _measure(step, pc.repeats, pc.warmup, pc.min_time_s, retries)
    finally:
        for s in states:
            kv.free(s)


def header_of(engine, cfg: DictConfig, pc: ProfileConfig, measured: int, skipped: int) -> dict:
    """The profile's header: what was measured (model, dtype, KV layout, grid) and on what machine and
    software (`engine.machine.describe_machine`: CPU model and usable CPUs, torch threads, versions, the
    testbed's commit), so a user of the profile can be told when it is another machine's."""
    import torch

    from testbed.engine.machine import describe_machine

    grid_spec = {k: v for k, v in asdict(pc).items() if k not in ("out", "progress", "grid")}
    machine = describe_machine(device=engine.device_name, dtype=str(engine.dtype).removeprefix("torch."),
                               threads=torch.get_num_threads(), commit=True)
    return {
        "testbed-profile": FORMAT_VERSION,
        "device": machine.pop("device"),
        "device_type": engine.device.type,
        "model": engine.spec.name,
        "params": engine.spec.num_params,
        "dtype": machine.pop("dtype"),
        "block_size": cfg.kv.block_size,
        "kv_blocks": engine.num_blocks,
        **machine,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "grid": pc.grid,
        "repeats": pc.repeats,
        "warmup": pc.warmup,
        "statistic": "median",
        "host_policy": pc.host_policy,
        "points": measured,
        "skipped": skipped,
        "grid_spec": json.dumps(grid_spec, separators=(",", ":")),
    }


def write_profile(path: str | Path, header: dict, rows: list[dict]) -> Path:
    import csv

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        for k, v in header.items():
            f.write(f"# {k}: {v}\n")
        w = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    return path
