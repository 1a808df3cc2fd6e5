"""Console entry points (`testbed-sim`, `python -m testbed`).

The config groups are package data (`testbed/conf/`, shipped in the wheel), found through the
installed package by `importlib.resources` and handed to Hydra as an absolute directory, so
the command works from any directory, from a checkout or from a wheel.
"""
from __future__ import annotations

import json
import logging
import sys
from importlib import resources
from pathlib import Path
from typing import Callable

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from testbed.app.entry import compose_once
from testbed.app.entry.one_shot import gc_off_for_good
from testbed.app.assembly.config import register_configs
from testbed.app.entry.stop import exit_code, signal_name, stop_on_signals
from testbed.app.assembly.validate import check_config

CONF_DIR = Path(str(resources.files("testbed") / "conf"))
log = logging.getLogger("testbed")
STALLED_EXIT = 3  # the run ended with work its policy would not schedule (interrupted: 128 + signal)

register_configs()
compose_once.install()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    from testbed.app.analysis.results import check_writable

    from testbed.app.assembly.inputs import forget_inputs, read_inputs, write_inputs

    check_config(cfg)
    check_writable(cfg.output.dir)
    inputs = read_inputs(cfg)  # before the run: the data it reads, not what the file may have become by its end
    from testbed.app.assembly.run_setup import in_multirun

    done = _finished_before(cfg, inputs)
    if done is not None:
        if in_multirun():  # the sweep's line for this job says so (app/reports/sweep_progress.py)
            return {**done, "skipped": True}
        print(f"skipped: {cfg.output.dir} already holds the results of this exact config and its input files")
        return done
    forget_inputs(cfg.output.dir)
    if in_multirun():  # a sweep job: its work in a child, so that an OS kill ends this job only
        from testbed.app.entry.isolated import run_isolated
        from testbed.app.entry.sweep_signals import job_in_sweep

        with job_in_sweep(HydraConfig.get().sweep.dir) as stop:
            if stop():  # the sweep was stopped before this job started: it is listed, not run
                return {"interrupted": True, "started": False}
            summary, signum = run_isolated(_run_and_write, cfg)
    else:
        gc_off_for_good()  # a single run's process ends with it (app/entry/one_shot.py)
        summary, signum = _run_and_write(cfg)
    write_inputs(cfg.output.dir, inputs)  # last: results with no record of their inputs are never skipped
    return _verdict(cfg, summary, signum)


def _run_and_write(cfg: DictConfig) -> tuple[dict, int | None]:
    """Run, write the results, print the table: the summary, and the signal that stopped the
    run early (SIGINT/SIGTERM: the step under way finishes, the finished requests are written)."""
    with stop_on_signals() as stop:
        result = run_job(cfg, stop)
        out = write_run(cfg, result)
    report_run(cfg, result, out)
    return result.summary, stop.signum


def run_job(cfg: DictConfig, stop: Callable[[], bool] | None = None):
    """`run`, with the summary naming the policy's config (a RunResult). The CLI and the Python API
    (testbed/api.py) both run through here, so that one config gives them one summary."""
    from testbed.app.assembly.backends import run

    result = run(cfg, stop)
    if HydraConfig.initialized():  # the policy's config name tells variants of one policy apart
        result.summary["policy_config"] = HydraConfig.get().runtime.choices.get("policy", cfg.policy.name)
    return result


def write_run(cfg: DictConfig, result) -> Path:
    """The run's files in `output.dir` (app/analysis/results.py), the same whichever door the run came in by."""
    from testbed.app.analysis.results import write_results
    from testbed.app.assembly.run import run_info
    from testbed.app.analysis.vllm_bench_format import write_vllm_bench

    out = write_results(cfg.output.dir, result.requests, result.steps if cfg.output.write_steps else None,
                        result.summary, OmegaConf.to_yaml(cfg, resolve=True), run_info(result))
    write_vllm_bench(out, result.requests, result.summary, cfg)  # the same run in `vllm bench serve`'s keys
    return out


def report_run(cfg: DictConfig, result, out: Path | None, print_table: bool | None = None) -> None:
    """What follows a run: its W&B log (where `out` holds its files) and its table on stdout
    (`print_table`, None: `output.print_table`)."""
    from testbed.app.analysis.results import format_table

    from testbed.app.assembly.run_setup import in_multirun

    if cfg.logger.name == "wandb" and out is not None:
        from testbed.app.reports.wandb_log import log_to_wandb, sync_hint

        run_dir = log_to_wandb(cfg, result, out)
        if run_dir is not None and not in_multirun():  # (a sweep says it once, for all its jobs)
            print(sync_hint([run_dir]))
    # a sweep job's table is its one line (app/reports/sweep_progress.py)
    if (cfg.output.print_table if print_table is None else print_table) and not in_multirun():
        where = (f"{cfg.hardware.name}, {result.summary.get('cost_model', cfg.cost_model.name)}" if cfg.backend.name == "sim"
                 else f"vLLM {result.summary.get('vllm_version')} ({cfg.backend.scheduler} scheduler) on "
                      f"{result.summary.get('device')}" if cfg.backend.name == "vllm"
                 else f"engine on {result.summary.get('device')}")
        title = f"{cfg.policy.name} on {cfg.trace.name} ({result.summary.get('model', cfg.model.name)}, {where})"
        overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
        print(f"\n{title}" + (f"  [{' '.join(overrides)}]" if overrides else ""))
        if cfg.backend.name == "sim":  # a prediction: which configuration made it, and is it the validated one
            from testbed.app.assembly.provenance import line

            print(line(result.summary))
        print(format_table(result.summary))
        what = {"sim": "simulated", "vllm": "replayed on vLLM"}.get(cfg.backend.name, "replayed on the engine")
        print(f"results: {out if out is not None else 'not written'}  ({what} in {result.wall_s:.2f} s wall)")


def incomplete(cfg: DictConfig, summary: dict, signum: int | None) -> tuple[str, int] | None:
    """Why a run is not complete (interrupted or stalled) and its command's exit code, or None."""
    if summary.get("interrupted"):
        return (f"interrupted by {signal_name(signum)}: the results of finished requests are in "
                f"{cfg.output.dir}, the others are marked unfinished"), exit_code(signum)
    if summary.get("stalled"):
        return (f"stalled: policy {cfg.policy.name!r} scheduled nothing while {summary['unfinished']} requests "
                f"were left and no arrivals were to come; they are marked unfinished in {cfg.output.dir}"), STALLED_EXIT
    return None


def _verdict(cfg: DictConfig, summary: dict, signum: int | None) -> dict:
    """The summary of a complete run. An interrupted or stalled one says so and exits 128 +
    the signal or STALLED_EXIT (a single run), or raises RunNotComplete (a sweep job: Hydra
    records it as failed, the other jobs go on, and the sweep exits non-zero at the end), unless
    the whole sweep was stopped (app/entry/sweep_signals.py): then its command exits 128 + the signal."""
    why = incomplete(cfg, summary, signum)
    if why is None:
        return summary
    message, code = why
    from testbed.app.analysis.results import RunNotComplete
    from testbed.app.assembly.run_setup import in_multirun

    if in_multirun():
        from testbed.app.entry.sweep_signals import stopped

        if summary.get("interrupted") and stopped(HydraConfig.get().sweep.dir):
            print(message, file=sys.stderr)
            return summary
        raise RunNotComplete(message)
    print(message, file=sys.stderr)
    sys.exit(code)


def _offered_rate(cfg: DictConfig) -> float:
    """Arrivals per second of the trace as configured, at rate_scale 1."""
    from testbed.app.assembly.run_setup import build_requests

    reqs, _ = build_requests(cfg.trace, cfg.seed)
    span = reqs[-1].arrival - reqs[0].arrival if len(reqs) > 1 else 0.0
    return (len(reqs) - 1) / span * (1.0 / cfg.trace.rate_scale) if span > 0 else 0.0


def _finished_before(cfg: DictConfig, inputs: dict) -> dict | None:
    """The summary of an earlier complete run of this very config on these very input files
    (`inputs`: testbed.app.assembly.inputs.read_inputs) in this folder, so reruns skip it. A run that was
    interrupted, stalled or failed is not done: the rerun redoes it; so is one whose input files
    changed since (a trace edited in place), which says so in one line."""
    from testbed.app.assembly.inputs import changed_inputs
    from testbed.app.analysis.results import run_status

    out = Path(cfg.output.dir)
    config = out / "config.yaml"
    if not (cfg.output.skip_done and config.exists() and run_status(out) == "ok"):
        return None
    if config.read_text() != OmegaConf.to_yaml(cfg, resolve=True):
        return None
    why = changed_inputs(out, inputs)
    if why is not None:
        print(f"rerunning: {out} holds the results of this config, but {why}")
        return None
    return json.loads((out / "summary.json").read_text())


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def capacity(cfg: DictConfig) -> dict:
    """Highest trace.rate_scale at which slo.attainment_target of requests meet the SLO (simulator). A
    signal stops the search between (or within) its simulations; capacity.json then holds the curve so
    far, marked interrupted, and the command exits 128 + the signal (app/entry/stop.py)."""
    from testbed.app.analysis.capacity import SearchStopped, bisect_max_scale
    from testbed.app.assembly.run import simulate
    from testbed.app.entry.sweep_signals import job_stop

    check_config(cfg)
    c = cfg.capacity

    with job_stop() as stop:
        def attainment(scale: float) -> float:
            job = cfg.copy()
            job.trace.rate_scale = float(scale)
            job.output.progress = False
            s = simulate(job, stop).summary
            if s.get("interrupted"):
                raise SearchStopped
            log.info("rate_scale %.4g: attainment %.3f, goodput %.3f req/s", scale, s["slo_attainment"],
                     s["request_goodput"])
            return s["slo_attainment"]

        res = bisect_max_scale(attainment, cfg.slo.attainment_target, c.lo, c.hi, c.rel_tol, c.max_evals, stop)
        out = Path(cfg.output.dir)
        out.mkdir(parents=True, exist_ok=True)
        base_rate = _offered_rate(cfg)
        answer = {"policy": cfg.policy.name, "trace": cfg.trace.name, "slo": cfg.slo.name,
                  "attainment_target": cfg.slo.attainment_target, "max_rate_scale": res.best_scale,
                  "max_request_rate": res.best_scale * base_rate if res.best_scale else None,
                  "bracketed": res.bracketed, "interrupted": res.interrupted,
                  "curve": [{"rate_scale": x, "slo_attainment": a} for x, a in sorted(res.curve)]}
        (out / "capacity.json").write_text(json.dumps(answer, indent=2) + "\n")
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    verdict = ("none: even the lowest load missed the target" if res.best_scale is None else
               f"{res.best_scale:.3g}x the trace's load" + ("" if res.bracketed else f" (or more: {c.hi:g}x met it)"))
    if res.interrupted:
        verdict = f"interrupted after {len(res.curve)} complete simulations; so far {verdict}"
    print(f"{cfg.policy.name} on {cfg.trace.name}, SLO {cfg.slo.name} at {cfg.slo.attainment_target:.0%}: "
          f"max load {verdict}; {len(res.curve)} simulations -> {out / 'capacity.json'}")
    return answer


if __name__ == "__main__":
    main()
