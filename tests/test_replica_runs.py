"""Several replicas: a decode run cut only by the arrivals routed to its replica
(testbed/sim/decode_runs.py) must leave every result as it was when every arrival cut every run
(`Simulation(per_replica_runs=False)`, the old event structure): the same routing picks, request
outcomes and times, the same inter-token gaps (in any order), KV blocks (the same block ids: the same
calls to the block manager in the same order) and engine steps, with fewer events."""
from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FixedCost
from testbed.app.assembly.plugins import make_router
from testbed.core.kv import BlockManager
from testbed.core.loop import SchedulerLimits, StepLoop
from testbed.core.request import Request
from testbed.policies import make_policy
from testbed.sim.decode_runs import DeliveryLog
from testbed.sim.simulation import Simulation

ROUTERS = [("round_robin", {}), ("least_outstanding", {}), ("least_kv", {}), ("power_of_two", {}),
           ("power_of_two", {"load": "kv_usage", "seed": 3}), ("prefix_affinity", {}),
           ("prefix_affinity", {"cache_view": "actual"}), ("session_affinity", {"max_load_gap": 2})]
POLICIES = ["vllm", "sarathi", "sglang", "orca"]


class Recorded:
    def __init__(self, router):
        self.router, self.name, self.picks = router, router.name, []

    def route(self, req, replicas, now):
        i = self.router.route(req, replicas, now)
        self.picks.append(i)
        return i


def replay(reqs, policy, router, knobs, replicas, num_blocks, cost, per_replica_runs, cache_decode,
           async_scheduling=False):
    rec = Recorded(make_router(router, **knobs))
    sim = Simulation(reqs, lambda: StepLoop(make_policy(policy), BlockManager(num_blocks, 4, True, 0, cache_decode),
                                            SchedulerLimits(64, 6, 10_000), cost, record_token_times=True),
                     cost, replicas, rec, per_replica_runs=per_replica_runs, async_scheduling=async_scheduling)
    out = sim.run()
    return sim, out, rec.picks


def results(out, picks):
    """`out`: a simulation's outcome, or a disaggregated run's pool (its loops)."""
    per_loop = []
    for loop in out.loops:
        states = [(s.req.id, s.status, s.first_scheduled, s.first_token_time, s.finish_time, s.num_generated,
                   s.num_preemptions, s.prefix_hit_tokens, tuple(s.token_times or ())) for s in loop.states]
        series = loop.series
        steps = [(a, a + d, p, n, r, w) for a, d, p, n, r, w in zip(series.start, series.duration, series.prefill_tokens,
                                                                     series.decode_tokens, series.running, series.waiting)]
        per_loop.append((states, sorted(loop.itl), list(loop.kv.free_order()), loop.num_steps, sum(series.steps),
                         _coalesced(steps, series.steps)))
    return picks, per_loop, getattr(out, "end_time", None)


def plans(out) -> int:
    """Steps planned (one per fast-forwarded run): the summary's `num_events`."""
    return sum(len(loop.series.duration) for loop in out.loops)


def _coalesced(rows, counts):
    """Back-to-back identical all-decode rows merged (testbed/app/analysis/fingerprint.py's rule)."""
    out = []
    for (start, end, prefill, decode, running, waiting), k in zip(rows, counts):
        if out and prefill == 0 and out[-1][2] == 0 and out[-1][1] == start and out[-1][3:6] == (decode, running, waiting):
            out[-1] = (out[-1][0], end, 0, decode, running, waiting, out[-1][6] + k)
        else:
            out.append((start, end, prefill, decode, running, waiting, k))
    return out


def requests(specs, grid: float | None):
    """Late enough that runs are deferred, their steps summed as they are reached (twice a run's
    steps' times within its start: simulation._lazy_rest)."""
    arrivals = sorted(t for t, *_ in specs)
    offset = 4.0
    if grid is not None:  # on the step grid: arrivals tie with step ends
        arrivals = [round(t / grid) * grid for t in arrivals]
        offset = 64.0
    return [Request(id=i, arrival=offset + t, prompt_len=p, output_len=o, prefix_hashes=h[:-(-p // 8)],
                    prefix_block_tokens=8, session_id=sid)
            for i, (t, (_, p, o, h, sid)) in enumerate(zip(arrivals, specs))]


specs_st = st.lists(st.tuples(st.floats(0, 3), st.integers(1, 40), st.integers(1, 60),
                              st.sampled_from([(), (1,), (1, 2), (3, 4)]), st.sampled_from(["", "a", "b"])),
                    min_size=1, max_size=30)


@settings(max_examples=int(os.environ.get("PROPERTY_EXAMPLES", 60)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(specs=specs_st, router=st.sampled_from(ROUTERS), policy=st.sampled_from(POLICIES),
       replicas=st.integers(2, 5), num_blocks=st.integers(12, 60), tied=st.booleans(),
       cache_decode=st.sampled_from(["scheduled", "finished"]), async_scheduling=st.booleans())
def test_cutting_runs_only_at_their_own_arrivals_changes_no_result(specs, router, policy, replicas, num_blocks,
                                                                     tied, cache_decode, async_scheduling):
    cost = FixedCost(0.25, 0.0) if tied else FixedCost(0.01, 0.0005)  # 0.25: exact sums, arrivals tie with steps
    reqs = requests(specs, 0.25 if tied else None)
    name, knobs = router
    new_sim, new, new_picks = replay(reqs, policy, name, knobs, replicas, num_blocks, cost, True, cache_decode,
                                     async_scheduling)
    old_sim, old, old_picks = replay(reqs, policy, name, knobs, replicas, num_blocks, cost, False, cache_decode,
                                     async_scheduling)
    assert results(new, new_picks) == results(old, old_picks)
    assert plans(new) <= plans(old)


def test_a_busy_cluster_takes_fewer_events_with_the_same_results():
    """Four replicas kept busy by a steady stream: runs deferred across the others' arrivals."""
    specs = [(0.05 * i, 8 + i % 7, 30 + (i * 7) % 25, (), "") for i in range(60)]
    reqs = requests(specs, None)
    cost = FixedCost(0.01, 0.0005)
    new_sim, new, new_picks = replay(reqs, "vllm", "round_robin", {}, 4, 200, cost, True, "scheduled")
    old_sim, old, old_picks = replay(reqs, "vllm", "round_robin", {}, 4, 200, cost, False, "scheduled")
    assert results(new, new_picks) == results(old, old_picks)
    assert plans(new) < 0.7 * plans(old), (plans(new), plans(old))
    assert len(new_sim._log) == len(reqs)


def test_the_delivery_log_numbers_deliveries_in_order():
    log = DeliveryLog()
    assert [log.add(1.0, 1.0, 0), log.add(1.0, 1.0, 0), log.add(2.0, 2.0, 2)] == [0, 1, 2]
    assert len(log) == 3 and log.chain == [0, 0, 2]


# --------------------------------------------------------------------------- disaggregated decode replicas

def disagg_replay(reqs, policy, router, knobs, n_prefill, n_decode, decode_blocks, costs, link, fast_forward):
    from testbed.sim.disaggregated import DisaggSimulation, Pool

    def pool(name, n, blocks, cost):
        loops = [StepLoop(make_policy(policy), BlockManager(blocks, 4, True), SchedulerLimits(64, 4, 10_000), cost,
                          record_token_times=True) for _ in range(n)]
        return Pool(name, loops, cost, make_router(router, **knobs))

    sim = DisaggSimulation(reqs, pool("prefill", n_prefill, 80, costs[0]),
                           pool("decode", n_decode, decode_blocks, costs[1]), link,
                           kv_bytes_per_token=100, fast_forward=fast_forward)
    out = sim.run()
    handoffs = [(h.req.id, h.prefill_replica, h.decode_replica, h.prefilled_s, h.reserved_s, h.sending_s, h.landed_s)
                for h in out.handoffs]
    return sim, (handoffs, results(out.decode, []), results(out.prefill, []), out.decode.busy_s, out.prefill.busy_s,
                 out.end_time)


@settings(max_examples=int(os.environ.get("PROPERTY_EXAMPLES", 60)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(specs=specs_st, router=st.sampled_from(ROUTERS), n_prefill=st.integers(1, 3), n_decode=st.integers(1, 3),
       decode_blocks=st.integers(16, 60), tied=st.booleans(), serialize=st.booleans())
def test_fast_forwarded_decode_replicas_change_no_disaggregated_result(specs, router, n_prefill, n_decode,
                                                                       decode_blocks, tied, serialize):
    """A decode replica's steady run, cut by transfers landing on it and reservations of its blocks,
    gives the results of planning its every step (the old, never fast-forwarded decode pool). Tied:
    every time on a grid, so events tie with step ends (but no prefill step, transfer and decode step
    both start and end together: which of those came first would depend on how their own scheduling
    events were ordered, and decode_runs.StepwiseRun does not go back that far)."""
    from testbed.sim.kv_link import KVLink

    cost = (FixedCost(0.125, 0.0), FixedCost(0.25, 0.0)) if tied else (FixedCost(0.01, 0.0005),) * 2
    link = KVLink("t", 1e4 if tied else 1e6, 0.25 if tied else 0.002, 1.0, serialize)  # tied: 0.25 s + 0.01 s a token
    reqs = requests(specs, 0.25 if tied else None)
    name, knobs = router
    new_sim, new = disagg_replay(reqs, "vllm", name, knobs, n_prefill, n_decode, decode_blocks, cost, link, True)
    old_sim, old = disagg_replay(reqs, "vllm", name, knobs, n_prefill, n_decode, decode_blocks, cost, link, False)
    assert new == old
    assert plans(new_sim.decode) <= plans(old_sim.decode)


# --------------------------------------------------------------------------- closed-loop sessions

def session_requests(specs, grid: float | None):
    """Sessions of up to three turns: each turn after the first names the one before as its parent
    (a prompt that extends the parent's sequence, its ids too) and may record a think time."""
    out, parent = [], {}
    for i, (t, (_, p, o, h, sid)) in enumerate(zip(sorted(t for t, *_ in specs), specs)):
        if grid is not None:
            t = round(t / grid) * grid
        key = sid or f"s{i}"
        pid, think = parent.get(key, (-1, -1.0))
        prev = out[pid] if pid >= 0 else None
        prompt = p if prev is None else prev.total_len + p
        ids = h if prev is None else prev.prefix_hashes + h
        out.append(Request(id=i, arrival=(64.0 if grid else 4.0) + t, prompt_len=prompt, output_len=o,
                           prefix_hashes=ids[:-(-prompt // 8)], prefix_block_tokens=8, session_id=key,
                           parent_id=pid, think_time=think))
        parent[key] = (i, (0.0, 0.25, -1.0)[i % 3] if grid else (0.0, 0.013, -1.0)[i % 3])
    return out


def closed_replay(reqs, policy, router, knobs, replicas, num_blocks, cost, per_replica_runs, cache_decode,
                  think_time_s=None, async_scheduling=False, fast_forward=True):
    from testbed.sim.sessions import ClosedLoopSessions

    rec = Recorded(make_router(router, **knobs))
    sim = Simulation(reqs, lambda: StepLoop(make_policy(policy), BlockManager(num_blocks, 4, True, 0, cache_decode),
                                            SchedulerLimits(64, 6, 10_000), cost, record_token_times=True),
                     cost, replicas, rec, per_replica_runs=per_replica_runs, async_scheduling=async_scheduling,
                     sessions=ClosedLoopSessions(reqs, think_time_s), fast_forward=fast_forward)
    out = sim.run()
    return sim, out, rec.picks


@settings(max_examples=int(os.environ.get("PROPERTY_EXAMPLES", 60)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(specs=specs_st, router=st.sampled_from(ROUTERS), policy=st.sampled_from(POLICIES),
       replicas=st.integers(2, 5), num_blocks=st.integers(12, 60), tied=st.booleans(),
       cache_decode=st.sampled_from(["scheduled", "finished"]), think=st.sampled_from([None, 0.0, 0.5]),
       async_scheduling=st.booleans())
def test_closed_loop_runs_cut_only_by_their_own_arrivals_change_no_result(specs, router, policy, replicas, num_blocks,
                                                                          tied, cache_decode, think, async_scheduling):
    """Closed-loop sessions: a run that other replicas' step ends no longer cut gives every result of
    the old structure (each replica's run ended at every other replica's step end), ties included, and
    of planning every step (which no bound on the next turn's release or arrival shapes: `_turn_bounds`)."""
    cost = FixedCost(0.25, 0.0) if tied else FixedCost(0.01, 0.0005)
    reqs = session_requests(specs, 0.25 if tied else None)
    name, knobs = router
    new_sim, new, new_picks = closed_replay(reqs, policy, name, knobs, replicas, num_blocks, cost, True, cache_decode,
                                            think, async_scheduling)
    old_sim, old, old_picks = closed_replay(reqs, policy, name, knobs, replicas, num_blocks, cost, False, cache_decode,
                                            think, async_scheduling)
    assert results(new, new_picks) == results(old, old_picks)
    assert [r.id for r in new.not_arrived] == [r.id for r in old.not_arrived]
    assert plans(new) <= plans(old)
    _, stepped, stepped_picks = closed_replay(reqs, policy, name, knobs, replicas, num_blocks, cost, False, cache_decode,
                                              think, async_scheduling, fast_forward=False)
    assert _timings(results(new, new_picks)) == _timings(results(stepped, stepped_picks))


def _timings(res):
    """`results` but the free queue's order: a run takes its blocks in one pass, in batch order, where steps
    planned one by one take them step by step, so block ids differ (no time does)."""
    picks, per_loop, end = res
    return picks, [loop[:2] + loop[3:] for loop in per_loop], end


def test_busy_closed_loop_replicas_plan_fewer_times_with_the_same_results():
    """Four replicas kept busy by sessions: each run is planned and completed once, not once per
    other replica's step."""
    specs = [(0.05 * i, 8 + i % 7, 30 + (i * 7) % 25, (), f"s{i % 20}") for i in range(60)]
    reqs = session_requests(specs, None)
    cost = FixedCost(0.01, 0.0005)
    new_sim, new, new_picks = closed_replay(reqs, "vllm", "round_robin", {}, 4, 200, cost, True, "scheduled")
    old_sim, old, old_picks = closed_replay(reqs, "vllm", "round_robin", {}, 4, 200, cost, False, "scheduled")
    assert results(new, new_picks) == results(old, old_picks)
    assert plans(new) < 0.7 * plans(old), (plans(new), plans(old))
