"""A disaggregated run from its config: one `Setup` per pool, the simulation, the results.

Each pool is the run's replica with the `disagg.<pool>` overrides applied to a copy of the config
(hardware preset, tensor parallelism, policy, scheduler limits, KV blocks), so `prepare` builds its
cost model, KV capacity and policy exactly as it builds a co-located replica's. The results have the
same columns and summary keys as any run, plus the handoff's: per request the prefill and decode
replica, when its prefill ended (`prefilled_s`, engine time) and the time spent waiting for decode KV space (`kv_wait_ms`), for the link
(`kv_link_wait_ms`) and in the transfer (`kv_transfer_ms`); per pool its size, GPUs and utilisation
(the share of the run each replica spent in steps, averaged over the pool).
"""
from __future__ import annotations

import copy
import math
import time
from importlib import resources
from typing import Callable

import numpy as np
from omegaconf import DictConfig, OmegaConf

from testbed.app.assembly.provenance import provenance
from testbed.app.assembly.run_setup import (RunResult, build_requests, build_router, check_memory, parallel_spec, prepare,
                                   progress_bar, resolve_model_spec, spec_summary)
from testbed.app.assembly.frontend import to_engine_queue
from testbed.app.analysis.metrics import request_table, summarize, take_itl_ms
from testbed.core.request import Request, RequestState, Status
from testbed.core.specs import HardwareSpec, ModelSpec
from testbed.sim.disaggregated import DisaggOutcome, DisaggSimulation, Handoff, Pool
from testbed.sim.kv_link import KVLink, transfer_bytes_per_token

POOLS = ("prefill", "decode")


def hardware_preset(name: str) -> dict:
    """The keys of testbed/conf/hardware/<name>.yaml (its Hydra defaults list dropped)."""
    folder = resources.files("testbed") / "conf" / "hardware"
    path = folder / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))
        raise ValueError(f"hardware={name!r}: no such preset; expected one of {', '.join(known)}")
    node = OmegaConf.to_container(OmegaConf.load(str(path)))
    node.pop("defaults", None)
    return node


def pool_config(cfg: DictConfig, pool: str) -> DictConfig:
    """The run's config with `disagg.<pool>`'s overrides applied: what one replica of the pool is."""
    node = cfg.disagg[pool]
    out = copy.deepcopy(cfg)
    if node.hardware is not None:
        out.hardware = OmegaConf.structured(HardwareSpec(**hardware_preset(node.hardware)))
    if node.tensor_parallel_size is not None:
        out.parallel.tensor_parallel_size = node.tensor_parallel_size
    if node.policy is not None:
        OmegaConf.set_struct(out, False)
        out.policy = {"name": node.policy}
        OmegaConf.set_struct(out, True)
    for key in ("max_num_batched_tokens", "max_num_seqs"):
        if node[key] is not None:
            out.scheduler[key] = node[key]
    if node.num_blocks is not None:
        out.kv.num_blocks = node.num_blocks
    return out


def check_disagg(cfg: DictConfig) -> None:
    """What the disaggregated simulator cannot honour, refused before anything is built."""
    if cfg.backend.name != "sim":
        raise ValueError(f"disagg.enabled=true: the simulator's only; backend={cfg.backend.name} serves one "
                         "co-located replica")
    if cfg.backend.replicas != 1:
        raise ValueError(f"backend.replicas={cfg.backend.replicas}: with disagg.enabled=true the pools' sizes are "
                         "disagg.prefill.replicas and disagg.decode.replicas; leave backend.replicas at 1")
    if cfg.backend.async_scheduling:
        raise ValueError("backend.async_scheduling=true: not modelled with disagg.enabled=true; leave it at null "
                         "(vLLM's default; the pools then run without it, and the summary says so) or set it false")
    if cfg.kv.get("offload_gb"):
        raise ValueError(f"kv.offload_gb={cfg.kv.offload_gb}: the host KV tier is not modelled with "
                         "disagg.enabled=true; set 0")


def simulate_disagg(cfg: DictConfig, stop: Callable[[], bool] | None = None, model: ModelSpec | None = None,
                    requests: list[Request] | None = None):
    """Simulate the config's run on a prefill pool and a decode pool (`disagg.*`)."""
    t0 = time.perf_counter()
    check_disagg(cfg)
    link = KVLink.from_config(cfg.disagg.link)
    model = model or resolve_model_spec(cfg.model)
    notes: dict = {}
    reqs, load_rejects = (requests, []) if requests is not None else build_requests(cfg.trace, cfg.seed, notes)
    cfgs, setups = {}, {}
    for name in POOLS:
        try:
            cfgs[name] = pool_config(cfg, name)
            setups[name] = prepare(cfgs[name], model=model, requests=reqs)
            setups[name].trace_notes.update(notes)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"disagg.{name}: {e.args[0] if e.args else e}") from None
    check_memory(cfg, model, [(f"disagg.{name}.replicas", cfg.disagg[name].replicas, setups[name].device_blocks)
                              for name in POOLS], len(reqs))
    frontend = setups["prefill"].frontend
    engine_requests, clock = to_engine_queue(reqs, frontend)
    pools = {name: Pool(name, [setups[name].make_loop(cfgs[name]) for _ in range(cfg.disagg[name].replicas)],
                        setups[name].cost, build_router(cfg)) for name in POOLS}
    per_token = transfer_bytes_per_token(model, parallel_spec(cfgs["prefill"]), parallel_spec(cfgs["decode"]))
    with progress_bar(cfg, engine_requests) as progress:
        sim = DisaggSimulation(engine_requests, pools["prefill"], pools["decode"], link, per_token,
                               cfg.backend.horizon_s, progress, cfg.backend.fast_forward)
        outcome = sim.run(stop)
    table, summary = disagg_results(cfg, cfgs, setups, outcome, load_rejects, clock, link, per_token)
    rows = len(reqs) + len(load_rejects)
    if summary["num_requests"] != rows:
        raise AssertionError(f"accounting broke: {summary['num_requests']} result rows for {rows} trace rows")
    from testbed.app.analysis.results import steps_frame

    steps = steps_frame([l.series for l in outcome.prefill.loops + outcome.decode.loops])
    if len(steps):
        steps.insert(1, "pool", np.where(steps["replica"] < len(outcome.prefill.loops), "prefill", "decode"))
    return RunResult(table, steps, summary, time.perf_counter() - t0)


def client_state(h: Handoff, num_prefill: int, end_reason: str) -> tuple[int, RequestState]:
    """(replica, state) of one request as its client saw it: the decode replica's state once the KV
    landed (decode replicas numbered after the prefill ones), with the prefill's first schedule,
    preemptions and prefix hits folded in; else a state of the trace's request saying where it stopped."""
    if h.rejected is not None:
        return -1, h.rejected
    p, d = h.prefill, h.decode
    if d is not None and h.landed_s >= 0:
        d.first_scheduled = p.first_scheduled
        d.num_preemptions += p.num_preemptions
        d.prefix_hit_tokens += p.prefix_hit_tokens
        return num_prefill + h.decode_replica, d
    s = RequestState(h.req, first_scheduled=p.first_scheduled, num_preemptions=p.num_preemptions,
                     prefix_hit_tokens=p.prefix_hit_tokens)
    if p.status is Status.REJECTED:
        s.status, s.reject_reason, s.finish_time = Status.REJECTED, p.reject_reason, p.finish_time
    elif p.status is Status.FINISHED:  # prefilled; its KV never reached the decode replica
        where = "waiting for decode KV space" if h.reserved_s < 0 else "KV in transfer to the decode pool"
        s.reject_reason = f"{end_reason} ({where})"
    else:
        s.reject_reason = p.reject_reason or end_reason
    return h.prefill_replica, s


def _ms(a: float, b: float) -> float:
    return (b - a) * 1e3 if a >= 0 and b >= 0 else math.nan


def disagg_results(cfg: DictConfig, cfgs: dict, setups: dict, outcome: DisaggOutcome, load_rejects, clock,
                   link: KVLink, per_token: int):
    pre, dec = outcome.prefill, outcome.decode
    states = [client_state(h, len(pre.loops), outcome.end_reason) for h in outcome.handoffs]
    table = request_table(states, outcome.not_arrived, load_rejects,
                          "interrupted before it arrived" if outcome.interrupted else "arrives after the horizon",
                          clock)
    extra = {h.req.id: (h.prefill_replica, h.decode_replica, h.prefilled_s if h.prefilled_s >= 0 else math.nan,
                        _ms(h.prefilled_s, h.reserved_s), _ms(h.reserved_s, h.sending_s), _ms(h.sending_s, h.landed_s))
             for h in outcome.handoffs}
    for k, col in enumerate(("prefill_replica", "decode_replica", "prefilled_s", "kv_wait_ms", "kv_link_wait_ms",
                             "kv_transfer_ms")):
        default = -1 if k < 2 else math.nan
        table[col] = table["id"].map(lambda i, k=k, d=default: extra[i][k] if i in extra else d)
    loops = pre.loops + dec.loops
    summary = summarize(table, None, setups["prefill"].slo,
                        (sum(l.kv.hit_tokens for l in loops), sum(l.kv.queried_tokens for l in loops)),
                        clock.tail_s if clock is not None else 0.0, itl_ms=take_itl_ms(dec.loops))
    summary.update(policy=cfg.policy.name, trace=cfg.trace.name, model=setups["prefill"].model.name,
                   hardware=setups["prefill"].hardware.name, cost_model=setups["prefill"].cost.name, backend="sim",
                   kv_blocks=pre.loops[0].kv.num_blocks, block_size=cfg.kv.block_size, seed=cfg.seed,
                   stalled=outcome.stalled, interrupted=outcome.interrupted,
                   num_steps=sum(sum(l.series.steps[:len(l.series.duration)]) for l in loops),
                   num_events=sum(len(l.series.duration) for l in loops),
                   frontend=setups["prefill"].frontend.name if clock is not None else "none",
                   router=cfg.router.name if cfg.get("router") is not None else "round_robin")
    summary.update(setups["prefill"].trace_notes)
    summary.update(provenance(cfgs["prefill"], setups["prefill"].cost, "sim", False,
                              setups["prefill"].cost_notes.get("cost_model_fallback")))
    decode = provenance(cfgs["decode"], setups["decode"].cost, "sim", False,
                        setups["decode"].cost_notes.get("cost_model_fallback"))
    for key in ("cost_model_data", "cost_model_fallback"):  # a decode pool on other hardware reads other tables
        if decode.get(key) != summary.get(key):
            summary[f"decode_{key}"] = decode.get(key)
    summary.update(disagg_summary(cfg, cfgs, setups, outcome, table, link, per_token))
    if setups["decode"].drafter is not None:
        summary.update(spec_summary(cfg, dec.loops))
    return table, summary


def disagg_summary(cfg, cfgs, setups, outcome: DisaggOutcome, table, link: KVLink, per_token: int) -> dict:
    """The pools and the link: sizes, GPUs, utilisation, and the handoff's waits and transfer times."""
    out: dict = {"disagg": True, "kv_link": link.name, "kv_link_GBps": link.bandwidth * link.efficiency / 1e9,
                 "kv_link_latency_us": link.latency_s * 1e6, "kv_transfer_bytes_per_token": per_token}
    first = table["engine_arrival_s"].min()
    span = outcome.end_time - first if np.isfinite(first) and outcome.end_time > first else 0.0
    for name, pool in (("prefill", outcome.prefill), ("decode", outcome.decode)):
        c = cfgs[name]
        gpus = c.parallel.tensor_parallel_size * c.parallel.pipeline_parallel_size
        routed = [len(l.states) for l in pool.loops]
        out.update({f"{name}_replicas": len(pool.loops), f"{name}_gpus": gpus * len(pool.loops),
                    f"{name}_hardware": setups[name].hardware.name, f"{name}_policy": c.policy.name,
                    f"{name}_tensor_parallel_size": c.parallel.tensor_parallel_size,
                    f"{name}_kv_blocks": pool.loops[0].kv.num_blocks,
                    f"{name}_utilization": float(np.mean(pool.busy_s) / span) if span else 0.0,
                    f"{name}_routed_max_share": max(routed) / max(sum(routed), 1)})
    for col in ("kv_transfer_ms", "kv_wait_ms", "kv_link_wait_ms"):
        v = table[col].to_numpy(float)
        v = v[~np.isnan(v)]
        out[f"mean_{col}"] = float(v.mean()) if v.size else None
        out[f"p99_{col}"] = float(np.percentile(v, 99)) if v.size else None
    return out
