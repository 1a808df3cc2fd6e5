"""`testbed-referee`: real vLLM's scheduler as the referee for the testbed's `vllm` policy.

    testbed-referee model=tiny_llama model.head_dim=32 trace=azure_conv trace.max_requests=500 \
        scheduler.max_model_len=2048 kv.num_blocks=64

(`python -m testbed.app.referee ...` is the same; it needs vLLM: `backend=vllm`'s install.)

A simulator's latency is only as good as the decisions it simulates. This replays the trace
on real vLLM with vLLM's own scheduler (`backend=vllm backend.scheduler=native`, every step
logged), then runs the testbed's step loop with policy `vllm` in lockstep with it: each
request reaches the loop before the step it reached vLLM before, and each step starts and
ends when vLLM's did, so timing cannot explain a difference and only decisions are compared.
vLLM's scheduler settings come from the same `policy.*` knobs (chunked prefill, long-prefill
threshold, whole-sequence admission gate) and KV capacity from vLLM's own block pool;
`policy=vllm_priority` is refereed against `--scheduling-policy priority`, each request handed
to vLLM with the trace's priority.

Per step it compares the {request: tokens} decided and the requests preempted, and reports
the steps compared, the steps identical, the first divergent step with both decisions side
by side, and each metric of both runs. Then it does the same with our own engine running
every batch of the lockstep (the same seeded weights vLLM loaded, the same prompts, greedy) and
counts the requests whose generated tokens equal vLLM's: the two engines' execution compared
under one schedule, preemptions and prefix hits included. Written to the output dir: `referee.json`,
`referee.md`, `steps.csv` (one row per step: both decisions and whether they agree), and
both runs' usual files under `vllm/` and `sim/`.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import pandas as pd
from omegaconf import DictConfig, OmegaConf, open_dict

from testbed.app.cli import CONF_DIR
from testbed.app.frontend import without_frontend
from testbed.app.plugins import make_policy
from testbed.app.validate import check_config
from testbed.app.vllm_run import NATIVE_POLICIES
from testbed.core.kv import BlockManager
from testbed.core.loop import ReplayOutcome, SchedulerLimits, StepLoop
from testbed.core.request import Request, Status

log = logging.getLogger("testbed.app.referee")

METRICS = ["completed", "num_preemptions", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms",
           "median_e2el_ms", "p99_e2el_ms", "request_throughput", "output_throughput", "prefix_cache_hit_rate"]


@dataclass
class StepCheck:
    step: int
    start: float
    real: dict[int, int]
    ours: dict[int, int]
    real_preempted: list[int]
    ours_preempted: list[int]

    @property
    def identical(self) -> bool:
        return self.real == self.ours and sorted(self.real_preempted) == sorted(self.ours_preempted)


@dataclass
class Verdict:
    checks: list[StepCheck] = field(default_factory=list)
    extra_steps: int = 0  # steps the loop still wanted after vLLM's last one

    @property
    def identical(self) -> int:
        return sum(c.identical for c in self.checks)

    @property
    def first_divergence(self) -> StepCheck | None:
        return next((c for c in self.checks if not c.identical), None)


class Executor:
    """Runs the lockstep loop's batches on a real engine; the referee's default runs none."""

    def arrive(self, req: Request) -> None: ...

    def execute(self, batch) -> None: ...


class EngineExecutor(Executor):
    """Our torch engine (testbed/engine/) executing each batch: real forwards on a paged KV
    cache shaped as vLLM's, so its generated tokens can be compared with vLLM's."""

    def __init__(self, runner, prompt_tokens):
        self.runner, self.prompt_tokens = runner, prompt_tokens
        self.tokens: dict[int, list[int]] = {}
        self.seconds = 0.0  # the engine's own time over every step

    def arrive(self, req: Request) -> None:
        self.tokens[req.id] = self.prompt_tokens(req)

    def execute(self, batch) -> None:
        start = time.perf_counter()
        for rid, tok in self.runner.execute(batch.items, self.tokens).items():
            self.tokens[rid].append(tok)
        self.seconds += time.perf_counter() - start


def lockstep(decisions, delivered: list[tuple[float, Request]], loop: StepLoop,
             executor: Executor | None = None) -> tuple[Verdict, ReplayOutcome]:
    """Run `loop` through vLLM's steps: the same arrivals before each step, the same step times
    (`executor`, if given, runs each batch for real in between)."""
    executor = executor or Executor()
    verdict = Verdict()
    arrived = 0
    end = 0.0

    def arrive(t: float, req: Request) -> None:
        if loop.arrive(req, t).status is not Status.REJECTED:
            executor.arrive(req)

    for i, d in enumerate(decisions):
        while arrived < d.num_delivered:
            arrive(*delivered[arrived])
            arrived += 1
        before = {s.req.id: s.num_preemptions for s in loop.running}
        batch = loop.plan(d.start) if loop.has_work else None
        ours = {s.req.id: n for s, n in batch.items} if batch is not None else {}
        preempted = [rid for rid, k in before.items() if loop.live[rid].num_preemptions > k]
        verdict.checks.append(StepCheck(i, d.start, d.tokens, ours, d.preempted, preempted))
        if batch is not None:
            executor.execute(batch)
            loop.complete(batch, d.end)
        end = d.end
    for t, req in delivered[arrived:]:
        arrive(t, req)
    while loop.has_work and verdict.extra_steps < 100_000:
        batch = loop.plan(end)
        if batch is None:
            break
        executor.execute(batch)
        loop.complete(batch, end)
        verdict.extra_steps += 1
    if loop.has_work:
        loop.abandon("unfinished when vLLM's steps ran out")
    return verdict, ReplayOutcome([loop], [], end)


def lockstep_loop(cfg: DictConfig, setup, num_blocks: int, block_size: int) -> StepLoop:
    """The refereed policy's step loop on a cache shaped as vLLM's (its usable blocks, its block size)."""
    return StepLoop(make_policy(cfg.policy.name, **setup.knobs),
                    BlockManager(num_blocks, block_size, cfg.kv.enable_prefix_caching),
                    SchedulerLimits(setup.limits.max_num_batched_tokens, setup.limits.max_num_seqs,
                                    setup.limits.max_model_len), record_token_times=cfg.output.record_token_times)


def engine_side(cfg: DictConfig, setup, replay, num_blocks: int, block_size: int) -> dict:
    """The same lockstep with our engine running every batch: its decisions, and whether the
    tokens it generates (same seeded weights, same prompts, greedy) are vLLM's."""
    from testbed.engine.kv_cache import PagedKVCache
    from testbed.engine.models import build_model
    from testbed.engine.prompts import PromptTokens
    from testbed.engine.runner import ModelRunner

    spec = setup.model
    model = build_model(spec, cfg.backend.dtype or spec.dtype, "cpu", seed=cfg.seed)
    cache = PagedKVCache.for_model(model.config, num_blocks, block_size, next(model.parameters()).dtype)
    executor = EngineExecutor(ModelRunner(model, cache), PromptTokens(spec.vocab_size, cfg.seed))
    loop = lockstep_loop(cfg, setup, num_blocks, block_size)
    verdict, _ = lockstep(replay.decisions, replay.delivered, loop, executor)
    same, compared, first = 0, 0, None
    for s in loop.states:
        theirs = replay.output_ids.get(s.req.id)
        if s.status is not Status.FINISHED or theirs is None:
            continue
        ours = executor.tokens[s.req.id][s.req.prompt_len:]
        compared += 1
        if ours == theirs:
            same += 1
        elif first is None:
            at = next(i for i, (a, b) in enumerate(zip(ours + [-1], theirs + [-2])) if a != b)
            first = {"request": s.req.id, "token_index": at, "ours": ours[at:at + 5], "vllm": theirs[at:at + 5]}
    first_div = verdict.first_divergence
    return {"steps_compared": len(verdict.checks), "steps_identical": verdict.identical,
            "first_divergent_step": None if first_div is None else first_div.step,
            "requests_compared": compared, "requests_same_tokens": same, "first_token_mismatch": first,
            "engine_forward_s": executor.seconds}


def _side_by_side(c: StepCheck) -> list[dict]:
    rows = []
    for rid in sorted(set(c.real) | set(c.ours) | set(c.real_preempted) | set(c.ours_preempted)):
        rows.append({"request": rid, "vllm_tokens": c.real.get(rid, 0), "ours_tokens": c.ours.get(rid, 0),
                     "vllm_preempted": rid in c.real_preempted, "ours_preempted": rid in c.ours_preempted})
    return rows


def report(verdict: Verdict, real: dict, sim: dict, command: str) -> dict:
    first = verdict.first_divergence
    return {
        "command": command,
        "vllm_version": real.get("vllm_version"),
        "steps_compared": len(verdict.checks),
        "steps_identical": verdict.identical,
        "identical_fraction": verdict.identical / len(verdict.checks) if verdict.checks else 0.0,
        "extra_steps_ours": verdict.extra_steps,
        "preemptions_vllm": sum(len(c.real_preempted) for c in verdict.checks),
        "preemptions_ours": sum(len(c.ours_preempted) for c in verdict.checks),
        "first_divergence": None if first is None else {"step": first.step, "start_s": first.start,
                                                        "requests": _side_by_side(first)},
        "metrics": {k: {"vllm": real.get(k), "ours": sim.get(k),
                        "diff": (sim[k] - real[k]) if isinstance(real.get(k), (int, float))
                        and isinstance(sim.get(k), (int, float)) else None} for k in METRICS},
    }


def markdown(rep: dict) -> str:
    lines = [f"# Referee: the testbed's `vllm` policy vs real vLLM {rep['vllm_version']}'s scheduler", "",
             f"`{rep['command']}`", "",
             f"- steps compared: {rep['steps_compared']}; identical: {rep['steps_identical']} "
             f"({100 * rep['identical_fraction']:.1f}%)",
             f"- preemptions: vLLM {rep['preemptions_vllm']}, ours {rep['preemptions_ours']}",
             f"- steps ours still wanted after vLLM's last: {rep['extra_steps_ours']}", ""]
    first = rep["first_divergence"]
    if first is None:
        lines += ["Every step identical.", ""]
    else:
        lines += [f"First divergent step: {first['step']} (t = {first['start_s']:.4f} s)", "",
                  "| request | vLLM tokens | ours | vLLM preempted | ours preempted |", "|---|---|---|---|---|"]
        lines += [f"| {r['request']} | {r['vllm_tokens']} | {r['ours_tokens']} | {r['vllm_preempted']} | "
                  f"{r['ours_preempted']} |" for r in first["requests"]]
        lines.append("")
    e = rep.get("engine")
    if e:
        lines += ["Our engine in the same lockstep (every batch run by testbed/engine/, same seeded weights):",
                  f"- steps identical: {e['steps_identical']} of {e['steps_compared']}",
                  f"- requests whose generated tokens equal vLLM's: {e['requests_same_tokens']} of "
                  f"{e['requests_compared']}" + (f"; first mismatch: {e['first_token_mismatch']}"
                                                 if e["first_token_mismatch"] else ""), ""]
    lines += ["| metric | vLLM | ours (lockstep) | diff |", "|---|---|---|---|"]
    for k, m in rep["metrics"].items():
        fmt = (lambda x: "-" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x))
        lines.append(f"| {k} | {fmt(m['vllm'])} | {fmt(m['ours'])} | {fmt(m['diff'])} |")
    return "\n".join(lines) + "\n"


def steps_frame(verdict: Verdict) -> pd.DataFrame:
    return pd.DataFrame([{"step": c.step, "start_s": c.start, "identical": c.identical,
                          "vllm": json.dumps(c.real, sort_keys=True), "ours": json.dumps(c.ours, sort_keys=True),
                          "vllm_preempted": json.dumps(sorted(c.real_preempted)),
                          "ours_preempted": json.dumps(sorted(c.ours_preempted))} for c in verdict.checks])


def run_referee(cfg: DictConfig, out: str | Path, command: str = "") -> dict:
    """Replay on native vLLM, then the `vllm` policy in lockstep; write and return the report."""
    from testbed.app.results import write_results
    from testbed.app.run_setup import finish
    from testbed.app.run import run_info
    from testbed.app.vllm_run import replay_on_vllm

    if cfg.policy.name not in NATIVE_POLICIES:
        raise ValueError(f"policy={cfg.policy.name}: the referee checks the testbed's `vllm` policy against vLLM's "
                         "own scheduler (`vllm_priority` against its --scheduling-policy priority); run it with "
                         "policy=vllm or policy=vllm_priority (its knobs configure both sides)")
    cfg = without_frontend(cfg, "testbed-referee").copy()
    with open_dict(cfg):
        cfg.backend.name, cfg.backend.scheduler = "vllm", "native"
    got = {}
    real = replay_on_vllm(cfg, on_done=lambda setup, replay: got.update(setup=setup, replay=replay))
    setup, replay = got["setup"], got["replay"]
    t0 = time.perf_counter()
    blocks, block_size = replay.run_record.kv.num_blocks, replay.run_record.kv.block_size
    log.info("lockstep over vLLM's %d steps: the vllm policy, then our engine", len(replay.decisions))
    verdict, outcome = lockstep(replay.decisions, replay.delivered, lockstep_loop(cfg, setup, blocks, block_size))
    sim = finish(cfg, setup, outcome, "sim-lockstep", t0)
    rep = report(verdict, real.summary, sim.summary, command)
    rep["engine"] = engine_side(cfg, setup, replay, blocks, block_size)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg_yaml = OmegaConf.to_yaml(cfg)
    for name, r in (("vllm", real), ("sim", sim)):
        write_results(out / name, r.requests, r.steps, r.summary, cfg_yaml, run_info(r))
    (out / "referee.json").write_text(json.dumps(rep, indent=2, default=float) + "\n")
    (out / "referee.md").write_text(markdown(rep))
    steps_frame(verdict).to_csv(out / "steps.csv", index=False)
    return rep


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    import sys

    cfg = without_frontend(cfg, "testbed-referee")
    check_config(cfg, backend="vllm")
    command = "testbed-referee " + " ".join(a for a in sys.argv[1:] if not a.startswith("hydra."))
    rep = run_referee(cfg, cfg.output.dir, command)
    print(markdown(rep))
    print(f"results: {cfg.output.dir}")
    return rep


if __name__ == "__main__":
    main()
