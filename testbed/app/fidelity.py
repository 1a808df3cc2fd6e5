"""`testbed-fidelity`: one trace on the real engine and in the simulator calibrated from it.

    testbed-fidelity model=tiny_llama backend.device=cpu cost_model=profile \
        cost_model.profile=profiles/cpu_tiny_llama.csv +profile.threads=1 \
        trace.max_requests=100 trace.rate_scale=20 trace.max_prompt_len=256 trace.max_output_len=32

(`python -m testbed.app.fidelity ...` is the same; `cost_model.profile=null` profiles the engine
first, with the `profile` section's grid, and writes that profile beside the results.)

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
from dataclasses import dataclass, fields
from pathlib import Path

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf, open_dict

from testbed.app.cli import CONF_DIR
from testbed.core.cost import BatchShape
from testbed.app.run import RunResult, _obj, finish, prepare, run_info, simulate
from testbed.app.validate import check_config

log = logging.getLogger("testbed.app.fidelity")

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


# --- the two runs ------------------------------------------------------------------------------
def replay_with_steps(cfg: DictConfig):
    """`testbed.app.run.replay_on_engine`, keeping the replay so its per-step records can be read."""
    from testbed.engine.setup import build_engine
    from testbed.core.specs import ModelSpec

    t0 = time.perf_counter()
    engine = build_engine(cfg, _obj(cfg.model, ModelSpec))
    setup = prepare(cfg, model=engine.spec, device_blocks=engine.num_blocks)
    replay = engine.replay(setup.requests, setup.make_loop(cfg, engine.num_blocks), cfg.backend.horizon_s, cfg.seed)
    result = finish(cfg, setup, replay.run(), "engine", t0)
    result.summary.update(device=engine.device_name, dtype=str(engine.dtype).removeprefix("torch."))
    return result, replay, setup.cost


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


def step_errors(records, cost) -> tuple[pd.DataFrame, dict]:
    """The cost model's prediction for every real step's shape against its measured time."""
    names = [f.name for f in fields(BatchShape)]
    rows = []
    engine_time = getattr(cost, "engine_time", None)
    for shape, exec_s, iter_s in records:
        kind = ("mixed" if shape.num_decode_seqs else "prefill") if shape.num_prefill_seqs else "decode"
        rows.append({"kind": kind, **{n: getattr(shape, n) for n in names}, "measured_s": iter_s,
                     "predicted_s": cost.step_time(shape), "execute_s": exec_s,
                     "predicted_execute_s": engine_time(shape) if engine_time else float("nan")})
    df = pd.DataFrame(rows)
    if df.empty:
        return df, {"steps": 0}

    def stats(measured, predicted) -> dict:
        ape = np.abs(predicted / measured - 1)
        return {"median_ape": float(np.median(ape)), "p95_ape": float(np.percentile(ape, 95)),
                "total_bias": float(predicted.sum() / measured.sum() - 1)}

    out = {"steps": int(len(df)), "iteration": stats(df.measured_s, df.predicted_s)}
    if engine_time:
        out["execute"] = stats(df.execute_s, df.predicted_execute_s)
    out["by_kind"] = {k: {"steps": int(len(g)), **stats(g.measured_s, g.predicted_s)} for k, g in df.groupby("kind")}
    out["measured_total_s"] = float(df.measured_s.sum())
    out["predicted_total_s"] = float(df.predicted_s.sum())
    return df, out


def run_fidelity(cfg: DictConfig, out_dir: str | Path | None = None) -> FidelityResult:
    """Replay `cfg`'s trace on the engine, simulate it with `cfg`'s cost model, compare; write to out_dir."""
    from testbed.engine.profile_config import resolve

    pc = resolve(cfg.get("profile"))
    if pc.threads:
        import torch

        torch.set_num_threads(pc.threads)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        cfg = _with(cfg, output__dir=str(out))
    if cfg.cost_model.name == "profile" and not cfg.cost_model.profile:
        from testbed.engine.profile import run_profile

        where = (out or Path(cfg.output.dir)) / "profile.csv"
        log.info("no cost_model.profile given: profiling the engine first (%s grid) -> %s", pc.grid, where)
        cfg = _with(cfg, cost_model__profile=str(run_profile(cfg, where)))
    real, replay, cost = replay_with_steps(_with(cfg, backend__name="engine"))
    sim = simulate(_with(cfg, backend__name="sim", backend__replicas=1, kv__num_blocks=real.summary["kv_blocks"]))
    table = compare(real.summary, sim.summary)
    steps, step_err = step_errors(replay.step_records, cost)
    res = FidelityResult(table, step_err, steps, real, sim, cost.name, dict(getattr(cost, "header", {})), out)
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
    lines = [f"# Fidelity: {cfg.policy.name} on {cfg.trace.name}, {s['model']} on {s.get('device')} "
             f"({s.get('dtype')}), cost model {res.cost_model}", ""]
    if header:
        lines += [f"Profile: {header.get('model')} on {header.get('device')}, {header.get('dtype')}, torch "
                  f"{header.get('torch')}, {header.get('torch_threads')} thread(s), grid {header.get('grid')}, "
                  f"measured {header.get('date')}.", ""]
    lines += [f"{s['num_requests']} requests ({s['completed']} finished on the engine, "
              f"{res.sim.summary['completed']} in the simulator), {s['num_steps']} engine steps, "
              f"{res.sim.summary['num_steps']} simulated steps.", "",
              "| metric | real | sim | rel. error |", "|---|---:|---:|---:|"]
    for r in res.table.itertuples():
        err = "-" if not np.isfinite(r.rel_error) else f"{r.rel_error:+.1%}"
        lines.append(f"| {r.metric} | {_fmt(r.real)} | {_fmt(r.sim)} | {err} |")
    e = res.step_error
    if e.get("steps"):
        it = e["iteration"]
        lines += ["", f"Per-step error of the cost model on the real run's {e['steps']} steps (prediction for each "
                      f"real batch's shape vs its measured time):", "",
                  "| steps | count | median APE | p95 APE | total bias |", "|---|---:|---:|---:|---:|",
                  f"| whole iteration (plan + execute + complete) | {e['steps']} | {it['median_ape']:.1%} | "
                  f"{it['p95_ape']:.1%} | {it['total_bias']:+.1%} |"]
        if "execute" in e:
            x = e["execute"]
            lines.append(f"| execute() only (engine part of the model) | {e['steps']} | {x['median_ape']:.1%} | "
                         f"{x['p95_ape']:.1%} | {x['total_bias']:+.1%} |")
        for k, v in e["by_kind"].items():
            lines.append(f"| {k} steps, whole iteration | {v['steps']} | {v['median_ape']:.1%} | {v['p95_ape']:.1%} | "
                         f"{v['total_bias']:+.1%} |")
    return "\n".join(lines) + "\n"


def plot_cdfs(real: pd.DataFrame, sim: pd.DataFrame, path: Path, title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 3.8))
    FigureCanvasAgg(fig)
    for ax, (col, label) in zip(fig.subplots(1, 3), (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"),
                                                    ("e2el_ms", "E2E latency (ms)"))):
        for df, name, style in ((real, "real (engine)", "-"), (sim, "simulated", "--")):
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
    from testbed.app.results import write_results

    out.mkdir(parents=True, exist_ok=True)
    cfg_yaml = OmegaConf.to_yaml(cfg, resolve=True)
    for name, r in (("real", res.real), ("sim", res.sim)):
        write_results(out / name, r.requests, r.steps, r.summary, cfg_yaml, run_info(r))
    res.table.to_csv(out / "fidelity.csv", index=False)
    res.steps.to_csv(out / "steps.csv", index=False)
    (out / "fidelity.md").write_text(markdown(res, cfg))
    (out / "fidelity.json").write_text(json.dumps(
        {"cost_model": res.cost_model, "metrics": {r.key: {"real": r.real, "sim": r.sim, "rel_error": r.rel_error}
                                                   for r in res.table.itertuples()},
         "step_error": res.step_error}, indent=2, default=float) + "\n")
    (out / "config.yaml").write_text(cfg_yaml)
    s = res.real.summary
    plot_cdfs(res.real.requests, res.sim.requests, out / "fidelity_cdf.png",
              f"{cfg.policy.name} on {cfg.trace.name}: {s['model']} on {s.get('device')} vs simulator ({res.cost_model})")


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    check_config(cfg, backend="engine")  # the real run is the engine's, whatever backend.name says
    res = run_fidelity(cfg, cfg.output.dir)
    print(markdown(res, cfg))
    print(f"results: {res.out}")
    return {"metrics": res.table.to_dict("records"), "step_error": res.step_error}


if __name__ == "__main__":
    main()
