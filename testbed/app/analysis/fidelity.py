"""`testbed-fidelity`: one trace on the real engine and in the simulator calibrated from it.

    testbed-fidelity model=tiny_llama backend.device=cpu cost_model=profile \
        cost_model.profile=profiles/cpu_tiny_llama.csv +profile.threads=1 \
        trace.max_requests=100 trace.rate_scale=20 trace.max_prompt_len=256 trace.max_output_len=32

(`python -m testbed.app.analysis.fidelity ...` is the same; `cost_model.profile=null` profiles the engine
first, with the `profile` section's grid, and writes that profile beside the results.)

    testbed-fidelity backend=vllm model=tiny_llama model.head_dim=64 ... cost_model=profile \
        cost_model.profile=vllm_profile.csv fidelity.repeats=3 trace.max_requests=300 trace.rate_scale=0.8

`backend=vllm`: the real side is real vLLM (`testbed.app.assembly.vllm_run`): its own scheduler for
policy=vllm (`backend.scheduler=native`), the testbed's policy deciding inside vLLM for any
other (`backend.scheduler=policy`; native with another policy is refused, it would compare
vLLM's scheduler with that policy). The profile must come from `testbed-profile backend=vllm`
on another trace (refused when its header names this very trace). The simulator gets vLLM's
KV capacity and block size.

`fidelity.repeats=N` replays the real side N times: the machine's noise is then measured, not
guessed. Per metric the table gives the real runs' mean, min, max, spread ((max - min) / mean)
and the largest deviation of one run from the mean, beside the simulator's error against the
mean; the per-step error pools every real run's steps (`steps.csv` has a `repeat` column), and is
also given per real run, since the cost model's own error moves with the machine's load.

It replays the trace on the engine (wall clock), then simulates the same trace, policy and
config with the cost model (normally `cost_model=profile`, fitted to a profile of that same
engine) and the engine's KV capacity, and reports per metric (mean, p50, p90, p99 of TTFT,
TPOT and E2E latency; throughput; goodput) the real value, the simulated one and the
relative error (sim - real) / real. It also reports the per-step error: every real step's
batch shape and measured time against the cost model's prediction for that shape, which
separates the cost model's error from scheduling divergence (a different sequence of
batches in the simulation once its clock drifts). Written to the output dir:
`fidelity.csv`, `fidelity.md`, `fidelity.json`, `fidelity_cdf.png` (real vs simulated CDFs),
`steps.csv` (per real step: shape, measured and predicted seconds), and both runs' usual
result files under `real/` and `sim/`.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf, open_dict

from testbed.app.entry.cli import CONF_DIR
from testbed.core.cost import BatchShape
from testbed.app.assembly.frontend import without_frontend
from testbed.app.assembly.run_setup import RunResult, finish, model_preset, prepare, resolve_model_spec
from testbed.app.assembly.run import run_info, simulate
from testbed.app.assembly.validate import check_config
from testbed.app.analysis.tables import markdown_table

log = logging.getLogger("testbed.app.analysis.fidelity")

METRICS = [
    ("TTFT mean (ms)", "mean_ttft_ms"), ("TTFT p50 (ms)", "median_ttft_ms"), ("TTFT p90 (ms)", "p90_ttft_ms"),
    ("TTFT p99 (ms)", "p99_ttft_ms"),
    ("TPOT mean (ms)", "mean_tpot_ms"), ("TPOT p50 (ms)", "median_tpot_ms"), ("TPOT p90 (ms)", "p90_tpot_ms"),
    ("TPOT p99 (ms)", "p99_tpot_ms"),
    ("E2E mean (ms)", "mean_e2el_ms"), ("E2E p50 (ms)", "median_e2el_ms"), ("E2E p90 (ms)", "p90_e2el_ms"),
    ("E2E p99 (ms)", "p99_e2el_ms"),
    ("throughput (req/s)", "request_throughput"), ("output throughput (tok/s)", "output_throughput"),
    ("goodput (req/s)", "request_goodput"), ("duration (s)", "duration_s"),
]


@dataclass
class FidelityResult:
    table: pd.DataFrame  # metric, key, real, sim, rel_error
    step_error: dict  # the cost model on the real run's steps
    steps: pd.DataFrame  # one row per real step: shape, measured and predicted seconds
    real: RunResult
    sim: RunResult
    cost_model: str
    header: dict  # the profile's header, when the cost model came from one
    out: Path | None = None
    repeats: list[RunResult] = field(default_factory=list)  # every real run (repeats[0] is `real`)
    machine: dict = field(default_factory=dict)  # where the real runs ran (engine/machine.py)
    machine_diffs: list | None = None  # the profile's machine against it; None: no profile to compare
    replay_cpu: list[dict] = field(default_factory=list)  # per real run: process CPU s, wall s, busy wall s


# --- the two runs ------------------------------------------------------------------------------
def replay_with_steps(cfg: DictConfig):
    """`testbed.app.assembly.run.replay_on_engine`, keeping the replay so its per-step records can be read."""
    from testbed.engine.machine import system_busy_s
    from testbed.engine.setup import build_engine

    t0 = time.perf_counter()
    engine = build_engine(cfg, resolve_model_spec(cfg.model))
    setup = prepare(cfg, model=engine.spec, device_blocks=engine.num_blocks)
    replay = engine.replay(setup.requests, setup.make_loop(cfg, engine.num_blocks), cfg.backend.horizon_s, cfg.seed)
    b0, w0, c0 = system_busy_s(), time.perf_counter(), time.process_time()
    outcome = replay.run()
    # the process's CPU seconds (every thread) over the replay's wall seconds, idle waits for arrivals included,
    # and what every other process ran meanwhile (a neighbour slows the replay even when it keeps its core)
    replay.process_cpu_s, replay.wall_s = time.process_time() - c0, time.perf_counter() - w0
    b1 = system_busy_s()
    replay.others_cpu_s = max(0.0, b1 - b0 - replay.process_cpu_s) if b0 is not None and b1 is not None else None
    result = finish(cfg, setup, outcome, "engine", t0)
    result.summary.update(device=engine.device_name, dtype=str(engine.dtype).removeprefix("torch."))
    return result, replay, setup.cost


def replay_vllm_with_steps(cfg: DictConfig):
    """`testbed.app.assembly.vllm_run.replay_on_vllm`, keeping the replay so its per-step records can be read."""
    from testbed.app.assembly.vllm_run import replay_on_vllm

    replays: list = []
    result = replay_on_vllm(cfg, on_done=lambda setup, replay: replays.append(replay))
    return result, replays[0]


def vllm_problems(cfg: DictConfig) -> list[str]:
    """Why a `backend=vllm` fidelity run would not compare like with like (or not be honest), or []."""
    out = []
    if cfg.policy.name != "vllm" and cfg.backend.scheduler == "native":
        out.append(f"policy={cfg.policy.name} with backend.scheduler=native: vLLM's own scheduler would decide the real "
                   f"run while the simulator runs {cfg.policy.name}; set backend.scheduler=policy")
    if cfg.cost_model.name == "profile" and not cfg.cost_model.profile:
        out.append("backend=vllm needs cost_model.profile=<a profile of vLLM> (testbed-profile backend=vllm on another "
                   "trace window, e.g. trace.start_s=600: the calibration must not be the trace scored here)")
    elif cfg.cost_model.name == "profile":
        from testbed.app.profiling.vllm_profile import trace_key
        from testbed.sim.fitted_cost import read_profile, resolve_profile_path

        path = resolve_profile_path(cfg.cost_model.profile)
        if path.exists() and read_profile(path)[0].get("calibration_trace") == trace_key(cfg):
            out.append(f"cost_model.profile={cfg.cost_model.profile} was calibrated on this very trace; calibrate on "
                       "another window (trace.start_s), seed or trace so the simulator is scored on held-out requests")
    return out


def _with(cfg: DictConfig, **changes) -> DictConfig:
    c = cfg.copy()
    with open_dict(c):
        for dotted, value in changes.items():
            OmegaConf.update(c, dotted.replace("__", "."), value, merge=False)
    return c


def compare(real: dict, sim: dict) -> pd.DataFrame:
    rows = []
    for label, key in METRICS:
        r, s = real.get(key), sim.get(key)
        err = (s - r) / r if r not in (None, 0) and s is not None else float("nan")
        rows.append({"metric": label, "key": key, "real": r, "sim": s, "rel_error": err})
    return pd.DataFrame(rows)


def spread(values: list[float]) -> dict:
    """The real runs' own spread for one metric: mean, min, max, (max - min) / mean, and the largest
    deviation of one run from the mean, max |v / mean - 1| (the error a single run can show by itself)."""
    v = np.array([np.nan if x is None else x for x in values], float)
    if v.size == 0 or not np.isfinite(v).all():
        return {"mean": float("nan"), "min": float("nan"), "max": float("nan"), "spread": float("nan"),
                "max_dev": float("nan")}
    mean = float(v.mean())
    ok = mean != 0 and v.size > 1
    return {"mean": mean, "min": float(v.min()), "max": float(v.max()),
            "spread": float((v.max() - v.min()) / mean) if ok else float("nan"),
            "max_dev": float(np.abs(v / mean - 1).max()) if ok else float("nan")}


def compare_repeats(reals: list[dict], sim: dict) -> pd.DataFrame:
    """Per metric: the real runs (each, and their spread), the simulated value and its relative error
    against the real runs' mean; `within_noise` when that error is no larger than the largest deviation
    of one real run from the mean."""
    rows = []
    for label, key in METRICS:
        values = [r.get(key) for r in reals]
        sp = spread(values)
        r, s = sp["mean"], sim.get(key)
        err = (s - r) / r if np.isfinite(r) and r != 0 and s is not None else float("nan")
        row = {"metric": label, "key": key, "real": r, "sim": s, "rel_error": err, "real_min": sp["min"],
               "real_max": sp["max"], "real_spread": sp["spread"], "real_max_dev": sp["max_dev"],
               "within_noise": bool(np.isfinite(sp["max_dev"]) and abs(err) <= sp["max_dev"])}
        row.update({f"real_{i + 1}": v for i, v in enumerate(values)})
        rows.append(row)
    return pd.DataFrame(rows)


def contended(measured_s, cpu_s) -> np.ndarray:
    """Per step, whether it lost the core to another process (`testbed-profile`'s rule, `lost_the_core`)."""
    from testbed.engine.profile import lost_the_core

    return np.array([lost_the_core(m, c) for m, c in zip(measured_s, cpu_s)], bool)


def step_errors(records, cost, cpu_s=None) -> tuple[pd.DataFrame, dict]:
    """The cost model's prediction for every real step's shape against its measured time; with `cpu_s`
    (the replay thread's CPU seconds per step), also the share of the core the run got and the error
    on the steps no other process disturbed."""
    names = [f.name for f in fields(BatchShape)]
    rows = []
    engine_time = getattr(cost, "engine_time", None)
    for shape, exec_s, iter_s in records:
        rows.append({"kind": shape.kind, **{n: getattr(shape, n) for n in names}, "measured_s": iter_s,
                     "predicted_s": cost.step_time(shape), "execute_s": exec_s,
                     "predicted_execute_s": engine_time(shape) if engine_time else float("nan")})
    df = pd.DataFrame(rows)
    if df.empty:
        return df, {"steps": 0}
    cpu = list(cpu_s) if cpu_s is not None and len(cpu_s) == len(df) else [float("nan")] * len(df)
    df["cpu_s"] = cpu
    df["contended"] = contended(df.measured_s, df.cpu_s)

    def stats(measured, predicted) -> dict:
        ape = np.abs(predicted / measured - 1)
        return {"median_ape": float(np.median(ape)), "p95_ape": float(np.percentile(ape, 95)),
                "total_bias": float(predicted.sum() / measured.sum() - 1)}

    out = {"steps": int(len(df)), "iteration": stats(df.measured_s, df.predicted_s)}
    if engine_time and df.execute_s.notna().all():
        out["execute"] = stats(df.execute_s, df.predicted_execute_s)
    out["by_kind"] = {k: {"steps": int(len(g)), **stats(g.measured_s, g.predicted_s)} for k, g in df.groupby("kind")}
    if df.cpu_s.notna().all():
        quiet = df[~df.contended]
        out["cpu_share"] = float(df.cpu_s.sum() / df.measured_s.sum())  # of the core, over the busy time
        out["contended_steps"] = int(df.contended.sum())
        if len(quiet):
            out["uncontended"] = {"steps": int(len(quiet)), **stats(quiet.measured_s, quiet.predicted_s)}
    out["measured_total_s"] = float(df.measured_s.sum())
    out["predicted_total_s"] = float(df.predicted_s.sum())
    return df, out


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def check_machine(cfg: DictConfig, vllm: bool) -> list:
    """The profile's machine and software against the real run's (device, torch threads included):
    warns naming the differing fields and the command that profiles this machine; returns them."""
    from testbed.app.assembly.run_setup import check_profile_machine
    from testbed.sim.fitted_cost import ProfileCostModel

    cost = ProfileCostModel.from_file(cfg.cost_model.profile)  # fitted once per process, the simulation reuses it
    device = None
    if not vllm:
        import torch

        from testbed.engine.setup import resolve_device

        dev = resolve_device(cfg.backend.device)
        device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return check_profile_machine(cost, cfg, device=device, threads=_torch_threads(),
                                 then="then testbed-fidelity with cost_model.profile=my_profile.csv (or "
                                      "cost_model.profile=null: testbed-fidelity profiles this machine first)")


def run_fidelity(cfg: DictConfig, out_dir: str | Path | None = None) -> FidelityResult:
    """Replay `cfg`'s trace on the engine (or, with backend=vllm, on real vLLM) `fidelity.repeats` times,
    simulate it with `cfg`'s cost model, compare; write to out_dir."""
    from testbed.engine.profile_config import resolve

    pc = resolve(cfg.get("profile"))
    repeats = int(cfg.get("fidelity", {}).get("repeats", 1))
    if repeats < 1:
        raise ValueError(f"fidelity.repeats={repeats}: the real replay must run at least once")
    if pc.threads:
        import torch

        torch.set_num_threads(pc.threads)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        cfg = _with(cfg, output__dir=str(out))
    cfg = without_frontend(cfg, "testbed-fidelity")
    vllm = cfg.backend.name == "vllm"
    if vllm and (problems := vllm_problems(cfg)):
        raise ValueError("testbed-fidelity backend=vllm: " + "; ".join(problems))
    if not vllm and cfg.cost_model.name == "profile" and not cfg.cost_model.profile:
        from testbed.app.profiling.profile import run_profile

        where = (out or Path(cfg.output.dir)) / "profile.csv"
        log.info("no cost_model.profile given: profiling the engine first (%s grid) -> %s", pc.grid, where)
        cfg = _with(cfg, cost_model__profile=str(run_profile(cfg, where)))
    machine_diffs = None
    if cfg.cost_model.name == "profile":  # before the replays: a profile of another machine is said first
        machine_diffs = check_machine(cfg, vllm)
    reals, records, cpus, faults, replay_cpu = [], [], [], [], []
    for i in range(repeats):
        log.info("real replay %d of %d (%s)", i + 1, repeats, "vLLM" if vllm else "engine")
        if vllm:
            real, replay = replay_vllm_with_steps(cfg)
        else:
            real, replay, _ = replay_with_steps(_with(cfg, backend__name="engine"))
        reals.append(real)
        records.append(replay.step_records)
        if hasattr(replay, "process_cpu_s"):
            busy = sum(r[2] for r in replay.step_records)
            others = replay.others_cpu_s
            replay_cpu.append({"process_cpu_s": replay.process_cpu_s, "wall_s": replay.wall_s, "busy_s": busy,
                               "share": replay.process_cpu_s / replay.wall_s if replay.wall_s else float("nan"),
                               "others_cores": others / replay.wall_s if others is not None and replay.wall_s
                               else float("nan")})
        # the replay thread's CPU time stands for the step's work only where that thread does all of it
        own_thread = vllm or (real.summary.get("device") == "cpu" and _torch_threads() == 1)
        cpus.append(getattr(replay, "step_cpu_s", None) if own_thread else None)
        faults.append(getattr(replay, "step_faults", None))
    s0 = reals[0].summary
    sim_kv = {"kv__num_blocks": s0["kv_blocks"]}
    if vllm:  # vLLM's own block size
        sim_kv.update(kv__block_size=s0["block_size"])
    # the real side plans each step after the last one's outputs (our engine; vLLM as the backend runs it): so does the simulation
    sim_cfg = _with(cfg, backend__name="sim", backend__replicas=1, backend__scheduler="native",
                    backend__async_scheduling=False, **sim_kv)
    sim = simulate(sim_cfg)
    cost = prepare(sim_cfg).cost
    table = compare_repeats([r.summary for r in reals], sim.summary)
    frames, per_run = [], []
    for i, (rec, cpu, flt, real) in enumerate(zip(records, cpus, faults, reals)):
        df, err = step_errors(rec, cost, cpu)
        if len(real.steps) == len(df):  # the idle wait before each step (for arrivals), from the run's step series
            end = (real.steps.start + real.steps.duration).to_numpy()
            df["idle_before_s"] = np.r_[real.steps.start.iloc[0], real.steps.start.to_numpy()[1:] - end[:-1]] if len(df) else []
        if flt is not None and len(flt) == len(df):
            df["minor_faults"] = flt  # page faults taken during execute(): heap growth, see engine/replay.py
        frames.append(df.assign(repeat=i + 1))
        per_run.append(err)
    steps = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    pooled_cpu = steps.cpu_s.tolist() if "cpu_s" in steps else None
    _, step_err = step_errors([r for rec in records for r in rec], cost, pooled_cpu)  # over every repeat's steps
    if repeats > 1:  # how much the cost model's error itself moves from run to run (the machine's noise)
        step_err["by_repeat"] = {i + 1: {"steps": e["steps"], **e["iteration"],
                                         **{k: e[k] for k in ("cpu_share", "contended_steps") if k in e}}
                                 for i, e in enumerate(per_run) if e.get("steps")}
    from testbed.engine.machine import describe_machine

    machine = describe_machine(device=s0.get("device"), dtype=s0.get("dtype"),
                               threads=None if vllm else _torch_threads())
    res = FidelityResult(table, step_err, steps, reals[0], sim, cost.name, dict(getattr(cost, "header", {})), out,
                         reals, machine, machine_diffs, replay_cpu)
    if out is not None:
        write(res, cfg, out)
    return res


# --- writing ---------------------------------------------------------------------------------------
def _fmt(x) -> str:
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "-"
    return f"{x:.4g}"


def markdown(res: FidelityResult, cfg: DictConfig) -> str:
    s, header = res.real.summary, res.header
    n = max(len(res.repeats), 1)
    what = f"vLLM {s.get('vllm_version')} ({s.get('vllm_scheduler')} scheduler)" if s.get("backend") == "vllm" else "the engine"
    lines = [f"# Fidelity: {cfg.policy.name} on {cfg.trace.name}, {s['model']} on {s.get('device')} "
             f"({s.get('dtype')}), {what} vs the simulator, cost model {res.cost_model}", ""]
    if header:
        src = (f"fitted from a calibration replay on vLLM ({header.get('points')} steps of "
               f"{header.get('calibration_requests')} requests: {header.get('calibration')})"
               if header.get("source") == "vllm-replay" else f"grid {header.get('grid')}")
        lines += [f"Profile: {header.get('model')} on {header.get('device')}, {header.get('dtype')}, torch "
                  f"{header.get('torch')}, {header.get('torch_threads')} thread(s), {src}, "
                  f"measured {header.get('date')}.", ""]
    m = res.machine
    if m:
        lines += [f"Real run(s) on: {m.get('cpu_model')} ({m.get('cpus_usable')} of {m.get('cpu_count')} CPUs usable), "
                  f"device {m.get('device')}, torch {m.get('torch')} with {m.get('torch_threads')} thread(s) "
                  f"(OMP_NUM_THREADS={m.get('omp_num_threads')}), transformers {m.get('transformers')}, Python "
                  f"{m.get('python')}, testbed {m.get('testbed')}.", ""]
    if res.machine_diffs is not None:
        from testbed.engine.machine import difference_text, profile_command

        if res.machine_diffs:
            lines += [f"**The profile is another machine's or software's**: {difference_text(res.machine_diffs)}. "
                      f"Its step times may not hold here; profile this machine first: "
                      f"`{profile_command(header, model_preset())}`.", ""]
        else:
            lines += ["The profile's machine and software match the real run's in every field that moves step "
                      "times.", ""]
    done = "/".join(str(r.summary["completed"]) for r in res.repeats or [res.real])
    steps = "/".join(str(r.summary["num_steps"]) for r in res.repeats or [res.real])
    lines += [f"{s['num_requests']} requests ({done} finished in the {n} real run(s), "
              f"{res.sim.summary['completed']} in the simulator), {steps} real steps, "
              f"{res.sim.summary['num_steps']} simulated steps.", ""]
    if n > 1:
        lines += [f"real: the mean of {n} real replays; real spread: (max - min) / mean over them; max dev: the "
                  "largest deviation of one real run from their mean; sim error: (sim - real mean) / real mean.", ""]
        head = ["metric", "real (mean)", "real min", "real max", "real spread", "max dev", "sim", "sim error"]
    else:
        head = ["metric", "real", "sim", "rel. error"]
    pct = lambda x, sign="+": "-" if not np.isfinite(x) else f"{x:{sign}.1%}"  # noqa: E731
    rows = [(r.metric, _fmt(r.real), _fmt(r.real_min), _fmt(r.real_max), pct(r.real_spread, ""), pct(r.real_max_dev, ""),
             _fmt(r.sim), pct(r.rel_error)) if n > 1 else (r.metric, _fmt(r.real), _fmt(r.sim), pct(r.rel_error))
            for r in res.table.itertuples()]
    lines.append(markdown_table(head, rows, ["left"] + ["right"] * (len(head) - 1)))
    e = res.step_error
    if e.get("steps"):
        it = e["iteration"]
        over = f"the {n} real runs' {e['steps']} steps" if n > 1 else f"the real run's {e['steps']} steps"
        errs = lambda label, v: (label, v["steps"], f"{v['median_ape']:.1%}", f"{v['p95_ape']:.1%}",  # noqa: E731
                                 f"{v['total_bias']:+.1%}")
        rows = [errs("whole iteration", it | {"steps": e["steps"]})]
        if "execute" in e:
            part = ("vLLM's step only (schedule() to return; same prediction)" if s.get("backend") == "vllm"
                    else "execute() only (engine part of the model)")
            rows.append(errs(part, e["execute"] | {"steps": e["steps"]}))
        rows += [errs(f"{k} steps, whole iteration", v) for k, v in e["by_kind"].items()]
        if "uncontended" in e:
            rows.append(errs("steps no other process disturbed (wall <= 1.1 x CPU)", e["uncontended"]))
        for i, v in e.get("by_repeat", {}).items():
            share = f", {v['cpu_share']:.0%} of the core" if "cpu_share" in v else ""
            rows.append(errs(f"real run {i}, whole iteration{share}", v))
        lines += ["", f"Per-step error of the cost model on {over} (prediction for each "
                      f"real batch's shape vs its measured time):", "",
                  markdown_table(["steps", "count", "median APE", "p95 APE", "total bias"], rows,
                                 ["left", "right", "right", "right", "right"])]
        if "cpu_share" in e:
            lines += ["", f"Over the real runs' busy time the replay thread had {e['cpu_share']:.0%} of a core "
                          f"(CPU seconds / wall seconds); {e['contended_steps']} of {e['steps']} steps lost it to "
                          "another process (wall > 1.1 x CPU)."]
    if res.replay_cpu:
        runs = "; ".join(f"{c['process_cpu_s']:.2f} CPU s over {c['wall_s']:.2f} wall s ({c['share']:.0%}), "
                         f"{c['busy_s'] / c['wall_s']:.0%} of it in steps, other processes busy on "
                         f"{c['others_cores']:.2f} cores meanwhile" for c in res.replay_cpu)
        lines += ["", f"The replay process's share of the core (process CPU time / replay wall time, idle waits "
                      f"for arrivals included), per real run: {runs}. Other processes slow the replay even while it "
                      "keeps its core (shared caches, memory bandwidth, SMT siblings): a quiet machine has them "
                      "near 0."]
    return "\n".join(lines) + "\n"


def plot_cdfs(real: pd.DataFrame, sim: pd.DataFrame, path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 3.8))
    FigureCanvasAgg(fig)
    for ax, (col, label) in zip(fig.subplots(1, 3), (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"),
                                                    ("e2el_ms", "E2E latency (ms)"))):
        for df, name, style in ((real, "real", "-"), (sim, "simulated", "--")):
            v = np.sort(df.loc[df.outcome == "finished", col].dropna().to_numpy(float))
            if v.size:
                ax.step(v, np.arange(1, v.size + 1) / v.size, style, where="post", label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(res: FidelityResult, cfg: DictConfig, out: Path) -> None:
    """The files, under a stop block: a signal then lets them finish (none is half-written)."""
    from testbed.app.entry.stop import stop_on_signals

    with stop_on_signals():
        _write(res, cfg, out)


def _write(res: FidelityResult, cfg: DictConfig, out: Path) -> None:
    from testbed.app.analysis.results import write_results

    out.mkdir(parents=True, exist_ok=True)
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    runs = [("real" if i == 0 else f"real_{i + 1}", r) for i, r in enumerate(res.repeats or [res.real])]
    for name, r in runs + [("sim", res.sim)]:
        write_results(out / name, r.requests, r.steps, r.summary, cfg_yaml, run_info(r))
    res.table.to_csv(out / "fidelity.csv", index=False)
    res.steps.to_csv(out / "steps.csv", index=False)
    (out / "fidelity.md").write_text(markdown(res, cfg))
    (out / "fidelity.json").write_text(json.dumps(
        {"cost_model": res.cost_model, "repeats": max(len(res.repeats), 1), "machine": res.machine,
         "profile_machine_differences": res.machine_diffs, "replay_cpu": res.replay_cpu,
         "metrics": {r["key"]: {k: v for k, v in r.items() if k not in ("key", "metric")}
                     for r in res.table.to_dict("records")},
         "step_error": res.step_error}, indent=2, default=float) + "\n")
    (out / "config.yaml").write_text(cfg_yaml)
    s = res.real.summary
    plot_cdfs(res.real.requests, res.sim.requests, out / "fidelity_cdf.png",
              f"{cfg.policy.name} on {cfg.trace.name}: {s['model']} on {s.get('device')} vs simulator ({res.cost_model})")


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    cfg = without_frontend(cfg, "testbed-fidelity")
    if cfg.backend.name == "vllm":  # the real run is vLLM's
        check_config(cfg)
    else:
        check_config(cfg, backend="engine")  # the real run is the engine's, whatever backend.name says
    res = run_fidelity(cfg, cfg.output.dir)
    print(markdown(res, cfg))
    print(f"results: {res.out}")
    return {"metrics": res.table.to_dict("records"), "step_error": res.step_error}


if __name__ == "__main__":
    main()
