"""`sglang` against SGLang 0.5.23's real scheduler, step by step, on every referee scenario.

experiments/sglang_referee/real_steps.jsonl holds what SGLang's real Scheduler methods,
PrefillAdder, SchedulePolicy, RadixCache and ScheduleBatch decided on each scenario of
experiments/sglang_referee/scenarios.json (recorded by sglang_scheduler_real.py; `--check`
re-runs it). Here our policy runs each scenario in the simulator with the same settings and
every non-idle step must match: {request id: tokens}, the requests retracted, and the cached
prefix each admitted request matched. No SGLang needed.

Time mapping: the driver runs one step per integer index and adds a request to the waiting
queue before the step whose index is its arrival_step; a step with no batch is "idle". Here
every step lasts exactly 1.0 (FixedCost(1.0, 0)), a request arrives at time arrival_step, and
is visible to a step starting at or after its arrival (the simulator's arrival process fires
before a step that starts at the same instant: its timeout is always scheduled first). When
nothing runs the simulator jumps to the next arrival, which is exactly when the driver's idle
steps end, so our step starting at time t is the driver's step t; only non-idle steps are
compared (we have no idle steps to compare).
"""
from __future__ import annotations

import json
import os

import pytest

from conftest import FixedCost, make_loop
from testbed.core.request import Request
from testbed.policies import make_policy
from testbed.sim.simulation import Simulation

HERE = os.path.join(os.path.dirname(__file__), "..", "experiments", "sglang_referee")
with open(os.path.join(HERE, "scenarios.json")) as f:
    SCENARIOS = {s["name"]: s for s in json.load(f)}
with open(os.path.join(HERE, "real_steps.jsonl")) as f:
    REAL = {d["name"]: d["steps"] for d in map(json.loads, filter(str.strip, f))}

# scenarios where ours and SGLang differ for a reason documented here (none may be silently skipped)
EXPECTED_DIVERGENCES: dict[str, str] = {}


def knobs_of(sc) -> dict:
    k = dict(schedule_policy=sc["schedule_policy"].replace("-", "_"),
             chunked_prefill_size=sc["chunked_prefill_size"], ignore_eos=sc["ignore_eos"],
             max_running_requests=sc["max_running_requests"], max_prefill_tokens=sc["max_prefill_tokens"])
    ratio = sc.get("env", {}).get("SGLANG_INIT_NEW_TOKEN_RATIO")
    if ratio is not None:
        k["init_new_token_ratio"] = float(ratio)
    return k


def run_ours(sc) -> list[dict]:
    """Our steps, as the driver records them: step index, tokens, retracted, cache_hit."""
    pol = make_policy("sglang", **knobs_of(sc))
    reqs = [Request(id=r["id"], arrival=float(r["arrival_step"]), prompt_len=r["prompt_len"],
                    output_len=r["output_len"], prefix_hashes=tuple(r["prefix_ids"]),
                    prefix_block_tokens=r["prefix_block_tokens"], source=f"{sc['name']}:{r['id']}")
            for r in sorted(sc["requests"], key=lambda r: r["arrival_step"])]
    steps: list[dict] = []
    retracted: list[str] = []
    # requests admitted whose (re)computed sequence is not complete yet: SGLang runs their chunks as
    # prefill (extend) steps, the last one included, even one token long (a retracted request's recompute)
    prefilling: set = set()

    def factory():
        loop = make_loop(pol, num_blocks=sc["kv_tokens"], block_size=sc["page_size"],
                         budget=sc["max_prefill_tokens"] + sc["chunked_prefill_size"], max_seqs=sc["max_running_requests"],
                         max_len=sc["context_len"], cost=cost, cache_decode_tokens="finished")
        inner = loop._apply

        def apply(plan, shape, now, swap_out):
            before = {id(s): (s.status, s.prefix_hit_tokens) for s, _ in plan.items}
            out = inner(plan, shape, now, swap_out)
            loop.kv.check_invariants(loop.states)  # the radix tree's shape, stamps and free counts too
            retracted.extend(str(s.req.id) for s, _ in plan.preempt)
            if plan.items:
                assert now == int(now), now
                prefill = any(before[id(s)][0].value != "running" or s.req.id in prefilling for s, _ in plan.items)
                for s, n in plan.items:
                    if s.num_computed + n < s.known_len:
                        prefilling.add(s.req.id)
                    else:
                        prefilling.discard(s.req.id)
                rec = {"step": int(now), "kind": "prefill" if prefill else "decode",
                       "tokens": {str(s.req.id): n for s, n in plan.items}, "retracted": list(retracted)}
                if prefill:
                    rec["cache_hit"] = {str(s.req.id): s.prefix_hit_tokens - before[id(s)][1]
                                        for s, _ in plan.items if before[id(s)][0].value != "running"}
                retracted.clear()
                steps.append(rec)
            return out
        loop._apply = apply
        return loop

    cost = FixedCost(1.0, 0.0)
    out = Simulation(reqs, factory, cost, fast_forward=False).run()
    loop = out.loops[0]
    assert all(s.status.value == "finished" for s in loop.states), [(s.req.id, s.status) for s in loop.states]
    return steps


def real_steps(name) -> list[dict]:
    keep = ("step", "kind", "tokens", "retracted", "cache_hit")
    return [{k: s[k] for k in keep if k in s} for s in REAL[name] if s["kind"] != "idle"]


def _ordered(rec):
    """Batch order matters: compare {id: tokens} as the list of its items."""
    if rec is None:
        return None
    return {k: list(v.items()) if isinstance(v, dict) else v for k, v in rec.items()}


def _params():
    for name in SCENARIOS:
        marks = [pytest.mark.xfail(strict=True, reason=EXPECTED_DIVERGENCES[name])] if name in EXPECTED_DIVERGENCES else []
        yield pytest.param(name, id=name, marks=marks)


def test_every_scenario_has_real_steps():
    assert set(SCENARIOS) == set(REAL)


@pytest.mark.parametrize("name", list(_params()))
def test_sglang_matches_the_real_scheduler(name):
    ours, real = run_ours(SCENARIOS[name]), real_steps(name)
    for i in range(max(len(ours), len(real))):
        a = _ordered(ours[i] if i < len(ours) else None)
        b = _ordered(real[i] if i < len(real) else None)
        assert a == b, f"{name}: first divergence at non-idle step #{i}\n  ours: {a}\n  real: {b}"
