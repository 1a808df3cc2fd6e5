"""`testbed-referee`: real vLLM's scheduler as the referee for the testbed's `vllm` policy.

    testbed-referee model=tiny_llama model.head_dim=32 trace=azure_conv trace.max_requests=500 \
        scheduler.max_model_len=2048 kv.num_blocks=64

(`python -m testbed.app.analysis.referee ...` is the same; it needs vLLM: `backend=vllm`'s install.)

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

`referee.reference=vllm_native` checks the same policy at GPU scale instead, where real vLLM cannot run
here: vLLM's own scheduler deciding in the simulator (`policy=vllm_native`, testbed/vllm_backend/
native_sim.py) on the config's cache, budget and async scheduling, whole traces, with the policy in
lockstep as its steps come (`Lockstep`: a whole trace's steps are compared, not kept; the first
divergent ones go to `divergent_steps.csv`). No model runs, so there is no engine side.
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

from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.frontend import without_frontend
from testbed.app.assembly.plugins import make_policy
from testbed.app.assembly.config import REFEREE_REFERENCES
from testbed.app.assembly.validate import ConfigError, check_config
from testbed.app.assembly.vllm_run import NATIVE_POLICIES, native_settings
from testbed.vllm_backend.native_sim import NATIVE_POLICY
from testbed.core.kv import BlockManager
from testbed.core.loop import ReplayOutcome, SchedulerLimits, StepLoop
from testbed.core.request import Request, Status
from testbed.app.analysis.tables import markdown_table

log = logging.getLogger("testbed.app.analysis.referee")

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
    """The comparison so far. `checks` holds every step (`keep_all`, for steps.csv) or, on a whole trace at
    GPU scale where that would not fit in memory, only the first `MAX_KEPT` divergent ones."""

    keep_all: bool = True
    checks: list[StepCheck] = field(default_factory=list)
    compared: int = 0
    identical: int = 0
    preemptions_real: int = 0
    preemptions_ours: int = 0
    first_divergence: StepCheck | None = None
    extra_steps: int = 0  # steps the loop still wanted after vLLM's last one

    MAX_KEPT = 100

    def add(self, check: StepCheck) -> None:
        self.compared += 1
        self.preemptions_real += len(check.real_preempted)
        self.preemptions_ours += len(check.ours_preempted)
        same = check.identical
        self.identical += same
        if not same and self.first_divergence is None:
            self.first_divergence = check
        if self.keep_all or (not same and len(self.checks) < self.MAX_KEPT):
            self.checks.append(check)


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


class Lockstep:
    """`loop` driven through vLLM's steps as they come: before each, the requests vLLM had been handed; each
    step planned when vLLM's started and completed when it ended (`executor`, if given, runs each batch
    for real in between). `step()` takes one decision; `close()` hands over the rest and lets the loop
    finish what it still wants to run."""

    def __init__(self, delivered: list[tuple[float, Request]], loop: StepLoop, executor: Executor | None = None,
                 keep_all: bool = True):
        self.delivered, self.loop = delivered, loop
        self.executor = executor or Executor()
        self.verdict = Verdict(keep_all)
        self.arrived = 0
        self.end = 0.0
        self.running = None  # the last step's batch, completed once the next step's arrivals are in

    def _arrive(self, t: float, req: Request) -> None:
        if self.loop.arrive(req, t).status is not Status.REJECTED:
            self.executor.arrive(req)

    def _complete(self) -> None:
        """The step before completes after the requests the next schedule saw have arrived: under async
        scheduling vLLM schedules a step before the previous one's outputs are back, so those requests are
        live when the outputs come (as the simulator's held arrivals are); synchronously the order changes
        nothing for the `vllm` policies."""
        if self.running is not None:
            self.loop.complete(self.running, self.end)
            self.running = None

    def step(self, d) -> None:
        loop, delivered = self.loop, self.delivered
        while self.arrived < d.num_delivered:
            self._arrive(*delivered[self.arrived])
            self.arrived += 1
        self._complete()
        before = [(s, s.num_preemptions) for s in loop.running]  # (async: a request finishing is running, not live)
        batch = loop.plan(d.start) if loop.has_work else None
        ours = {s.req.id: n for s, n in batch.items} if batch is not None else {}
        preempted = [s.req.id for s, k in before if s.num_preemptions > k]
        self.verdict.add(StepCheck(self.verdict.compared, d.start, d.tokens, ours, d.preempted, preempted))
        if batch is not None:
            self.executor.execute(batch)
            self.running = batch
        self.end = d.end

    def close(self, interrupted: bool = False, not_arrived: list[Request] | None = None
              ) -> tuple[Verdict, ReplayOutcome]:
        """`interrupted`: vLLM's run was stopped (a signal), so ours stops where vLLM's did: no steps of its
        own after vLLM's last, what is left unfinished as vLLM's is, and `not_arrived` (what vLLM never got)
        neither. The verdict then covers the steps compared so far."""
        loop, verdict = self.loop, self.verdict
        for t, req in self.delivered[self.arrived:]:
            self._arrive(t, req)
        self._complete()
        end = self.end
        if interrupted:
            loop.abandon("interrupted")
            return verdict, ReplayOutcome([loop], list(not_arrived or []), end, interrupted=True)
        while loop.has_work and verdict.extra_steps < 100_000:
            batch = loop.plan(end)
            if batch is None:
                break
            self.executor.execute(batch)
            loop.complete(batch, end)
            verdict.extra_steps += 1
        if loop.has_work:
            loop.abandon("unfinished when vLLM's steps ran out")
        return verdict, ReplayOutcome([loop], [], end)


def lockstep(decisions, delivered: list[tuple[float, Request]], loop: StepLoop,
             executor: Executor | None = None) -> tuple[Verdict, ReplayOutcome]:
    """Run `loop` through vLLM's recorded steps (`Lockstep`), every step kept."""
    run = Lockstep(delivered, loop, executor)
    for d in decisions:
        run.step(d)
    return run.close()


def _never_delivered(requests: list[Request], delivered: list[tuple[float, Request]]) -> list[Request]:
    """The requests a stopped replay never handed to vLLM."""
    ids = {r.id for _, r in delivered}
    return [r for r in requests if r.id not in ids]


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
    return {"steps_compared": verdict.compared, "steps_identical": verdict.identical,
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
        "policy": sim.get("policy", "vllm"),
        "vllm_version": real.get("vllm_version"),
        "steps_compared": verdict.compared,
        "steps_identical": verdict.identical,
        "identical_fraction": verdict.identical / verdict.compared if verdict.compared else 0.0,
        "extra_steps_ours": verdict.extra_steps,
        "preemptions_vllm": verdict.preemptions_real,
        "preemptions_ours": verdict.preemptions_ours,
        "first_divergence": None if first is None else {"step": first.step, "start_s": first.start,
                                                        "requests": _side_by_side(first)},
        "metrics": {k: {"vllm": real.get(k), "ours": sim.get(k),
                        "diff": (sim[k] - real[k]) if isinstance(real.get(k), (int, float))
                        and isinstance(sim.get(k), (int, float)) else None} for k in METRICS},
    }


def markdown(rep: dict) -> str:
    against = (f"vLLM {rep['vllm_version']}'s own {rep['vllm_scheduler']} in the simulator (policy=vllm_native, "
               f"{rep['kv_blocks']} KV blocks, async scheduling {'on' if rep['async_scheduling'] else 'off'})"
               if rep.get("reference") == NATIVE_POLICY else f"real vLLM {rep['vllm_version']}'s scheduler")
    lines = [f"# Referee: the testbed's `{rep.get('policy', 'vllm')}` policy vs {against}", "",
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
                  markdown_table(["request", "vLLM tokens", "ours", "vLLM preempted", "ours preempted"],
                                 [(r["request"], r["vllm_tokens"], r["ours_tokens"], r["vllm_preempted"],
                                   r["ours_preempted"]) for r in first["requests"]])]
        lines.append("")
    e = rep.get("engine")
    if e:
        lines += ["Our engine in the same lockstep (every batch run by testbed/engine/, same seeded weights):",
                  f"- steps identical: {e['steps_identical']} of {e['steps_compared']}",
                  f"- requests whose generated tokens equal vLLM's: {e['requests_same_tokens']} of "
                  f"{e['requests_compared']}" + (f"; first mismatch: {e['first_token_mismatch']}"
                                                 if e["first_token_mismatch"] else ""), ""]
    if rep.get("reference") == NATIVE_POLICY and first is not None:
        lines += ["The first divergent steps are in divergent_steps.csv (a whole trace's steps are not kept).", ""]
    fmt = (lambda x: "-" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x))  # noqa: E731
    lines.append(markdown_table(["metric", "vLLM", "ours (lockstep)", "diff"],
                                [(k, fmt(m["vllm"]), fmt(m["ours"]), fmt(m["diff"])) for k, m in rep["metrics"].items()]))
    return "\n".join(lines) + "\n"


def steps_frame(verdict: Verdict) -> pd.DataFrame:
    return pd.DataFrame([{"step": c.step, "start_s": c.start, "identical": c.identical,
                          "vllm": json.dumps(c.real, sort_keys=True), "ours": json.dumps(c.ours, sort_keys=True),
                          "vllm_preempted": json.dumps(sorted(c.real_preempted)),
                          "ours_preempted": json.dumps(sorted(c.ours_preempted))} for c in verdict.checks])


def run_referee(cfg: DictConfig, out: str | Path, command: str = "") -> dict:
    """Replay on native vLLM, then the `vllm` policy in lockstep; write and return the report."""
    from testbed.app.analysis.results import write_results
    from testbed.app.assembly.run_setup import finish
    from testbed.app.entry.stop import stop_on_signals
    from testbed.app.assembly.run import run_info
    from testbed.app.assembly.vllm_run import replay_on_vllm

    _check_policy(cfg)
    cfg = without_frontend(cfg, "testbed-referee").copy()
    with open_dict(cfg):
        cfg.backend.name, cfg.backend.scheduler = "vllm", "native"
    got = {}
    with stop_on_signals() as stop:  # a signal ends vLLM's replay at a step: what it ran is refereed and written
        real = replay_on_vllm(cfg, stop, on_done=lambda setup, replay: got.update(setup=setup, replay=replay))
        interrupted = bool(real.summary.get("interrupted"))
        setup, replay = got["setup"], got["replay"]
        t0 = time.perf_counter()
        blocks, block_size = replay.run_record.kv.num_blocks, replay.run_record.kv.block_size
        log.info("lockstep over vLLM's %d steps: the vllm policy, then our engine", len(replay.decisions))
        run = Lockstep(replay.delivered, lockstep_loop(cfg, setup, blocks, block_size))
        for d in replay.decisions:
            run.step(d)
        verdict, outcome = run.close(interrupted, _never_delivered(setup.requests, replay.delivered))
        sim = finish(cfg, setup, outcome, "sim-lockstep", t0)
        rep = report(verdict, real.summary, sim.summary, command)
        rep["interrupted"] = interrupted
        if not interrupted:  # (the engine's side replays vLLM's whole run)
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


def run_native_referee(cfg: DictConfig, out: str | Path, command: str = "") -> dict:
    """The `vllm` policy in lockstep with vLLM's own scheduler in the simulator (`policy=vllm_native`), step by
    step as that run goes (a whole trace's steps are not kept: only the first divergent ones); write and return
    the report. Both see the config's cache (the hardware's KV blocks), budget and async scheduling."""
    import vllm

    from testbed.app.analysis.results import write_results
    from testbed.app.assembly.run import run_info
    from testbed.app.assembly.run_setup import async_scheduling, finish, prepare
    from testbed.app.entry.stop import stop_on_signals
    from testbed.app.assembly.vllm_native_run import native_simulation

    _check_policy(cfg)
    cfg = without_frontend(cfg, "testbed-referee").copy()
    knobs = native_settings(cfg.policy.name, OmegaConf.to_container(cfg.policy, resolve=True))
    native_cfg = cfg.copy()
    with open_dict(native_cfg):
        native_cfg.policy = {"name": NATIVE_POLICY, "chunked_prefill": knobs["enable_chunked_prefill"],
                             "long_prefill_token_threshold": knobs["long_prefill_token_threshold"],
                             "reserve_full_isl": knobs["scheduler_reserve_full_isl"],
                             "scheduling_policy": knobs["scheduling_policy"], "scheduler_cls": None}
    t0 = time.perf_counter()
    setup = prepare(cfg)
    loop = lockstep_loop(cfg, setup, setup.device_blocks, cfg.kv.block_size)
    loop.async_scheduling = async_scheduling(cfg)  # as the simulator sets it (testbed/sim/simulation.py)
    sim = native_simulation(native_cfg, setup, setup.requests)
    run = Lockstep(sim.delivered, loop, keep_all=False)
    sim.on_step = run.step
    log.info("vLLM %s's %s in the simulator, the %s policy in lockstep: %d requests, %d KV blocks, async "
             "scheduling %s", vllm.__version__, type(sim.sched).__name__, cfg.policy.name, len(setup.requests),
             setup.device_blocks, "on" if loop.async_scheduling else "off")
    with stop_on_signals() as stop:  # a signal ends both runs at vLLM's step under way: what ran is written
        outcome = sim.run(stop)
        native = finish(native_cfg, setup, outcome, "sim", t0)
        native.summary.update(vllm_version=vllm.__version__, vllm_scheduler=type(sim.sched).__qualname__)
        t1 = time.perf_counter()
        verdict, ours_outcome = run.close(outcome.interrupted, outcome.not_arrived)
        ours = finish(cfg, setup, ours_outcome, "sim-lockstep", t1)
        rep = report(verdict, native.summary, ours.summary, command)
        rep.update(reference=NATIVE_POLICY, vllm_scheduler=type(sim.sched).__qualname__,
                   kv_blocks=setup.device_blocks, async_scheduling=loop.async_scheduling,
                   interrupted=outcome.interrupted)
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        for name, r, c in ((NATIVE_POLICY, native, native_cfg), ("sim", ours, cfg)):
            write_results(out / name, r.requests, r.steps, r.summary, OmegaConf.to_yaml(c), run_info(r))
        (out / "referee.json").write_text(json.dumps(rep, indent=2, default=float) + "\n")
        (out / "referee.md").write_text(markdown(rep))
        steps_frame(verdict).to_csv(out / "divergent_steps.csv", index=False)
    return rep


def _check_policy(cfg: DictConfig) -> None:
    if cfg.policy.name not in NATIVE_POLICIES:
        raise ValueError(f"policy={cfg.policy.name}: the referee checks the testbed's `vllm` policy against vLLM's "
                         "own scheduler (`vllm_priority` against its --scheduling-policy priority); run it with "
                         "policy=vllm or policy=vllm_priority (its knobs configure both sides)")


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    import sys

    cfg = without_frontend(cfg, "testbed-referee")
    reference = cfg.referee.reference
    if reference not in REFEREE_REFERENCES:
        raise ConfigError(f"referee.reference={reference!r}: expected one of {', '.join(REFEREE_REFERENCES)} "
                          "(vllm: real vLLM with a model on the wall clock; vllm_native: vLLM's scheduler in the simulator)")
    check_config(cfg, backend="vllm" if reference == "vllm" else None)
    command = "testbed-referee " + " ".join(a for a in sys.argv[1:] if not a.startswith("hydra."))
    rep = (run_referee if reference == "vllm" else run_native_referee)(cfg, cfg.output.dir, command)
    print(markdown(rep))
    print(f"results: {cfg.output.dir}")
    return rep


if __name__ == "__main__":
    main()
