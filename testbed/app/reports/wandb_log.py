"""Weights & Biases logging of a run, so sweeps compare in the W&B UI with no manual work.

Offline unless an API key is configured (there may be no network): the run is written
under the run's output folder and can be synced later with `wandb sync`. Runs of one
multirun share a `group` (the sweep), are typed by backend (`job_type`) and named by
their overrides. Logged: the resolved config, the summary metrics, the per-step time
series as history (evenly thinned to `logger.max_history_rows`), the per-request table,
and CDF plots of TTFT, TPOT and E2E latency.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf


def wandb_mode(requested: str | None) -> str:
    if requested:
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def run_identity(cfg: DictConfig) -> tuple[str, str]:
    """(group, name): the sweep folder and the job's overrides under a multirun."""
    from hydra.core.hydra_config import HydraConfig

    name = f"{cfg.policy.name}-{cfg.trace.name}"
    group = "single-runs"
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        if hc.mode.name == "MULTIRUN":
            group = Path(hc.sweep.dir).name
        if hc.job.override_dirname:
            name = hc.job.override_dirname
    return group, name


def log_to_wandb(cfg: DictConfig, result, out_dir: str | Path):
    import wandb

    lc = cfg.logger
    group, name = run_identity(cfg)
    run = wandb.init(project=lc.project, entity=lc.entity, group=lc.group or group, job_type=cfg.backend.name,
                     name=name, config=OmegaConf.to_container(cfg, resolve=True), dir=str(out_dir),
                     mode=wandb_mode(lc.mode), reinit="finish_previous", settings=wandb.Settings(silent=True))
    try:
        steps = result.steps
        if len(steps):
            take = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), lc.max_history_rows)).astype(int))
            for row in steps.iloc[take].itertuples(index=False):
                run.log({"time_s": row.start, "step_s": row.duration, "batch_tokens": row.prefill_tokens + row.decode_tokens,
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
        return run.dir
    finally:
        run.finish()
