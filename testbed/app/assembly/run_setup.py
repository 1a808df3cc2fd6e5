"""What a run is built from, whichever backend runs it: the model, parallel and hardware specs, the
request list (loaded or generated, then transformed), the cost model, the KV block manager, the policy
and router, and the step from what a loop recorded to the per-request table and summary.

Below both the single-pool run (`testbed.app.assembly.run`) and the disaggregated one (`testbed.app.assembly.disagg`),
which share every piece of it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd
from omegaconf import DictConfig, OmegaConf

from testbed import traces
from testbed.core.cost import CostModel
from testbed.sim import cost_models
from testbed.sim.cost_models import block_bytes_per_gpu
from testbed.core.kv import BlockManager
from testbed.core.kv_offload import WRITE_POLICIES, OffloadingBlockManager
from testbed.core.loop import ReplayOutcome, SchedulerLimits, StepLoop
from testbed.app.assembly.spec_decode import drafter_factory, spec_decode_spec
from testbed.core.spec_decode import Drafter, DraftStats
from testbed.app.assembly.frontend import ClientClock, FrontendConfig
from testbed.app.analysis.metrics import SLO, request_table, summarize, take_itl_ms
from testbed.app.assembly.plugins import make_policy, make_router
from testbed.app.assembly.provenance import provenance
from testbed.core.request import Request
from testbed.app.analysis.results import steps_frame
from testbed.core.specs import HardwareSpec, ModelSpec, ParallelSpec, apply_config_json, kv_capacity_blocks
from testbed.vllm_backend.native_sim import NATIVE_POLICY, VLLMNativeKnobs

log = logging.getLogger("testbed")


@dataclass
class RunResult:
    requests: pd.DataFrame
    steps: pd.DataFrame
    summary: dict
    wall_s: float  # the whole of simulate()/replay(): trace, run, results
    run_s: float | None = None  # the simulation (or replay) proper


def _obj(cfg: Any, cls):
    """A typed dataclass instance from a config node (extra keys were rejected by the schema)."""
    data = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)
    return cls(**data)


def resolve_model_spec(node: Any, keep_name: bool | None = None) -> ModelSpec:
    """The run's `ModelSpec` from the `model` config node: its keys, or, when `model.config_json` is
    set, that config.json's shapes (`testbed.core.specs.apply_config_json`), named after the file
    unless `keep_name` (None: whether the command line set `model.name`)."""
    spec = node if isinstance(node, ModelSpec) else _obj(node, ModelSpec)
    if keep_name is None:
        keep_name = _name_set_on_command_line()
    return apply_config_json(spec, keep_name)


def _name_set_on_command_line() -> bool:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.initialized() and any(o.lstrip("+~").startswith("model.name=")
                                             for o in HydraConfig.get().overrides.task)


def parallel_spec(cfg: DictConfig) -> ParallelSpec:
    """The replica's tensor / pipeline parallelism (`parallel.*`; one GPU when the node is absent)."""
    return _obj(cfg.parallel, ParallelSpec) if cfg.get("parallel") is not None else ParallelSpec()


def build_requests(tc: DictConfig, seed: int, notes: dict | None = None
                   ) -> tuple[list[Request], list[tuple[int, str, str]]]:
    """The trace's requests after transforms, and the rows the loader rejected (id, source, reason).
    `notes` (when given) receives the summary keys the trace's handling adds (trace_spread).

    Nothing to simulate is an error (`_nothing_to_simulate`), but for a lenient load (trace.lenient=true)
    whose selected rows were all rejected: lenient means "count bad rows, do not stop", so that run gets
    no request and its rejected rows, and its results say no request was served."""
    rejected: list[tuple[int, str, str]] = []
    load = None
    if tc.kind == "file":
        if not tc.path:
            if tc.format in traces.formats.SOURCES:
                raise ValueError(traces.missing_path(tc.format) + " (trace.kind=file)")
            raise ValueError(f"trace.path is required when trace.kind=file (trace={tc.name} bundles no file: "
                             f"pass trace.path=/path/to/the/file; docs/traces.md says where to get it)")
        load = traces.load_trace(tc.path, tc.format, columns=dict(tc.columns) or None,
                                 time_unit=tc.time_unit, lenient=tc.lenient, start_s=tc.start_s, end_s=tc.end_s,
                                 max_requests=tc.max_requests, row_filter=dict(tc.get("row_filter") or {}) or None)
        reqs = load.requests
    elif tc.kind == "servegen":
        if not tc.path:
            raise ValueError("trace.path is required when trace.kind=servegen: a ServeGen data folder "
                             "(chunk-<id>-trace.csv and chunk-<id>-dataset.json per client)")
        if tc.num_requests is not None:
            raise ValueError("trace.num_requests does not apply to trace.kind=servegen (the data set the rates): "
                             "use trace.max_requests, trace.end_s or trace.duration_s")
        start = tc.start_s or 0.0
        end = tc.end_s if tc.end_s is not None else start + tc.duration_s if tc.duration_s is not None else None
        reqs = traces.servegen(traces.resolve_servegen_path(tc.path), seed=seed, start_s=start, end_s=end,
                               rate_scale=tc.servegen_rate_scale, max_requests=_generator_cut(tc))
    elif tc.kind in ("poisson", "gamma"):
        if tc.lengths_from:
            source = traces.load_trace(tc.lengths_from, tc.lengths_format, lengths_only=True)
            lengths = source.requests
            if not lengths:  # (a bad row fails the load itself, naming its line)
                raise ValueError(f"trace.lengths_from={tc.lengths_from}: no lengths to sample from {source.path}: it "
                                 "has no data rows")
        elif tc.prompt_len and tc.output_len:
            lengths = (tc.prompt_len, tc.output_len)
        elif tc.lengths_format in traces.formats.SOURCES:
            raise ValueError(traces.missing_path(tc.lengths_format, "trace.lengths_from"))
        else:
            raise ValueError("trace: a generator needs lengths_from, or both prompt_len and output_len")
        cut = _generator_cut(tc) if tc.start_s is None and tc.end_s is None else None  # the window rebases from 0
        if tc.kind == "poisson":
            reqs = traces.poisson(tc.rate, n=tc.num_requests, duration=tc.duration_s, lengths=lengths, seed=seed,
                                  max_requests=cut)
        else:
            reqs = traces.gamma(tc.rate, tc.cv, n=tc.num_requests, duration=tc.duration_s, lengths=lengths, seed=seed,
                                max_requests=cut)
    else:
        raise ValueError(f"trace.kind={tc.kind!r}: expected file, poisson, gamma or servegen")
    if tc.spread != "none":
        bucket = tc.spread_bucket_s if tc.spread_bucket_s is not None else traces.detect_bucket_s(reqs)
        reqs = traces.spread_arrivals(reqs, tc.spread, bucket, seed)
        if notes is not None:
            notes.update(trace_spread=tc.spread, trace_spread_bucket_s=bucket)
    loaded = reqs
    if tc.start_s is not None or tc.end_s is not None:
        reqs = traces.time_window(reqs, tc.start_s or 0.0, tc.end_s if tc.end_s is not None else float("inf"))
    if tc.max_requests is not None:
        reqs = traces.first_n(reqs, tc.max_requests)
    if load is not None:  # only the bad rows inside the selection count against it
        rejected = [(r.id, f"{r.file}:{r.line}", f"{_reject_kind(r)}: field {r.field}: {r.reason}") for r in
                    traces.rejected_in_selection(load.rejected, loaded, reqs, tc.start_s, tc.end_s)]
    if tc.rate_scale != 1.0:
        reqs = traces.scale_rate(reqs, tc.rate_scale)
    if tc.max_prompt_len is not None or tc.max_output_len is not None:
        reqs = traces.cap_lengths(reqs, max_prompt=tc.max_prompt_len, max_output=tc.max_output_len)
    if not reqs and not (tc.lenient and rejected):
        raise ValueError(_nothing_to_simulate(tc, load))
    if not reqs:  # lenient: count bad rows, do not stop; every row selected was bad, so none is served
        log.warning("trace.lenient=true: all %d rows selected from %s were rejected (first: %s): nothing is "
                    "served; the results count them", len(rejected), load.path if load else tc.kind, rejected[0][2])
    return reqs, rejected


def expected_requests(tc: DictConfig) -> tuple[str, Any, float]:
    """(the key that sets it, its value, about how many requests) the trace section will build, before
    anything is loaded or drawn: what a generator's rates and span give (capped by the max_requests cut it
    honours), or trace.max_requests for a file (0 when unset: a file's requests are counted once loaded)."""
    cut = _generator_cut(tc)
    if tc.kind == "servegen" and tc.path:
        from testbed.traces.servegen import expected_requests as servegen_expected

        start = tc.start_s or 0.0
        end = tc.end_s if tc.end_s is not None else start + tc.duration_s if tc.duration_s is not None else None
        mean = servegen_expected(traces.read_servegen(traces.resolve_servegen_path(tc.path)), start_s=start,
                                 end_s=end, rate_scale=tc.servegen_rate_scale)
        if cut is not None and cut < mean:
            return "trace.max_requests", cut, cut
        return "trace.servegen_rate_scale", tc.servegen_rate_scale, mean
    if tc.kind in ("poisson", "gamma"):
        if tc.num_requests is not None:
            return "trace.num_requests", tc.num_requests, tc.num_requests
        if tc.duration_s is not None and tc.rate is not None:
            mean = tc.rate * tc.duration_s
            if cut is not None and tc.start_s is None and tc.end_s is None and cut < mean:
                return "trace.max_requests", cut, cut
            return "trace.rate", tc.rate, mean
    return ("trace.max_requests", tc.max_requests, tc.max_requests) if tc.max_requests else ("trace.path", tc.path, 0)


def check_memory(cfg: DictConfig, model: ModelSpec, pools: list[tuple[str, int, int]] | None = None,
                 num_requests: int | None = None) -> None:
    """Refuse a simulation whose estimated memory (`testbed.app.assembly.memory_budget`) exceeds the budget, before
    it is built. `pools`: (key, replicas, device KV blocks each); by default backend.replicas replicas of
    this config's blocks. `num_requests`: the requests as built; by default `expected_requests`'s."""
    from testbed.app.assembly.memory_budget import check_fits, replica_term, request_term

    if pools is None:
        pools = [("backend.replicas", cfg.backend.replicas,
                  device_kv_blocks(cfg, model, _obj(cfg.hardware, HardwareSpec)))]
    key, value, count = expected_requests(cfg.trace)
    if num_requests is not None:
        count = num_requests
    check_fits([*(replica_term(k, n, blocks) for k, n, blocks in pools), request_term(key, value, count)],
               cfg.backend.get("memory_budget_gb"))


def _generator_cut(tc: DictConfig) -> int | None:
    """trace.max_requests for a generator to stop at (it then generates no more than the selection keeps),
    or None where the selection's first requests depend on more than the first generated: spreading
    arrivals over buckets places a bucket's requests by how many share it."""
    return tc.max_requests if tc.spread == "none" else None


def _reject_kind(row: traces.RejectedRow) -> str:
    """A request the trace itself records as failed (BurstGPT's 0 response tokens) is no damaged row."""
    return "failed-in-trace" if row.reason == traces.formats.BURSTGPT_FAILED else "invalid-row"


def _nothing_to_simulate(tc: DictConfig, load: traces.TraceLoad | None) -> str:
    """Why a trace section left no request, naming the file or the keys that emptied it.

    A run without requests has no latency to report; saying why beats a numpy error
    deep in the metrics (or a result folder of empty tables that looks like a success).
    """
    where = load.path if load is not None else f"the {tc.kind} generator"
    if load is not None and load.rows == 0:
        return f"nothing to simulate: the trace file {where} has no data rows"
    if load is not None and not load.requests:
        return (f"nothing to simulate: all {load.rows} rows of {where} were rejected "
                f"(first: {load.rejected[0]})")
    keys = ", ".join(f"trace.{k}={tc[k]}" for k in ("start_s", "end_s") if tc[k] is not None)
    reqs = load.requests if load is not None else []
    span = f" (they arrive from {reqs[0].arrival:g} to {reqs[-1].arrival:g} s)" if reqs else ""
    return f"nothing to simulate: {keys} selects none of the {len(reqs)} requests of {where}{span}"


def build_cost_model(cfg: DictConfig, model: ModelSpec, hw: HardwareSpec, notes: dict | None = None) -> CostModel:
    """The cost model of cost_model.name, with speculative decoding's drafting when spec_decode is on
    (`testbed.sim.cost_models.assemble`). `notes` (when given) receives `cost_model_fallback` when the
    roofline stood in for the kernel model."""
    return cost_models.assemble(cost_model_spec(cfg), model, hw, notes,
                                check_profile=lambda cost: check_profile_machine(cost, cfg))


def cost_model_spec(cfg: DictConfig) -> cost_models.CostModelSpec:
    """The config's cost model as plain values: `cost_model.*`, and what of the run it prices by (the KV
    block size, the batch bound, the parallelism, async scheduling, the host tier, the requests' sampling,
    speculative decoding)."""
    cc, sc = cfg.cost_model, cfg.scheduler
    own = {f.name: cc.get(f.name, f.default) for f in dataclasses.fields(cost_models.CostModelSpec)
           if f.name in cost_models.COST_MODEL_KEYS}
    sampling = cfg.get("sampling") or {}
    return cost_models.CostModelSpec(
        **own, block_size=cfg.kv.block_size, parallel=parallel_spec(cfg),
        max_tokens=max(sc.max_num_batched_tokens, sc.max_num_seqs), async_scheduling=async_scheduling(cfg),
        offload=bool(cfg.kv.get("offload_gb")), sampling={k: sampling.get(k) for k in cost_models.SAMPLING_KEYS},
        generation_config=sampling.get("generation_config", "auto"), spec_decode=spec_decode_spec(cfg))


def check_profile_machine(cost, cfg: DictConfig, device: str | None = None, threads: int | None = None,
                          then: str = "then cost_model=profile cost_model.profile=my_profile.csv") -> list:
    """Warn when a profile's machine or software differs from this one in what moves step times
    (`testbed.engine.machine`); returns the differences. A simulation compares only CPU profiles (a GPU
    profile stands for that GPU wherever the simulation runs) and knows no device of its own; torch's
    threads are `profile.threads` when set. testbed-fidelity passes the real engine's device and threads."""
    from testbed.engine.machine import describe_machine, warn_if_other_machine

    header = cost.header
    if device is None and header.get("device_type", "cpu") != "cpu":
        return []
    if threads is None:
        threads = (cfg.get("profile") or {}).get("threads")
    dtype = (cfg.backend.get("dtype") if "backend" in cfg else None) or cfg.model.get("dtype")
    current = describe_machine(device=device, dtype=dtype, threads=threads)
    if threads is None:
        current["torch_threads"] = None  # a simulation has no torch threads of its own
    return warn_if_other_machine(header, cost.path or cost.name, current, model_preset(), then)


def model_preset() -> str | None:
    """The `model=` preset this run was started with (under a Hydra entry point), else None."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return HydraConfig.get().runtime.choices.get("model")
    except Exception:  # not under a Hydra entry point (the Python API)
        return None


def offload_kv_blocks(cfg: DictConfig, model: ModelSpec) -> int:
    """Host KV tier capacity in blocks (kv.offload_gb; 0: no tier)."""
    policy = cfg.kv.get("offload_write_policy", "write_through")
    if policy not in WRITE_POLICIES:
        raise ValueError(f"kv.offload_write_policy={policy!r}: expected one of {', '.join(WRITE_POLICIES)}")
    gb = cfg.kv.get("offload_gb") or 0.0
    if not gb:
        return 0
    n = int(gb * 1e9 // block_bytes_per_gpu(cfg.kv.block_size, model, parallel_spec(cfg)))
    if n < 1:
        raise ValueError(f"kv.offload_gb={gb}: holds no KV block of {model.name} "
                         f"({block_bytes_per_gpu(cfg.kv.block_size, model, parallel_spec(cfg)) / 1e9:.3g} GB a block per GPU); set 0 or more")
    return n


def device_kv_blocks(cfg: DictConfig, model: ModelSpec, hw: HardwareSpec) -> int:
    """Device KV capacity in blocks: set explicitly, or what the memory left after the weights holds."""
    kc = cfg.kv
    if kc.block_size < 1:
        raise ValueError(f"kv.block_size={kc.block_size}: must be >= 1")
    if kc.num_blocks is not None:
        if kc.num_blocks < 1:
            raise ValueError(f"kv.num_blocks={kc.num_blocks}: must be >= 1")
        device = kc.num_blocks
    else:
        device = kv_capacity_blocks(model, hw, kc.block_size, kc.memory_utilization, kc.activation_reserve_gb * 1e9,
                                    parallel_spec(cfg))
    return device


@dataclass
class Setup:
    """Everything a backend needs, built once from the config."""

    model: ModelSpec
    hardware: HardwareSpec
    slo: SLO
    requests: list[Request]
    load_rejects: list[tuple[int, str, str]]
    cost: CostModel
    device_blocks: int
    host_blocks: int
    limits: SchedulerLimits
    knobs: dict
    frontend: FrontendConfig = field(default_factory=FrontendConfig)  # none: the engine's own times
    offload_blocks: int = 0  # the host KV tier behind the prefix cache (kv.offload_gb)
    drafter: Callable[[], Drafter] | None = None  # speculative decoding (spec_decode.method); None: off
    trace_notes: dict = field(default_factory=dict)  # summary keys of the trace's handling (trace_spread)
    cost_notes: dict = field(default_factory=dict)  # cost_model_fallback, when the roofline stood in for kernels

    def make_loop(self, cfg: DictConfig, device_blocks: int | None = None) -> StepLoop:
        args = (device_blocks or self.device_blocks, cfg.kv.block_size, cfg.kv.enable_prefix_caching,
                self.host_blocks, cfg.kv.cache_decode_tokens)
        kv = (OffloadingBlockManager(*args, self.offload_blocks, cfg.kv.offload_write_policy) if self.offload_blocks
              else BlockManager(*args))
        return StepLoop(make_policy(cfg.policy.name, **self.knobs), kv, self.limits, self.cost,
                        record_token_times=cfg.output.record_token_times,
                        drafter=self.drafter() if self.drafter is not None else None)


def prepare(cfg: DictConfig, model: ModelSpec | None = None, device_blocks: int | None = None,
            requests: list[Request] | None = None) -> Setup:
    """`requests`: a workload built by the caller (testbed-validate rebuilds a real run's), instead of cfg.trace."""
    model = model or resolve_model_spec(cfg.model)
    hw = _obj(cfg.hardware, HardwareSpec)
    slo = _obj(cfg.slo, SLO)
    slo.validate()
    frontend = _obj(cfg.frontend, FrontendConfig) if "frontend" in cfg else FrontendConfig()
    frontend.validate()
    notes: dict = {}
    reqs, load_rejects = (requests, []) if requests is not None else build_requests(cfg.trace, cfg.seed, notes)
    drafter = drafter_factory(cfg)
    cost_notes: dict = {}
    cost = build_cost_model(cfg, model, hw, cost_notes)
    blocks = device_blocks if device_blocks is not None else device_kv_blocks(cfg, model, hw)
    host_blocks = int(cfg.kv.swap_space_gb * 1e9 // block_bytes_per_gpu(cfg.kv.block_size, model, parallel_spec(cfg)))  # vLLM's swap_space: per GPU
    limits = SchedulerLimits(cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs,
                             cfg.scheduler.max_model_len or model.max_model_len)
    knobs = {k: v for k, v in OmegaConf.to_container(cfg.policy, resolve=True).items() if k != "name"}
    if cfg.policy.name == NATIVE_POLICY:  # vLLM's own scheduler decides (testbed/app/assembly/vllm_native_run.py)
        VLLMNativeKnobs(**knobs)
    else:
        make_policy(cfg.policy.name, **knobs)  # fail on bad knobs before anything runs
    return Setup(model, hw, slo, reqs, load_rejects, cost, blocks, host_blocks, limits, knobs, frontend,
                 offload_kv_blocks(cfg, model), drafter, notes, cost_notes)


def async_scheduling(cfg: DictConfig) -> bool:
    """backend.async_scheduling as the simulator runs it: true or false as set; null is vLLM's own default
    (VllmConfig, vllm/config/vllm.py L589-622 of 0.15.1: on unless speculative decoding is not EAGLE/MTP, as
    ngram and draft models are not), and off for the disaggregated pools, which do not model it."""
    value = cfg.backend.get("async_scheduling")
    if value is not None:
        return bool(value)
    if cfg.get("disagg") is not None and cfg.disagg.get("enabled"):
        return False
    return (cfg.get("spec_decode") or {}).get("method", "none") == "none"


def finish(cfg: DictConfig, setup: Setup, outcome: ReplayOutcome, backend: str, t0: float,
           clock: ClientClock | None = None) -> RunResult:
    """The per-request table and the summary of a replay, whichever backend ran it. `clock` turns
    the engine's times into the client's when a front end was modelled (None: they are the same)."""
    if clock is None and not setup.frontend.is_off:  # check_config refuses it first; a direct call must too
        raise ValueError(f"frontend={setup.frontend.name}: backend={backend} has no HTTP front end to model "
                         "(the simulator's only): use frontend=none")
    states = [(i, s) for i, loop in enumerate(outcome.loops) for s in loop.states]
    table = request_table(states, outcome.not_arrived, setup.load_rejects,
                          "interrupted before it arrived" if outcome.interrupted else "arrives after the horizon", clock,
                          outcome.not_arrived_reasons)
    loops = outcome.loops
    summary = summarize(table, None, setup.slo, (sum(l.kv.hit_tokens for l in loops), sum(l.kv.queried_tokens for l in loops)),
                        clock.tail_s if clock is not None else 0.0, itl_ms=take_itl_ms(loops))
    summary.update(policy=cfg.policy.name, trace=cfg.trace.name, model=setup.model.name, hardware=setup.hardware.name,
                   cost_model=setup.cost.name, backend=backend, kv_blocks=loops[0].kv.num_blocks,
                   block_size=cfg.kv.block_size, seed=cfg.seed, stalled=outcome.stalled,
                   interrupted=outcome.interrupted,
                   num_steps=sum(sum(l.series.steps[:len(l.series.duration)]) for l in loops),
                   num_events=sum(len(l.series.duration) for l in loops),
                   frontend=setup.frontend.name if clock is not None else "none")
    summary.update(setup.trace_notes)
    summary.update(provenance(cfg, setup.cost, backend, backend == "sim" and async_scheduling(cfg),
                              setup.cost_notes.get("cost_model_fallback")))
    if len(loops) > 1:  # which router spread the arrivals, and how evenly
        routed = [len(l.states) for l in loops]
        summary.update(router=cfg.router.name if cfg.get("router") is not None else "round_robin",
                       routed_max_share=max(routed) / max(sum(routed), 1))
    if setup.offload_blocks:
        summary.update(offload_summary([l.kv for l in loops]))
    if setup.drafter is not None:
        summary.update(spec_summary(cfg, loops))
    rows = len(setup.requests) + len(setup.load_rejects)
    if summary["num_requests"] != rows:
        raise AssertionError(f"accounting broke: {summary['num_requests']} result rows for {rows} trace rows")
    return RunResult(table, steps_frame([l.series for l in loops]), summary, time.perf_counter() - t0)


def spec_summary(cfg: DictConfig, loops: list[StepLoop]) -> dict:
    """Speculative decoding's figures over the loops that drafted (vLLM's names: testbed.core.spec_decode)."""
    stats = DraftStats()
    for l in loops:
        if l.drafter is not None:
            stats.add(l.drafter.stats)
    return dict(spec_decode_method=cfg.spec_decode.method,
                num_speculative_tokens=cfg.spec_decode.num_speculative_tokens, **stats.summary())


def offload_summary(kvs: list[OffloadingBlockManager]) -> dict:
    """The host tier's figures, named as vLLM reports a KV connector's: `external_prefix_cache_hit_rate`
    is tokens loaded from host over tokens looked up past the device hit (vllm/v1/core/sched/scheduler.py
    L1041-1042); `prefix_cache_hit_rate` stays the device cache's alone. `total_prefix_hit_rate`: tokens
    not recomputed (device hits + host loads) over every token looked up."""
    loaded, looked_up = sum(k.offload_hit_tokens for k in kvs), sum(k.offload_queried_tokens for k in kvs)
    queried = sum(k.queried_tokens for k in kvs)
    return {"offload_blocks": kvs[0].num_offload_blocks if kvs else 0,
            "offload_write_policy": "write_through" if kvs and kvs[0].write_through else "write_back",
            "offload_hit_tokens": int(loaded),
            "offload_loaded_blocks": int(sum(k.loaded_blocks for k in kvs)),
            "external_prefix_cache_hit_rate": loaded / looked_up if looked_up else 0.0,
            "total_prefix_hit_rate": (sum(k.hit_tokens for k in kvs) + loaded) / queried if queried else 0.0}


def build_router(cfg: DictConfig):
    """The config's router (`router=<name>`, knobs under `router.*`); round robin when the config has none."""
    node = cfg.get("router")
    if node is None:
        return make_router("round_robin")
    knobs = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "name"}
    return make_router(node.name, **knobs)


@contextlib.contextmanager
def progress_bar(cfg: DictConfig, requests: list[Request]):
    """A tqdm bar over the trace's arrivals (simulated seconds), or None when it would be noise."""
    show = cfg.output.progress
    if show is None:
        show = sys.stderr.isatty() and not os.environ.get("CI") and not in_multirun()
    if not show or not requests:
        yield None
        return
    from tqdm import tqdm

    span = requests[-1].arrival
    with tqdm(total=round(span), unit="s", desc=f"{cfg.policy.name} on {cfg.trace.name} (simulated s)",
              leave=False) as bar:
        def update(now: float, delivered: int) -> None:
            bar.n = min(round(now), bar.total)
            bar.set_postfix(requests=delivered, refresh=False)
            bar.refresh()

        yield update


def in_multirun() -> bool:
    """Whether this is a job of a Hydra multirun (a sweep)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
