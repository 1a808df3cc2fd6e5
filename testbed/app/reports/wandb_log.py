"""Weights & Biases logging of a run, so sweeps compare in the W&B UI with no manual work.

Offline unless an API key is configured (there may be no network): the run is written
under the run's output folder, and the command prints where and the `wandb sync` that uploads it
(a sweep: once, for all its jobs). Runs of one study share a `group` (the experiment, else the
policy and trace the sweep does not vary), are typed by backend (`job_type`) and named by their
swept values. Logged: the resolved config, the summary metrics, the per-step time series as
history on simulated time (`sim_time_s`, W&B's `define_metric`; evenly thinned to
`logger.max_history_rows`), the per-request table, and CDF plots of TTFT, TPOT and E2E latency.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

STEP_METRIC = "sim_time_s"  # the x axis of the per-step series: the step's start, in the run's own seconds
STEP_SERIES = ("step_s", "batch_tokens", "prefill_tokens", "decode_tokens", "running", "waiting", "kv_used_blocks",
               "preemptions")


def wandb_mode(requested: str | None) -> str:
    if requested:
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def run_identity(cfg: DictConfig) -> tuple[str, str]:
    """(group, name). The group is what the runs compare within: the experiment's name (`experiment=`),
    else the policy and the trace, less whichever the sweep varies (a sweep over policies on azure_conv:
    `azure_conv`), so that reruns of one study land in one group (a sweep folder's clock time did not).
    The name is the job's swept values only (`policy=vllm,trace.rate_scale=2`, from the sweep's plan,
    app/reports/sweep_progress.py), not every override (`logger=wandb` named every run)."""
    from hydra.core.hydra_config import HydraConfig

    from testbed.app.reports.sweep_progress import read_plan, swept_values

    policy, trace = cfg.policy.name, cfg.trace.name
    if not HydraConfig.initialized():
        return f"{policy}-{trace}", f"{policy}-{trace}"
    hc = HydraConfig.get()
    policy = hc.runtime.choices.get("policy") or policy
    experiment = hc.runtime.choices.get("experiment")
    if hc.mode.name != "MULTIRUN":
        return experiment or f"{policy}-{trace}", f"{policy}-{trace}"
    plan = read_plan(hc.sweep.dir)
    swept = plan.swept if plan else [o.split("=", 1)[0].lstrip("+~") for o in hc.overrides.task
                                     if not o.lstrip("+~").startswith(("logger", "hydra.", "experiment"))]
    varied = {"policy": {"policy"}, "trace": {"trace", "trace.path", "trace.name"}}
    fixed = [part for key, part in (("policy", policy), ("trace", trace)) if not varied[key] & set(swept)]
    group = experiment or (plan.experiment if plan else None) or "-".join(fixed) or "sweep"
    name = swept_values(list(hc.overrides.task), swept).replace(" ", ",") or f"{policy}-{trace}"
    return group, name


def offline_runs(folder: str | Path) -> list[Path]:
    """The offline W&B runs under `folder` (a run's, or every job's of a sweep), not yet synced."""
    root = Path(folder)
    return sorted(p for pattern in ("wandb/offline-run-*", "*/wandb/offline-run-*") for p in root.glob(pattern)
                  if p.is_dir())


def sync_hint(runs: list[str | Path], sweep_dir: str | Path | None = None) -> str:
    """One line: where the offline runs are, and the command that uploads them."""
    import shlex

    if sweep_dir is not None and len(runs) > 1:
        where = f"{len(runs)} offline runs under {sweep_dir}"
        command = f"wandb sync {shlex.quote(str(sweep_dir))}/*/wandb/offline-run-*"
    else:
        run = Path(runs[0])
        run = run.parent if run.name == "files" else run  # wandb's run.dir is the run's files/ folder
        where, command = f"offline run in {run}", f"wandb sync {shlex.quote(str(run))}"
    return f"W&B: {where}; upload with: {command}"


def log_to_wandb(cfg: DictConfig, result, out_dir: str | Path):
    import wandb

    lc = cfg.logger
    group, name = run_identity(cfg)
    run = wandb.init(project=lc.project, entity=lc.entity, group=lc.group or group, job_type=cfg.backend.name,
                     name=name, config=OmegaConf.to_container(cfg, resolve=True), dir=str(out_dir),
                     mode=wandb_mode(lc.mode), reinit="finish_previous", settings=wandb.Settings(silent=True))
    try:
        steps = result.steps
        if len(steps):  # on simulated (or the engine's replay) time, not on W&B's own _step counter
            run.define_metric(STEP_METRIC)
            for key in STEP_SERIES:
                run.define_metric(key, step_metric=STEP_METRIC)
            take = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), lc.max_history_rows)).astype(int))
            for row in steps.iloc[take].itertuples(index=False):
                run.log({STEP_METRIC: row.start, "step_s": row.duration,
                         "batch_tokens": row.prefill_tokens + row.decode_tokens,
                         "prefill_tokens": row.prefill_tokens, "decode_tokens": row.decode_tokens,
                         "running": row.running, "waiting": row.waiting, "kv_used_blocks": row.kv_used_blocks,
                         "preemptions": row.preemptions})
        if lc.log_requests_table:
            table = result.requests.drop(columns=[c for c in ("token_times",) if c in result.requests.columns])
            run.log({"requests": wandb.Table(dataframe=table)})
        for key in ("ttft_ms", "tpot_ms", "e2el_ms"):
            values = np.sort(result.requests[key].dropna().to_numpy())
            if values.size:
                points = np.unique(np.linspace(0, values.size - 1, min(values.size, 200)).astype(int))
                data = [[float(values[i]), (i + 1) / values.size] for i in points]
                run.log({f"cdf_{key}": wandb.plot.line(wandb.Table(data=data, columns=[key, "fraction"]), key,
                                                       "fraction", title=f"CDF of {key}")})
        for k, v in result.summary.items():
            if isinstance(v, (int, float, str, bool)) or v is None:
                run.summary[k] = v
        return Path(run.dir).parent if wandb_mode(lc.mode) == "offline" else None
    finally:
        run.finish()
