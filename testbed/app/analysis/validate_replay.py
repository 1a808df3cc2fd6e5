"""One real run replayed in the simulator, and its figures beside the client's (`testbed-validate`).

Why: the validation and the fit compare the same things run after run; this is where a run's server
settings and workload become a simulator config and its results become, per load stage and over the
whole run, the figures the load generator reported (`testbed.app.analysis.inference_perf` says how it defines
them), so that a figure compared is a figure defined alike on both sides.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from omegaconf import DictConfig, OmegaConf, open_dict

from testbed.app.analysis.inference_perf import client_figures, messages_per_token, token_gaps
from testbed.app.analysis.real_runs import RealRun
from testbed.core.request import Request
from testbed.traces.shared_prefix import shared_prefix_requests

FIT_METRICS = ("ttft", "e2e", "tpot")  # the means the fit's residuals are made of
# the medians (vllm bench serve's headline figures beside the means; a mean TTFT carrying a warm-up stall of
# seconds has them apart) and the tails
TAILS = ("ttft_p50", "ttft_p90", "ttft_p99", "e2e_p50", "e2e_p90", "e2e_p99")
ITL = ("itl", "itl_p90", "itl_p99")  # inter_token_latency as the load generator defines it
METRICS = FIT_METRICS + TAILS + ITL  # every figure scored
LABELS = {"ttft": "TTFT", "e2e": "E2E", "tpot": "TPOT", "ttft_p50": "TTFT p50", "ttft_p90": "TTFT p90",
          "ttft_p99": "TTFT p99", "e2e_p50": "E2E p50", "e2e_p90": "E2E p90", "e2e_p99": "E2E p99", "itl": "ITL",
          "itl_p90": "ITL p90", "itl_p99": "ITL p99"}


@dataclass
class StageResult:
    """One load stage (`stage` its index) or the whole run (`stage` None): the client's figures and the
    simulator's, by metric, in seconds (a metric the run does not report is absent from `real`)."""

    run: str
    model: str
    stage: int | None
    rate: float
    overloaded: bool
    sim_overloaded: bool
    real: dict
    sim: dict
    messages_per_token: int | None = None  # stamped stream messages per token (None: not known)

    def error(self, metric: str) -> float:
        """(sim - real) / real; NaN where either side lacks the metric."""
        real, sim = self.real.get(metric, math.nan), self.sim.get(metric, math.nan)
        return (sim - real) / real if real and not math.isnan(real) else math.nan


@dataclass
class RunReplay:
    """A replayed run: its stages, and its whole run where the real run reports one."""

    stages: list[StageResult]
    whole: StageResult | None


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
        c.model.hf_id = run.model_id  # whose generation_config.json decides the sampler (testbed.core.sampling)
        c.output.progress = False
        c.output.record_token_times = True  # the load generator's inter-token figures need each token's time
        # an overloaded stage's queue would take (simulated) hours to drain: stop the clock
        # `validate.drain_s` after the last stage; what is left counts as not finished
        c.backend.horizon_s = sum(s.duration_s for s in run.stages) + len(run.stages) * c.validate.stage_gap_s \
            + c.validate.drain_s
        for key, v in (values or {}).items():
            OmegaConf.update(c, key, float(v), merge=False)
    return c


def inert_keys(cfg: DictConfig, run: RealRun) -> frozenset[str]:
    """Config keys whose value cannot change the run's replay, so that a fit replays a run once for all
    of their values (the Jacobian's column of such a key is zero there): `cost_model.allreduce_overhead_s`
    prices tensor-parallel all-reduces (testbed/sim/kernel_cost.py, the only reader), and a run on one
    GPU per pipeline stage has none (a disaggregated run's pools set their own parallelism)."""
    disagg = cfg.get("disagg")
    if run.tensor_parallel == 1 and not (disagg is not None and disagg.get("enabled")):
        return frozenset({"cost_model.allreduce_overhead_s"})
    return frozenset()


def run_requests(run: RealRun, seed: int, stage_gap_s: float) -> tuple[list[Request], list[int]]:
    """The run's workload, with the prompts stretched to the length the client counted."""
    w = run.workload
    nominal = w.system_prompt_len + w.question_len
    measured = [s.mean_prompt_len for s in run.stages if s.succeeded]
    scale = float(np.mean(measured)) / nominal if measured else 1.0
    stages = tuple((s.rate, s.duration_s) for s in run.stages)
    requests, starts = _workload(w.num_groups, w.prompts_per_group, w.system_prompt_len, w.question_len,
                                 w.output_len, stages, scale, stage_gap_s, seed)
    return list(requests), list(starts)


@functools.lru_cache(maxsize=64)
def _workload(num_groups: int, prompts_per_group: int, system_prompt_len: int, question_len: int, output_len: int,
              stages: tuple, prompt_scale: float, stage_gap_s: float, seed: int) -> tuple[tuple[Request, ...], tuple[int, ...]]:
    """A fit replays each run many times with the same workload: built once per process (its requests are
    frozen, and the same arguments build the same ones)."""
    requests, starts = shared_prefix_requests(num_groups=num_groups, prompts_per_group=prompts_per_group,
                                              system_prompt_len=system_prompt_len, question_len=question_len,
                                              output_len=output_len, stages=list(stages), prompt_scale=prompt_scale,
                                              stage_gap_s=stage_gap_s, seed=seed)
    return tuple(requests), tuple(starts)


def _figures(rows, n_out: int, per_token: int | None, gaps: np.ndarray | None = None
             ) -> tuple[dict, bool, np.ndarray | None]:
    """The simulated figures of `rows` (a stage's or the run's requests), whether none finished, and their
    finished requests' token gaps (`token_gaps`; `gaps`: those, known already)."""
    done = rows[rows["outcome"] == "finished"]
    if not len(done):
        return {m: math.nan for m in ("ttft", "e2e", "tpot")}, True, np.empty(0)
    if gaps is None:
        gaps = token_gaps(done)
    sim = client_figures(done, per_token, gaps)
    sim["tpot"] = (sim["e2e"] - sim["ttft"]) / max(n_out - 1, 1)
    return sim, False, gaps


def _real(measured: dict, n_out: int) -> dict:
    real = {k: v for k, v in measured.items() if k != "stream_tpot"}
    # TPOT as the runs' README derives it, from the means and the server's output count
    real["tpot"] = (measured["e2e"] - measured["ttft"]) / max(n_out - 1, 1)
    return real


def simulate_run(cfg: DictConfig, run: RealRun, values: dict[str, float] | None = None,
                 stop: Callable[[], bool] | None = None) -> RunReplay | None:
    """The run replayed with `cfg` (and `values` for fitted keys): every stage's figures beside the
    client's, and the whole run's where the run has its summary. None: `stop()` turned true and cut the
    replay short (a part of a run scores nothing)."""
    from testbed.app.assembly.run_setup import resolve_model_spec
    from testbed.app.assembly.run import simulate

    c = run_config(cfg, run, values)
    requests, starts = run_requests(run, cfg.seed, cfg.validate.stage_gap_s)
    result = simulate(c, stop, model=resolve_model_spec(c.model), requests=requests)
    if result.summary.get("interrupted"):
        return None
    table = result.requests
    n_out = run.workload.output_len
    out = []
    bounds = starts + [len(requests)]
    parts = []  # each stage's token gaps: the stages split the table, so theirs joined are the whole run's
    for k, stage in enumerate(run.stages):
        rows = table.iloc[bounds[k]:bounds[k + 1]]
        per_token = messages_per_token(stage.measured, n_out)
        sim, none_done, gaps = _figures(rows, n_out, per_token)
        parts.append(gaps)
        if none_done:
            sim_over = True
        else:
            done = rows[rows["outcome"] == "finished"]
            span = float(done["finish_s"].max() - rows["arrival_s"].min())  # like the client's, drain included
            sim_over = len(done) < len(rows) or len(done) / span < 0.9 * len(rows) / stage.duration_s
        out.append(StageResult(run.name, run.model_name, k, stage.rate, stage.overloaded, bool(sim_over),
                               _real(stage.measured, n_out), sim, per_token))
    whole = None
    if run.whole is not None:
        per_token = messages_per_token(run.whole, n_out)
        known = (np.concatenate(parts) if all(g is not None for g in parts) and bounds[0] == 0
                 and bounds[-1] == len(table) else None)
        sim, _, _ = _figures(table, n_out, per_token, known)
        whole = StageResult(run.name, run.model_name, None, math.nan, any(s.overloaded for s in out),
                            any(s.sim_overloaded for s in out), _real(run.whole, n_out), sim, per_token)
    return RunReplay(out, whole)


def scored(results: list[StageResult]) -> list[StageResult]:
    """The results that are scored: those of stages (or whole runs) that were not overloaded."""
    return [r for r in results if not r.overloaded]


def median_abs_errors(results: list[StageResult], metrics=METRICS) -> dict[str, float]:
    """Per metric, the median |error| over the scored results that have it (NaN: none has it)."""
    rs = scored(results)
    out = {}
    for m in metrics:
        errs = [abs(e) for e in (r.error(m) for r in rs) if not math.isnan(e)]
        out[m] = float(np.median(errs)) if errs else math.nan
    return out
