"""Building a run's results fast and small must not move a cell: the column-wise request table is the
per-row table, the in-place ITL statistics are those of a copy, and the CLI composes its config once
into the very config Hydra's two compositions gave."""
from __future__ import annotations

import math
import sys
from array import array

import numpy as np
import pandas as pd
import pytest

from conftest import FixedCost, make_loop, make_requests
from testbed.app.analysis import metrics
from testbed.app.analysis.fingerprint import frame_hash
from testbed.app.assembly.frontend import FrontendConfig, to_engine_queue
from testbed.app.analysis.metrics import PERCENTILES, outcome_of, request_table, take_itl_ms
from testbed.core.request import Outcome, Status
from testbed.policies import make_policy
from testbed.routers import make_router
from testbed.sim.simulation import Simulation


def per_row_table(states, not_arrived, load_rejects, not_arrived_reason, clock) -> pd.DataFrame:
    """The table as the code before issue 15 built it, row by row (the definition the columns keep)."""
    def latencies(s, arrival, finished, token_s, tail_s):
        queue = (s.first_scheduled - arrival) * 1e3 if s.first_scheduled >= 0 else math.nan
        ttft = (s.first_token_time - arrival + token_s) * 1e3 if s.first_token_time >= 0 else math.nan
        e2el = (s.finish_time - arrival + tail_s) * 1e3 if finished else math.nan
        tpot = (e2el - ttft) / (s.req.output_len - 1) if finished and s.req.output_len > 1 else math.nan
        return queue, ttft, tpot, e2el

    def t(x):
        return x if x >= 0 else math.nan

    token_s, tail_s = clock.output_token_s, clock.tail_s
    rows, nan4 = [], (math.nan,) * 4
    for replica, s in states:
        r = s.req
        arrival = clock.arrival_s[r.id]
        finished = s.status is Status.FINISHED
        rows.append((r.id, r.source, replica, arrival, r.prompt_len, r.output_len, r.tenant, r.priority,
                     outcome_of(s).value, s.reject_reason, s.num_generated, s.num_preemptions, s.prefix_hit_tokens,
                     t(s.first_scheduled), t(s.first_token_time), t(s.finish_time if finished else -1.0),
                     *latencies(s, arrival, finished, token_s, tail_s), r.arrival, (r.arrival - arrival) * 1e3,
                     *latencies(s, r.arrival, finished, 0.0, 0.0), s.token_times))
    for r in not_arrived:
        arrival = clock.arrival_s[r.id]
        rows.append((r.id, r.source, -1, arrival, r.prompt_len, r.output_len, r.tenant, r.priority,
                     Outcome.UNFINISHED.value, not_arrived_reason, 0, 0, 0, math.nan, math.nan, math.nan, *nan4,
                     r.arrival, (r.arrival - arrival) * 1e3, *nan4, None))
    for rid, source, reason in load_rejects:
        rows.append((rid, source, -1, math.nan, -1, -1, "", 0, Outcome.REJECTED.value, reason, 0, 0, 0,
                     math.nan, math.nan, math.nan, *nan4, math.nan, math.nan, *nan4, None))
    df = pd.DataFrame.from_records(rows, columns=[*metrics.TABLE_COLUMNS, "token_times"])
    df = df.sort_values("id", kind="stable").reset_index(drop=True)
    return df.drop(columns="token_times") if df["token_times"].isna().all() else df


@pytest.mark.parametrize("token_times", [False, True])
def test_the_column_wise_table_is_the_per_row_table(token_times):
    # two replicas (rows come out of id order), a front end (client != engine times), a prompt too long
    # for the cache (rejected by the loop), a horizon (unfinished and never-arrived rows), load rejects
    specs = [(0.003 * i, 20 + 7 * (i % 5), 1 + (i * 3) % 9) for i in range(40)] + [(0.001, 5000, 4)]
    reqs = make_requests(sorted(specs))
    engine_reqs, clock = to_engine_queue(reqs, FrontendConfig("api", 0.002, 1e-5, 0.001, 0.003))
    cost = FixedCost(0.004, 1e-5)

    def loop():
        lp = make_loop(make_policy("vllm"), num_blocks=96, budget=64, cost=cost)
        lp.record_token_times = token_times
        return lp

    out = Simulation(engine_reqs, loop, cost, replicas=2, router=make_router("round_robin"), horizon_s=0.1).run()
    states = [(i, s) for i, lp in enumerate(out.loops) for s in lp.states]
    rejects = [(10_000, "trace.csv:3", "invalid-row: field prompt: not a number"), (-5, "trace.csv:9", "x")]
    assert out.not_arrived and any(s.status is Status.REJECTED for _, s in states)
    assert any(s.status is Status.FINISHED for _, s in states) and any(s.status is Status.RUNNING for _, s in states)
    new = request_table(states, out.not_arrived, rejects, "after the horizon", clock)
    old = per_row_table(states, out.not_arrived, rejects, "after the horizon", clock)
    assert list(new.columns) == list(old.columns) and ("token_times" in new) == token_times
    assert new.dtypes.to_dict() == old.dtypes.to_dict()
    if token_times:  # lists: compared cell by cell (pandas hashes no list)
        assert [t if t is None else list(t) for t in new.pop("token_times")] == \
            [t if t is None else list(t) for t in old.pop("token_times")]
    assert frame_hash(new) == frame_hash(old)


def _stats_of(values: np.ndarray, scratch: bool) -> dict:
    out: dict = {}
    metrics._stats("itl", values, out, scratch=scratch)
    return out


@pytest.mark.parametrize("n, nans", [(1, 0), (9, 0), (1000, 0), (300_001, 0), (5000, 3)])
def test_itl_statistics_in_place_are_those_of_the_sorted_gaps_in_any_order(n, nans):
    rng = np.random.default_rng(n)
    gaps = rng.lognormal(-4, 1.5, n) * 1e3
    gaps[:: max(1, n // 7)] = 0.0  # ties, as speculative decoding's tokens of one step make
    if nans:
        gaps[np.arange(nans) * 17] = math.nan
    reference = _stats_of(np.sort(gaps), scratch=False)  # the gaps' figures, summed in ascending order
    assert _stats_of(gaps.copy(), scratch=True) == reference
    assert _stats_of(rng.permutation(gaps), scratch=True) == reference  # the order a run recorded them in is no result
    assert list(reference) == [f"{k}_itl_ms" for k in ("mean", "median", "std", *(f"p{p}" for p in PERCENTILES))]


@pytest.mark.parametrize("n", [1, 7, 8, 129, 65_536, 65_537, 200_003, 1_000_003, 3_000_017])
def test_the_std_by_slices_is_numpys_to_the_bit(n):
    rng = np.random.default_rng(n)
    for values in (rng.lognormal(0, 4, n), rng.exponential(8.0, n).round(3)):
        assert metrics._std(values) == values.std()


class _Loop:
    def __init__(self, gaps):
        self.itl = gaps


@pytest.mark.parametrize("kinds", [["array"], ["array", "array", "list"], ["list"], []])
def test_taking_the_gaps_scales_them_as_a_copy_would_and_empties_the_loops(kinds):
    rng = np.random.default_rng(len(kinds))
    parts = [rng.exponential(0.01, 1000 + 10 * i).tolist() for i in range(len(kinds))]
    loops = [_Loop(array("d", p) if kind == "array" else list(p)) for p, kind in zip(parts, kinds)]
    expected = np.concatenate([np.asarray(p) for p in parts]) * 1e3 if parts else np.empty(0)
    got = take_itl_ms(loops)
    assert got.dtype == np.float64 and got.tobytes() == expected.tobytes()
    assert all(len(lp.itl) == 0 and type(lp.itl) is (array if k == "array" else list) for lp, k in zip(loops, kinds))


def test_the_cli_composes_its_config_once_into_hydras_own(tmp_path, monkeypatch):
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra

    from testbed.app.entry import cli, compose_once

    calls = []
    load = ConfigLoaderImpl.load_configuration
    monkeypatch.setattr(ConfigLoaderImpl, "load_configuration",
                        lambda self, *a, **k: calls.append(k.get("run_mode")) or load(self, *a, **k))
    written = {}
    for once in (True, False):
        monkeypatch.setattr(Hydra, "get_mode", compose_once._get_mode_composing_once if once
                            else compose_once._hydra_get_mode)
        calls.clear()
        out = tmp_path / ("once" if once else "twice")
        monkeypatch.setattr(sys, "argv", ["testbed", "trace.max_requests=5", "output.print_table=false",
                                          "hydra.job.chdir=false", f"hydra.run.dir={tmp_path}/run"])
        cli.main()
        assert len(calls) == (1 if once else 2)
        written[once] = {name: (tmp_path / "run" / ".hydra" / name).read_text()
                         for name in ("config.yaml", "hydra.yaml", "overrides.yaml")}
        (tmp_path / "run").rename(out)
    assert written[True] == written[False]
    assert "- hydra.mode=RUN" in written[True]["hydra.yaml"]
