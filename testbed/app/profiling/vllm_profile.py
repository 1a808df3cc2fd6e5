"""`testbed-profile backend=vllm`: a profile of real vLLM's step times, fitted from a calibration replay.

    testbed-profile backend=vllm model=tiny_llama model.head_dim=64 ... trace=azure_conv \
        trace.start_s=600 trace.max_requests=300 trace.rate_scale=0.8 profile.out=vllm_profile.csv

The configured trace is replayed on vLLM (`backend.scheduler` as configured; native by
default), and every step that ran tokens becomes one profile row: the step's `BatchShape`,
built from what vLLM scheduled (`testbed.vllm_backend.recording.shape_of`), and its measured
wall seconds (from `schedule()` to the next `schedule()` or the step's return: scheduler,
input preparation, forward, sampling and output processing, everything the replay waited
for). The file has the engine profile's format, so `cost_model=profile` fits it as it fits
an engine profile (`testbed.sim.fitted_cost`, including its held-out error on every 5th row).

Why a calibration replay and not vLLM driven over the profile grid: vLLM has no entry point
for "run this batch"; a grid point would have to be forced through its scheduler with
synthetic requests (prefill them, then hold B decodes at context L, ...), and each measured
step would still carry vLLM's per-step scheduling and output work of that artificial state.
A replay measures the step exactly as a trace replay runs it, on the shapes a trace of this
kind visits (the region the fidelity check asks about), with vLLM's real per-step overheads.
The price is coverage: shapes the calibration never saw are extrapolated by the fitted
analytic form, so calibrate at least at the load of the trace being predicted. Honesty: the
calibration trace must not be the one the simulator is scored on; use another window
(`trace.start_s`), another seed or a synthetic trace. The header records which trace it was,
and `testbed-fidelity backend=vllm` refuses a profile made on exactly its own trace.
"""
from __future__ import annotations

import datetime
import math
import time
from dataclasses import asdict
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


SOURCE = "vllm-replay"


def record_rows(records, cpu_s=None) -> list[dict]:
    """Profile rows from replay step records ((shape, vLLM step seconds, iteration seconds)); `cpu_s`, the
    replay thread's CPU seconds per step, marks the steps another process slowed (`contended`). Every
    row is kept: the simulator is to predict this machine as the replay meets it, noise included."""
    from testbed.engine.profile import lost_the_core

    cpu = list(cpu_s) if cpu_s is not None and len(cpu_s) == len(records) else [math.nan] * len(records)
    rows = []
    for (shape, _, seconds), c in zip(records, cpu):
        rows.append({"kind": shape.kind, **asdict(shape), "seconds": seconds, "prepare_s": math.nan,
                     "forward_s": math.nan, "min_s": seconds, "cpu_s": c, "repeats": 1,
                     "contended": int(lost_the_core(seconds, c))})
    return rows


def trace_key(cfg: DictConfig) -> str:
    """Which requests a run replays (the trace and its transforms, the seed): equal keys, equal trace."""
    tc = OmegaConf.to_container(cfg.trace, resolve=True)
    return OmegaConf.to_yaml({"trace": tc, "seed": cfg.seed}).replace("\n", " ").strip()


def trace_label(cfg: DictConfig) -> str:
    """The calibration trace in a few words, for the reader (`trace_key` is what is compared)."""
    t = cfg.trace
    keys = ("start_s", "end_s", "max_requests", "rate_scale", "max_prompt_len", "max_output_len", "rate", "cv")
    parts = [f"{k}={t[k]}" for k in keys if k in t and t[k] is not None and not (k in ("rate", "cv") and t.kind == "file")]
    return f"{t.name} " + " ".join(parts) + f" seed={cfg.seed}"


def run_vllm_profile(cfg: DictConfig, out: str | Path | None = None) -> Path:
    from testbed.app.assembly.frontend import without_frontend
    from testbed.app.assembly.vllm_run import replay_on_vllm
    from testbed.engine.machine import describe_machine
    from testbed.engine.profile import write_profile
    from testbed.engine.profile_config import resolve

    cfg = without_frontend(cfg, "testbed-profile")

    pc = resolve(cfg.get("profile"))
    if pc.threads:
        import torch

        torch.set_num_threads(pc.threads)
    replays: list = []
    t0 = time.perf_counter()
    result = replay_on_vllm(cfg, on_done=lambda setup, replay: replays.append(replay))
    rows = record_rows(replays[0].step_records, replays[0].step_cpu_s)
    s = result.summary
    import torch

    machine = describe_machine(device=s.get("device"), dtype=s.get("dtype"), threads=torch.get_num_threads(),
                               commit=True)
    header = {
        "testbed-profile": 1, "source": SOURCE, "device": s.get("device"), "device_type": s.get("device"),
        "model": s.get("model"), "dtype": s.get("dtype"), "block_size": s.get("block_size"),
        "kv_blocks": s.get("kv_blocks"), "vllm": s.get("vllm_version"), "vllm_scheduler": s.get("vllm_scheduler"),
        "policy": cfg.policy.name, **{k: v for k, v in machine.items() if k not in ("device", "dtype")},
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "statistic": "one step each", "calibration": trace_label(cfg), "calibration_trace": trace_key(cfg),
        "calibration_requests": s.get("num_requests"), "points": len(rows), "skipped": 0,
        "wall_s": round(time.perf_counter() - t0, 1), "contended_points": sum(r["contended"] for r in rows),
    }
    path = Path(out or pc.out or Path(cfg.output.dir) / "profile.csv")
    return write_profile(path, header, rows)
