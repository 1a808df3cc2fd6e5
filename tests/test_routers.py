"""Routers: one property test over every registered router (register one and it is covered), and
behavioural tests of each rule on replicas whose loads and caches are set by hand.

The property test replays random small traces (prefix ids and session ids included) on 1-6
replicas with random knobs inside their declared bounds: every request ends on exactly one
replica, none is lost or duplicated, the outcomes add up to the trace, and the same seed gives
the same routing, and every pick is a valid index, made once per arrival. Set PROPERTY_EXAMPLES
for a longer search.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import FixedCost, make_loop, make_requests
from testbed.app.entry.cli import CONF_DIR
from testbed.app.analysis.metrics import outcome_of
from testbed.app.assembly.plugins import load_routers, make_router
from testbed.app.assembly.run_setup import build_router
from testbed.app.assembly.validate import check_config
from testbed.core.bounds import bounds_of
from testbed.core.kv import BlockManager
from testbed.core.loop import SchedulerLimits, StepLoop
from testbed.core.request import Request
from testbed.core.router import ReplicaView
from testbed.policies import make_policy
from testbed.routers.power_of_two import LOADS
from testbed.routers.prefix_affinity import CACHE_VIEWS
from testbed.sim.simulation import Simulation

TEXT_KNOB_CHOICES = {"cache_view": CACHE_VIEWS, "load": LOADS}  # other text knobs keep their default


def knob_values(cls) -> st.SearchStrategy[dict]:
    """Values for every knob of a router, inside the knob's declared bounds."""
    out = {}
    for f in dataclasses.fields(cls.Knobs):
        if f.name == "name":
            continue
        iv = bounds_of(f)
        if f.type in (int, "int"):
            lo = (iv.ge if iv.ge is not None else iv.gt + 1) if iv is not None and (iv.ge, iv.gt) != (None, None) else 0
            hi = (iv.le if iv.le is not None else iv.lt - 1) if iv is not None and (iv.le, iv.lt) != (None, None) else lo + 8
            out[f.name] = st.integers(int(lo), int(hi))
        elif f.type in (float, "float"):
            lo = (iv.ge if iv.ge is not None else iv.gt) if iv is not None and (iv.ge, iv.gt) != (None, None) else 0.0
            hi = (iv.le if iv.le is not None else iv.lt) if iv is not None and (iv.le, iv.lt) != (None, None) else lo + 4
            out[f.name] = st.floats(lo, hi, exclude_min=iv is not None and iv.gt is not None,
                                    exclude_max=iv is not None and iv.lt is not None)
        else:
            out[f.name] = st.sampled_from(TEXT_KNOB_CHOICES.get(f.name, (f.default,)))
    return st.fixed_dictionaries(out)


requests_st = st.lists(
    st.tuples(st.floats(0, 0.3), st.integers(1, 60), st.integers(1, 12), st.sampled_from([(), (1,), (1, 2), (3, 4)]),
              st.sampled_from(["", "a", "b", "c"])), min_size=1, max_size=16)


class Recorded:
    """A router that records every pick of the router it wraps, with the number of replicas."""

    def __init__(self, router):
        self.router, self.name, self.picks = router, router.name, []

    def route(self, req, replicas, now):
        i = self.router.route(req, replicas, now)
        self.picks.append((req.id, i, len(replicas)))
        return i


def replay(name: str, knobs: dict, reqs: list[Request], replicas: int, num_blocks: int):
    cost = FixedCost(0.01, 0.0005)
    router = Recorded(make_router(name, **knobs))
    sim = Simulation(reqs, lambda: StepLoop(make_policy("vllm"), BlockManager(num_blocks, 4, True),
                                            SchedulerLimits(64, 4, 10_000), cost),
                     cost, replicas, router)
    return sim.run(), router.picks


@pytest.mark.parametrize("name", sorted(load_routers()))
@settings(max_examples=int(os.environ.get("PROPERTY_EXAMPLES", 30)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), specs=requests_st, replicas=st.integers(1, 6), num_blocks=st.integers(4, 40))
def test_every_router_accounts_for_every_request_once_and_repeats_itself(name, data, specs, replicas, num_blocks):
    knobs = data.draw(knob_values(load_routers()[name]), label="knobs")
    arrivals = sorted(s[0] for s in specs)
    reqs = [Request(id=i, arrival=t, prompt_len=p, output_len=o, prefix_hashes=h[:-(-p // 8)], prefix_block_tokens=8,
                    session_id=sid) for i, (t, (_, p, o, h, sid)) in enumerate(zip(arrivals, specs))]
    out, picks = replay(name, knobs, reqs, replicas, num_blocks)
    assert not out.stalled and not out.not_arrived
    assert all(type(i) is int and 0 <= i < n for _, i, n in picks)
    assert [rid for rid, _, _ in picks] == ([r.id for r in reqs] if replicas > 1 else [])  # once per arrival
    placed = [(s.req.id, i) for i, loop in enumerate(out.loops) for s in loop.states]
    assert sorted(rid for rid, _ in placed) == [r.id for r in reqs]  # each on exactly one replica, none lost
    outcomes = Counter(outcome_of(s).value for loop in out.loops for s in loop.states)
    assert sum(outcomes.values()) == len(reqs) and outcomes["unfinished"] == 0
    again, picks_again = replay(name, knobs, reqs, replicas, num_blocks)
    assert picks_again == picks
    assert sorted(placed) == sorted((s.req.id, i) for i, loop in enumerate(again.loops) for s in loop.states)
    assert out.end_time == again.end_time


# --------------------------------------------------------------------------- behaviour on hand-set replicas

@dataclasses.dataclass
class FakeReplica:
    """A ReplicaView whose numbers are set by hand; counts which load signals a router read."""

    index: int
    outstanding_: int = 0
    num_waiting: int = 0
    num_running: int = 0
    kv_usage_: float = 0.0
    cached: int = 0  # cached_prefix_tokens for any request
    num_blocks: int = 1000
    block_size: int = 16
    prefix_caching: bool = True
    reads: int = 0

    @property
    def outstanding(self) -> int:
        self.reads += 1
        return self.outstanding_

    @property
    def kv_usage(self) -> float:
        self.reads += 1
        return self.kv_usage_

    @property
    def free_blocks(self) -> int:
        return round(self.num_blocks * (1 - self.kv_usage_))

    def cached_prefix_tokens(self, req: Request) -> int:
        return self.cached if req.prefix_hashes else 0


def fakes(loads, **per_replica) -> list[FakeReplica]:
    return [FakeReplica(i, load, **{k: v[i] for k, v in per_replica.items()}) for i, load in enumerate(loads)]


def req(i: int = 0, prompt: int = 2048, hashes=(1, 2, 3, 4), session: str = "") -> Request:
    return Request(id=i, arrival=0.0, prompt_len=prompt, output_len=8, prefix_hashes=hashes, session_id=session)


@given(usage=st.lists(st.sampled_from([0.0, 0.25, 0.5, 0.9]), min_size=2, max_size=8),
       waiting=st.lists(st.integers(0, 3), min_size=8, max_size=8))
def test_least_kv_picks_the_lowest_usage_then_the_shorter_queue(usage, waiting):
    replicas = fakes([0] * len(usage), kv_usage_=usage, num_waiting=waiting)
    i = make_router("least_kv").route(req(), replicas, 0.0)
    assert usage[i] == min(usage)
    assert waiting[i] == min(w for u, w in zip(usage, waiting) if u == min(usage))


@given(loads=st.lists(st.integers(0, 5), min_size=2, max_size=8), seed=st.integers(0, 2**16),
       load=st.sampled_from(LOADS))
def test_power_of_two_reads_two_replicas_and_never_takes_the_more_loaded(loads, seed, load):
    router = make_router("power_of_two", seed=seed, load=load)
    field = "outstanding_" if load == "outstanding" else "kv_usage_"
    for _ in range(20):
        replicas = fakes([0] * len(loads))
        for r, x in zip(replicas, loads):
            setattr(r, field, x if load == "outstanding" else x / 5)
        i = router.route(req(), replicas, 0.0)
        sampled = [r for r in replicas if r.reads]
        assert len(sampled) == 2 and replicas[i] in sampled
        assert getattr(replicas[i], field) <= min(getattr(r, field) for r in sampled)


def test_power_of_two_repeats_with_its_seed_and_samples_every_replica():
    def picks(seed):
        router = make_router("power_of_two", seed=seed)
        return [router.route(req(), fakes([0] * 5), 0.0) for _ in range(200)]

    assert picks(3) == picks(3) and picks(3) != picks(4)
    assert set(picks(3)) == set(range(5))


def test_session_affinity_keeps_a_session_on_its_replica_and_sends_new_ones_to_the_least_loaded():
    router = make_router("session_affinity")
    assert router.route(req(session="a"), fakes([3, 1, 2]), 0.0) == 1
    assert router.route(req(session="b"), fakes([0, 5, 2]), 0.0) == 0
    for loads in ([9, 9, 0], [0, 50, 0]):  # however loaded its replica gets, "a" stays
        assert router.route(req(session="a"), fakes(loads), 0.0) == 1
    assert router.route(req(session=""), fakes([4, 1, 0]), 0.0) == 2  # no session: least outstanding


def test_session_affinity_moves_a_session_past_the_load_gap_and_it_stays_moved():
    router = make_router("session_affinity", max_load_gap=4)
    assert router.route(req(session="a"), fakes([0, 1]), 0.0) == 0
    assert router.route(req(session="a"), fakes([3, 0]), 0.0) == 0  # gap 3 < 4: stays
    assert router.route(req(session="a"), fakes([4, 0]), 0.0) == 1  # gap 4: moves to the least loaded
    assert router.route(req(session="a"), fakes([0, 3]), 0.0) == 1  # and follows its new replica


@pytest.mark.parametrize("view", CACHE_VIEWS)
def test_prefix_affinity_follows_the_cached_prefix_unless_the_load_is_imbalanced(view):
    router = make_router("prefix_affinity", cache_view=view, balance_abs_threshold=4, balance_rel_threshold=1.5)
    cached = [0, 0, 2048] if view == "actual" else [0, 0, 0]
    if view == "approximate":  # the router learns where the prefix is by routing it there
        assert router.route(req(0), fakes([3, 2, 0]), 0.0) == 2
    assert router.route(req(1), fakes([0, 1, 2], cached=cached), 0.0) == 2  # balanced: the cached replica
    assert router.route(req(2, hashes=(9, 9)), fakes([0, 1, 2], cached=[0, 0, 0]), 0.0) == 0  # no match: least loaded
    # max - min = 4 > 4 fails: balanced, and the cache wins over a load of 12 against 8
    assert router.route(req(3), fakes([8, 10, 12], cached=cached), 0.0) == 2
    # max - min = 6 > 4 but 26 <= 1.5 x 20: still balanced (imbalance needs both)
    assert router.route(req(5), fakes([20, 22, 26], cached=cached), 0.0) == 2
    # max - min = 5 > 4 and 6 > 1.5 x 1: imbalanced, the least loaded whatever it caches
    assert router.route(req(4), fakes([1, 3, 6], cached=cached), 0.0) == 0


def test_prefix_affinity_needs_a_match_above_the_threshold():
    router = make_router("prefix_affinity", cache_view="actual", cache_threshold=0.5)
    assert router.route(req(prompt=2048), fakes([1, 0], cached=[1024, 0]), 0.0) == 1  # half: not above 0.5
    assert router.route(req(prompt=2048), fakes([1, 0], cached=[1040, 0]), 0.0) == 0


def test_prefix_affinity_approximate_record_forgets_beyond_the_replica_capacity():
    router = make_router("prefix_affinity", cache_threshold=0.0)
    small = lambda loads: fakes(loads, num_blocks=[64, 64])  # 1024 tokens: two 512-token prefix blocks each
    assert router.route(req(0, hashes=(1, 2)), small([1, 0]), 0.0) == 1
    assert router.route(req(1, hashes=(1, 2)), small([0, 1]), 0.0) == 1  # remembered
    assert router.route(req(2, hashes=(5, 6)), small([1, 0]), 0.0) == 1  # fills replica 1's record: (1, 2) forgotten
    assert router.route(req(3, hashes=(1, 2)), small([0, 1]), 0.0) == 0


def test_prefix_affinity_sends_a_shared_prefix_to_the_replica_whose_cache_holds_it():
    """End to end on real replicas: two prompts with different prefixes land on replicas 0 and 1;
    once both are done, a third sharing the second's prefix joins replica 1, though both are idle
    and the least-loaded rule would pick replica 0."""
    for view in CACHE_VIEWS:
        reqs = [Request(0, 0.0, 64, 2, (1, 2, 3, 4), 16), Request(1, 0.0, 64, 2, (5, 6, 7, 8), 16),
                Request(2, 5.0, 64, 2, (5, 6, 7, 8), 16)]
        out, _ = replay("prefix_affinity", {"cache_view": view}, reqs, 2, 64)
        where = {s.req.id: i for i, loop in enumerate(out.loops) for s in loop.states}
        assert where == {0: 0, 1: 1, 2: 1}, view
        third = next(s for s in out.loops[1].states if s.req.id == 2)
        assert third.prefix_hit_tokens == 60  # 15 of its 16 four-token blocks (one token left to compute)
        assert math.isfinite(third.finish_time)


@pytest.mark.parametrize("name, knob", [("prefix_affinity", "cache_view"), ("power_of_two", "load")])
def test_a_text_knob_outside_its_choices_is_named(name, knob):
    with pytest.raises(ValueError, match=rf"router\.{knob}='nearest': expected one of"):
        make_router(name, **{knob: "nearest"})


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF_DIR / "router").glob("*.yaml")))
def test_every_shipped_router_preset_passes_the_config_check_and_builds(preset):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=[f"router={preset}", "backend.replicas=2"])
    check_config(cfg)
    assert build_router(cfg).name == cfg.router.name


def test_prefix_affinity_records_a_request_routed_by_load_before_any_lookup():
    """The first arrival on an imbalanced pool is routed by load alone; its prefix is still recorded
    (found by the property test: the record had not been sized to the replicas yet)."""
    r = make_router("prefix_affinity", balance_abs_threshold=0, balance_rel_threshold=1.0)
    loops = [make_loop(make_policy("vllm")), make_loop(make_policy("vllm"))]
    loops[0].arrive(make_requests([(0.0, 8, 1)])[0], 0.0)  # replica 0 busier: imbalanced
    views = [ReplicaView(i, l) for i, l in enumerate(loops)]
    req = Request(1, 0.0, 8, 1, prefix_hashes=(7,), prefix_block_tokens=8)
    assert r.route(req, views, 0.0) == 1
    again = Request(2, 0.0, 8, 1, prefix_hashes=(7,), prefix_block_tokens=8)
    loops[1].arrive(req, 0.0)  # now balanced; the record sends the shared prefix where it went
    assert r.route(again, views, 0.0) == 1
