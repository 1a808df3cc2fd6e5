"""`testbed-validate`: replay real serving runs in the simulator and score it, per run, stage and metric.

    testbed-validate validate.runs=../shared/calibration/vllm_h100_runs cost_model=kernels frontend=vllm_api
    testbed-validate 'validate.runs=[../shared/calibration/vllm_h100_runs,../shared/calibration/blis_trainval_runs]'
    testbed-validate validate.runs=... validate.fit='[cost_model.step_overhead_s,frontend.request_s]'

Why: a simulated number is worth what the simulator's error on real runs is. Each run
(`testbed.app.analysis.real_runs`; `validate.runs` is one folder of runs or a list of them) is rebuilt exactly
(`testbed.app.analysis.validate_replay`): its model from its own config.json, its tensor and pipeline
parallelism, its scheduler limits (max_num_batched_tokens, max_num_seqs, max_model_len),
gpu_memory_utilization and async scheduling, and its workload (`testbed.traces.shared_prefix`: the
shared-prefix prompt groups in their cycling order, the stage rates and durations, the output
lengths); every other key (GPU, cost model, front end, policy, KV) is this command's config. Per load
stage, and over the whole run where the run has its summary, it compares what the load generator
measured with the same figures of the simulated run, defined as the load generator defines them
(`testbed.app.analysis.inference_perf`): mean, median, p90 and p99 of TTFT and E2E, TPOT derived as the runs' README
says, (mean E2E - mean TTFT) / (output_len - 1), and the client's inter-token latency (mean, p90, p99).
Overloaded stages (`Stage.overloaded`) are shown, with whether the simulator also saturates, but not
scored.

`validate.fit=[keys]` fits those config keys (non-negative numbers: overhead terms, front-end
latencies) to the runs by least squares on the relative errors of the mean TTFT, E2E and TPOT
(`testbed.app.analysis.validate_fit`), and, with `validate.leave_one_model_out=true`, scores each model with the
keys fitted on the other models only (a whole fit from the config's starting values; the held-out
model's runs play no part in it): the figure that says how the fit generalises to a model it has not
seen, reported per model with the median and the worst model. Written to `output.dir`
(`testbed.app.analysis.validate_report`): validate.csv, validate.md and validate.json.
"""
from __future__ import annotations

import logging
import time

import hydra
from omegaconf import DictConfig, OmegaConf

from testbed.app.entry.cli import CONF_DIR
from testbed.app.analysis.real_runs import load_run_sets
from testbed.app.entry.stop import stop_on_signals
from testbed.app.assembly.validate import check_config
from testbed.app.analysis.validate_fit import Replays, ReplaysStopped, fit_runs, fit_steps, run_fits, then_replay
from testbed.app.analysis.validate_replay import median_abs_errors, scored, simulate_run  # noqa: F401 (simulate_run: the API)
from testbed.app.analysis.validate_report import by_model, write

log = logging.getLogger("testbed.app.analysis.validate_runs")


def _folders(runs) -> list[str]:
    """`validate.runs` as a list of folders (one folder, or a list of them)."""
    if runs is None or runs == "" or (not isinstance(runs, str) and len(runs) == 0):
        raise ValueError("validate.runs=<folder of real runs> (or a list of folders) is required "
                         "(e.g. ../shared/calibration/vllm_h100_runs)")
    if isinstance(runs, str):
        return [runs]
    return [str(f) for f in (OmegaConf.to_container(runs) if not isinstance(runs, list) else runs)]


def validate(cfg: DictConfig) -> dict:
    """The replays, scored and written. A signal (app/entry/stop.py) ends the replays: those done are scored
    and written, marked `interrupted` (a fit stopped part way fits nothing: what it replayed is counted)."""
    with stop_on_signals() as stop:
        return _validate(cfg, stop)


def _validate(cfg: DictConfig, stop) -> dict:
    t0 = time.perf_counter()
    vc = cfg.validate
    folders = _folders(vc.runs)
    runs = load_run_sets(folders)
    keys = list(vc.fit)
    for k in keys:
        v = OmegaConf.select(cfg, k)
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ValueError(f"validate.fit: {k} is not a numeric config key (its value: {v!r})")
    report: dict = {"runs": folders, "cost_model": cfg.cost_model.name, "hardware": cfg.hardware.name,
                    "frontend": cfg.get("frontend", {}).get("name", "none"), "policy": cfg.policy.name}
    replays = Replays(cfg, stop)
    try:
        if keys:
            report["starting_values"] = {k: float(OmegaConf.select(cfg, k)) for k in keys}
            models = sorted({r.model_name for r in fit_runs(runs)})
            held_out = models if vc.leave_one_model_out and len(models) > 1 else []
            # the fit on all models and, for each model, a whole fit without it (from the config's starting
            # values: the held-out model's runs play no part in it), all driven together, each one's scoring
            # replays (the held-out model's runs at the fit without it; every run at the fit on all, except, with
            # models held out, a held-out model's run with no scored stage: the fit on all scores it nowhere)
            # asked as it ends
            in_sample_runs = [r for r in runs if r.model_name not in held_out] + fit_runs(
                [r for r in runs if r.model_name in held_out])
            fits = run_fits(replays, [then_replay(fit_steps(cfg, runs, keys), in_sample_runs)] + [
                then_replay(fit_steps(cfg, [r for r in runs if r.model_name != m], keys),
                            [r for r in runs if r.model_name == m]) for m in held_out])
            fitted_all = report["fitted_on_all_models"] = fits[0].values
            report["fit"] = {"method": vc.fit_method, "steps": fits[0].steps, "jacobians": fits[0].jacobians,
                             "squared_error": fits[0].cost, "start_squared_error": fits[0].start_cost}
            per_model = {m: f.values for m, f in zip(held_out, fits[1:])}
            report["fit"]["without_model"] = {m: {"steps": f.steps, "jacobians": f.jacobians, "squared_error": f.cost}
                                              for m, f in zip(held_out, fits[1:])}
            # a model with no scored stage had no fit of its own left out: it is scored with the fit on all
            # (every one of these replays was asked by `then_replay`: found done)
            asks = [(r, fitted_all) for r in in_sample_runs] + [(r, per_model.get(r.model_name, fitted_all)) for r in runs]
            got = replays.get(asks)
            in_sample = got[:len(in_sample_runs)]
            results = got[len(in_sample_runs):]
            report["in_sample_median_abs_error"] = median_abs_errors([s for rr in in_sample for s in rr.stages])
            if held_out:
                report["fitted_without_model"] = per_model
                report["leave_one_model_out_median_abs_error"] = median_abs_errors(
                    [s for rr in results for s in rr.stages])
        else:
            results = replays.get([(run, None) for run in runs])
    except ReplaysStopped as e:
        results = [] if keys else [r for r in e.done if r is not None]
        report["interrupted"] = (f"stopped during the fit after {replays.simulated} replays: nothing fitted" if keys
                                 else f"stopped after {len(results)} of {len(runs)} runs: those are scored")
        log.warning("interrupted: %s", report["interrupted"])
    finally:
        report["replays"] = {"asked": replays.asked, "simulated": replays.simulated}
        report["replays_cpu_s"] = replays.cpu_s
        replays.close()
    stages = [s for rr in results for s in rr.stages]
    wholes = [rr.whole for rr in results if rr.whole is not None]
    report["median_abs_error"] = median_abs_errors(stages)
    report["by_model"] = by_model(stages)
    report["scored_stages"] = len(scored(stages))
    report["overloaded_stages"] = len(stages) - len(scored(stages))
    report["whole_run_median_abs_error"] = median_abs_errors(wholes)
    report["whole_runs_scored"] = len(scored(wholes))
    report["whole_runs_missing"] = [rr.stages[0].run for rr in results if rr.whole is None and rr.stages]
    report["wall_s"] = time.perf_counter() - t0
    write(cfg.output.dir, stages, wholes, report)
    return report


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    check_config(cfg)
    validate(cfg)


if __name__ == "__main__":
    main()
