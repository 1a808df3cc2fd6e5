"""`testbed-validate`: replay real serving runs in the simulator and score it, per run and metric.

    testbed-validate validate.runs=../shared/calibration/vllm_h100_runs cost_model=kernels frontend=vllm_api
    testbed-validate validate.runs=... validate.fit='[cost_model.step_overhead_s,frontend.request_s]'

Why: a simulated number is worth what the simulator's error on real runs is. Each run
(`testbed.app.real_runs`) is rebuilt exactly: its model from its own config.json, its tensor
and pipeline parallelism, its scheduler limits (max_num_batched_tokens, max_num_seqs,
max_model_len), gpu_memory_utilization and async scheduling, and its workload (`testbed.traces.shared_prefix`:
the shared-prefix prompt groups in their cycling order, the stage rates and durations, the
output lengths); every other key (GPU, cost model, front end, policy, KV) is this command's
config. Per load stage it compares the client-side means the load generator measured (TTFT,
E2E) and TPOT derived as the runs' README says, (mean E2E - mean TTFT) / (output_len - 1),
with the same figures of the simulated run. Overloaded stages (`Stage.overloaded`) are shown,
with whether the simulator also saturates, but not scored.

`validate.fit=[keys]` fits those config keys (non-negative numbers: overhead terms, front-end
latencies) to the runs by least squares on the relative errors, and, with
`validate.leave_one_model_out=true`, scores each model with the keys fitted on the other models
only (a whole fit from the config's starting values, the held-out model's runs never simulated
until it is scored): the figure that says how the fit generalises to a model it has not seen. Written to
`output.dir`: validate.csv (one row per run and stage), validate.md (the tables) and
validate.json (the medians and fitted values).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import hydra
import numpy as np
import pandas as pd
from omegaconf import DictConfig, OmegaConf, open_dict

from testbed.app.cli import CONF_DIR
from testbed.app.real_runs import RealRun, load_runs
from testbed.app.validate import check_config
from testbed.traces.shared_prefix import shared_prefix_requests

log = logging.getLogger("testbed.app.validate_runs")
METRICS = ("ttft", "e2e", "tpot")


@dataclass
class StageResult:
    run: str
    model: str
    stage: int
    rate: float
    overloaded: bool
    sim_overloaded: bool
    real: dict
    sim: dict

    def error(self, metric: str) -> float:
        return (self.sim[metric] - self.real[metric]) / self.real[metric]


def run_config(cfg: DictConfig, run: RealRun, values: dict[str, float] | None = None) -> DictConfig:
    """`cfg` with the run's server settings (and `values` for fitted keys) set."""
    c = cfg.copy()
    with open_dict(c):
        c.parallel.tensor_parallel_size = run.tensor_parallel
        c.parallel.pipeline_parallel_size = run.pipeline_parallel
        c.scheduler.max_num_batched_tokens = run.max_num_batched_tokens
        c.scheduler.max_num_seqs = run.max_num_seqs
        c.scheduler.max_model_len = run.max_model_len
        c.kv.memory_utilization = run.gpu_memory_utilization
        c.backend.async_scheduling = run.async_scheduling
        c.cost_model.fallback = None  # a validation scores the cost model it was given, never a stand-in
        c.model.config_json = str(run.model_config)
        c.output.progress = False
        # an overloaded stage's queue would take (simulated) hours to drain: stop the clock
        # `validate.drain_s` after the last stage; what is left counts as not finished
        c.backend.horizon_s = sum(s.duration_s for s in run.stages) + len(run.stages) * c.validate.stage_gap_s \
            + c.validate.drain_s
        for key, v in (values or {}).items():
            OmegaConf.update(c, key, float(v), merge=False)
    return c


def run_requests(run: RealRun, seed: int, stage_gap_s: float):
    """The run's workload, with the prompts stretched to the length the client counted."""
    w = run.workload
    nominal = w.system_prompt_len + w.question_len
    measured = [s.mean_prompt_len for s in run.stages if s.succeeded]
    scale = float(np.mean(measured)) / nominal if measured else 1.0
    stages = [(s.rate, s.duration_s) for s in run.stages]
    return shared_prefix_requests(num_groups=w.num_groups, prompts_per_group=w.prompts_per_group,
                                  system_prompt_len=w.system_prompt_len, question_len=w.question_len,
                                  output_len=w.output_len, stages=stages, prompt_scale=scale,
                                  stage_gap_s=stage_gap_s, seed=seed)


def simulate_run(cfg: DictConfig, run: RealRun, values: dict[str, float] | None = None) -> list[StageResult]:
    from testbed.app.run import resolve_model_spec, simulate

    c = run_config(cfg, run, values)
    requests, starts = run_requests(run, cfg.seed, cfg.validate.stage_gap_s)
    result = simulate(c, model=resolve_model_spec(c.model), requests=requests)
    table = result.requests
    out = []
    bounds = starts + [len(requests)]
    for k, stage in enumerate(run.stages):
        rows = table.iloc[bounds[k]:bounds[k + 1]]
        done = rows[rows["outcome"] == "finished"]
        n_out = run.workload.output_len
        if len(done):
            ttft, e2e = float(done["ttft_ms"].mean()) / 1e3, float(done["e2el_ms"].mean()) / 1e3
            span = float(done["finish_s"].max() - rows["arrival_s"].min())  # like the client's, drain included
            sim_over = len(done) < len(rows) or len(done) / span < 0.9 * len(rows) / stage.duration_s
        else:
            ttft = e2e = math.nan
            sim_over = True
        real = {"ttft": stage.mean_ttft_s, "e2e": stage.mean_e2e_s,
                "tpot": (stage.mean_e2e_s - stage.mean_ttft_s) / max(n_out - 1, 1)}
        sim = {"ttft": ttft, "e2e": e2e, "tpot": (e2e - ttft) / max(n_out - 1, 1)}
        out.append(StageResult(run.name, run.model_name, k, stage.rate, stage.overloaded, bool(sim_over), real, sim))
    return out


def scored(results: list[StageResult]) -> list[StageResult]:
    return [r for r in results if not r.overloaded]


def median_abs_errors(results: list[StageResult]) -> dict[str, float]:
    rs = scored(results)
    return {m: float(np.median([abs(r.error(m)) for r in rs])) if rs else math.nan for m in METRICS}


def simulate_all(cfg: DictConfig, runs: list[RealRun], values: dict[str, float] | None = None,
                 scored_only: bool = False) -> list[StageResult]:
    """Every run's stages, the runs simulated in parallel (`validate.jobs` processes); `scored_only`
    skips runs whose every stage is overloaded (a fit has no use for them, and they are the slowest)."""
    todo = [r for r in runs if not scored_only or not all(s.overloaded for s in r.stages)]
    jobs = min(cfg.validate.jobs or os.cpu_count() or 1, len(todo))
    if jobs <= 1:
        return [x for run in todo for x in simulate_run(cfg, run, values)]
    with ProcessPoolExecutor(jobs) as pool:
        parts = list(pool.map(simulate_run, [cfg] * len(todo), todo, [values] * len(todo)))
    return [x for part in parts for x in part]


def _residuals(results: list[StageResult]) -> np.ndarray:
    """Relative errors of every scored stage's metrics, in the results' order."""
    return np.array([r.error(m) for r in scored(results) for m in METRICS])


def gauss_newton_step(cfg: DictConfig, runs: list[RealRun], keys: list[str], x: np.ndarray) -> np.ndarray:
    """The keys that minimise the residuals linearised at `x` (each key >= 0): the residuals and
    their derivatives in every key by finite differences of whole replays, then bounded linear
    least squares."""
    from scipy.optimize import lsq_linear

    r0 = _residuals(simulate_all(cfg, runs, dict(zip(keys, x)), scored_only=True))
    columns = []
    for i, k in enumerate(keys):
        step = abs(x[i]) * cfg.validate.fit_step if x[i] else 1e-5  # relative: the keys' units differ by orders
        moved = x.copy()
        moved[i] += step
        columns.append((_residuals(simulate_all(cfg, runs, dict(zip(keys, moved)), scored_only=True)) - r0) / step)
        log.info("validate: d/d %s done (%d of %d)", k, i + 1, len(keys))
    scale = np.where(x > 0, x, 1e-3)
    sol = lsq_linear(np.column_stack(columns) * scale, -r0, bounds=(-x / scale, np.inf))
    return x + sol.x * scale


def fit(cfg: DictConfig, runs: list[RealRun], keys: list[str]) -> dict[str, float]:
    """Gauss-Newton over `keys` (each >= 0, starting from the config's values) on the relative
    errors of TTFT, E2E and TPOT of every scored stage of `runs`: `validate.fit_iterations` steps."""
    x = np.array([float(OmegaConf.select(cfg, k)) for k in keys])
    for it in range(cfg.validate.fit_iterations):
        x = gauss_newton_step(cfg, runs, keys, x)
        log.info("validate: iteration %d: %s", it + 1, dict(zip(keys, x.round(6))))
    return dict(zip(keys, x.tolist()))


def validate(cfg: DictConfig) -> dict:
    t0 = time.perf_counter()
    vc = cfg.validate
    if not vc.runs:
        raise ValueError("validate.runs=<folder of real runs> is required (e.g. ../shared/calibration/vllm_h100_runs)")
    runs = load_runs(vc.runs)
    keys = list(vc.fit)
    for k in keys:
        v = OmegaConf.select(cfg, k)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ValueError(f"validate.fit: {k} is not a numeric config key (its value: {v!r})")
    report: dict = {"runs": str(vc.runs), "cost_model": cfg.cost_model.name, "hardware": cfg.hardware.name,
                    "frontend": cfg.get("frontend", {}).get("name", "none"), "policy": cfg.policy.name}
    if keys:
        fitted_all = fit(cfg, runs, keys)
        report["fitted_on_all_models"] = fitted_all
        in_sample = simulate_all(cfg, runs, fitted_all)
        report["in_sample_median_abs_error"] = median_abs_errors(in_sample)
        results = in_sample
        models = sorted({r.model_name for r in runs if not all(s.overloaded for s in r.stages)})
        if vc.leave_one_model_out and len(models) > 1:
            held_out, per_model = [], {}
            for m in models:  # a whole fit without model m, from the config's starting values
                values = per_model[m] = fit(cfg, [r for r in runs if r.model_name != m], keys)
                held_out += simulate_all(cfg, [r for r in runs if r.model_name == m], values)
            report["fitted_without_model"] = per_model
            report["leave_one_model_out_median_abs_error"] = median_abs_errors(held_out)
            results = held_out
    else:
        results = simulate_all(cfg, runs)
    report["median_abs_error"] = median_abs_errors(results)
    report["scored_stages"] = len(scored(results))
    report["overloaded_stages"] = len(results) - len(scored(results))
    report["wall_s"] = time.perf_counter() - t0
    write(cfg.output.dir, results, report)
    return report


def results_frame(results: list[StageResult]) -> pd.DataFrame:
    rows = []
    for r in results:
        row = {"run": r.run, "model": r.model, "stage": r.stage, "rate": r.rate, "overloaded": r.overloaded,
               "sim_overloaded": r.sim_overloaded}
        for m in METRICS:
            row[f"real_{m}_ms"] = r.real[m] * 1e3
            row[f"sim_{m}_ms"] = r.sim[m] * 1e3
            row[f"{m}_error"] = r.error(m)
        rows.append(row)
    return pd.DataFrame(rows)


def write(out_dir: str, results: list[StageResult], report: dict) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    df = results_frame(results)
    df.to_csv(out / "validate.csv", index=False)
    (out / "validate.json").write_text(json.dumps(report, indent=2))
    md = markdown(df, report)
    (out / "validate.md").write_text(md)
    print(md)


def markdown(df: pd.DataFrame, report: dict) -> str:
    lines = ["| run | stage | rate | real TTFT ms | sim | err | real E2E ms | sim | err | real TPOT ms | sim | err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for _, r in df.iterrows():
        note = " (overloaded" + (", sim too)" if r["sim_overloaded"] else ", sim not)") if r["overloaded"] else ""
        cells = [f"{r['run']}{note}", str(r["stage"]), f"{r['rate']:g}"]
        for m in METRICS:
            cells += [f"{r[f'real_{m}_ms']:.1f}", f"{r[f'sim_{m}_ms']:.1f}", f"{r[f'{m}_error']:+.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    med = report["median_abs_error"]
    which = "leave-one-model-out " if "leave_one_model_out_median_abs_error" in report else ""
    lines += ["", f"{which}median absolute error over {report['scored_stages']} scored stages "
              f"({report['overloaded_stages']} overloaded, not scored): "
              + ", ".join(f"{m.upper()} {med[m]:.1%}" for m in METRICS)]
    if "fitted_on_all_models" in report:
        lines.append("fitted on all models: " + ", ".join(f"{k}={v:.4g}" for k, v in report["fitted_on_all_models"].items()))
        ins = report["in_sample_median_abs_error"]
        lines.append("in-sample median absolute error: " + ", ".join(f"{m.upper()} {ins[m]:.1%}" for m in METRICS))
    return "\n".join(lines) + "\n"


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    check_config(cfg)
    validate(cfg)


if __name__ == "__main__":
    main()
