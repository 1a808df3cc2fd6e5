"""`testbed-traces describe`: each statistic on traces whose value is known, and the command end to end."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from testbed import traces
from testbed.core.request import Request
from testbed.traces.describe import (arrival_stats, describe_requests, prefix_reuse, reason_counts, session_stats,
                                     window_counts)


def _at(times, prompt=100, output=10, **kw) -> list[Request]:
    return [Request(i, float(t), prompt, output, **kw) for i, t in enumerate(times)]


def _window(stats: dict, w: float) -> dict:
    return next(x for x in stats["windows"] if x["window_s"] == w)


# ----------------------------------------------------------------------------- rate and burstiness

@pytest.mark.parametrize("seed", [0, 1])
def test_poisson_arrivals_have_cv_and_dispersion_near_one(seed):
    reqs = traces.poisson(10.0, n=50_000, lengths=(100, 10), seed=seed)
    s = arrival_stats(np.array([r.arrival for r in reqs]), windows_s=(1.0, 10.0))
    assert abs(s["gap_cv"] - 1) < 0.05
    assert abs(s["mean_rate"] - 10) < 0.3
    assert abs(_window(s, 1.0)["dispersion"] - 1) < 0.1  # ~5000 windows: std error ~0.02
    assert abs(_window(s, 10.0)["dispersion"] - 1) < 0.3  # ~500 windows: ~0.06
    assert _window(s, 1.0)["peak_rate"] > 10  # the busiest second beats the mean


def test_gamma_arrivals_have_their_cv_and_are_overdispersed():
    reqs = traces.gamma(10.0, 4.0, n=50_000, lengths=(100, 10), seed=0)
    s = arrival_stats(np.array([r.arrival for r in reqs]), windows_s=(1.0,))
    assert 3.5 < s["gap_cv"] < 4.5
    assert _window(s, 1.0)["dispersion"] > 5


def test_arrivals_at_two_instants_are_bursty_by_exact_figures():
    # 100 requests at 0 s and 100 at 10 s: 198 zero gaps and one of 10 s
    s = describe_requests(_at([0.0] * 100 + [10.0] * 100))
    assert s["span_s"] == 10.0 and s["mean_rate"] == pytest.approx(19.9)
    assert s["gap_cv"] == pytest.approx(math.sqrt(198))  # one non-zero gap among n: CV = sqrt(n - 1)
    assert s["zero_gap_share"] == pytest.approx(198 / 199)
    one = _window(s, 1.0)  # full windows [0,1) .. [9,10): counts 100, 0 x 9 -> mean 10, variance 900
    assert one["full_windows"] == 10 and one["mean_count"] == 10.0
    assert one["dispersion"] == pytest.approx(90.0)
    assert one["peak_rate"] == 100.0
    assert _window(s, 60.0)["dispersion"] is None  # no two full minutes: undefined, not 0


@pytest.mark.parametrize("unit", [1e-200, 5e-324, 1e300])
def test_gap_cv_of_tiny_or_huge_gaps_is_their_shapes(unit):
    """Gaps of 1, 2 and 3 units have CV sqrt(2/3) / 2 whatever the unit: the squares of deviations of
    1e-200 s (or of subnormal gaps) underflow to 0, those of 1e300 s overflow, so a CV computed on the
    gaps as they are was 0 or NaN."""
    s = arrival_stats(np.cumsum([0.0, unit, 2 * unit, 3 * unit]), windows_s=())
    assert s["gap_cv"] == pytest.approx(math.sqrt(2 / 3) / 2, rel=1e-12)


def test_evenly_spaced_arrivals_are_regular():
    s = arrival_stats(np.arange(0, 1000, 0.5), windows_s=(1.0, 60.0))
    assert s["gap_cv"] == pytest.approx(0.0, abs=1e-9) and s["zero_gap_share"] == 0.0
    assert _window(s, 1.0)["dispersion"] == 0.0 and _window(s, 1.0)["peak_rate"] == 2.0


@settings(max_examples=60, deadline=None)
@given(gaps=st.lists(st.floats(0, 50, allow_nan=False), min_size=3, max_size=200),
       scale=st.sampled_from([0.25, 2.0, 8.0]))
@example(gaps=[0.0, 1e-160, 3e-160, 2e-160], scale=0.25)  # squared deviations underflowed: 0.40820, 0.40986
@example(gaps=[0.0, 5e-324, 5e-324], scale=0.25)  # 0.25 x 5e-324 is 0: not a stretch of these times (below)
def test_burstiness_does_not_depend_on_the_time_unit(gaps, scale):
    """Stretching time by c, with windows c times longer, changes no CV, count or dispersion (c a power
    of two, so that the stretched times are exact, and the CV equal to the bit). Where they are not
    exact (times of a few 1e-324 s shrunk below the smallest double become 0: another trace, whose
    arrivals share an instant), the property does not apply and the example is not tested."""
    t = np.cumsum(gaps)
    assume(np.array_equal(t * scale / scale, t) and np.array_equal(np.diff(t) * scale / scale, np.diff(t)))
    a, b = arrival_stats(t, windows_s=(4.0,)), arrival_stats(t * scale, windows_s=(4.0 * scale,))
    if a["gap_cv"] is None:
        assert b["gap_cv"] is None
    else:
        assert b["gap_cv"] == a["gap_cv"]  # the same gaps in units of their largest: the same figure
    assert np.array_equal(window_counts(t, 4.0), window_counts(t * scale, 4.0 * scale))
    assert window_counts(t, 4.0).sum() == len(t)
    wa, wb = a["windows"][0], b["windows"][0]
    assert wa["dispersion"] == wb["dispersion"] and wb["peak_rate"] == pytest.approx(wa["peak_rate"] / scale)


# ----------------------------------------------------------------------------- lengths

def test_length_percentiles():
    reqs = [Request(i, float(i), p, o) for i, (p, o) in enumerate(zip(range(1, 101), range(100, 0, -1)))]
    s = describe_requests(reqs)
    assert s["prompt_len"] == {"mean": 50.5, "p50": 50.5, "p90": pytest.approx(90.1), "p99": pytest.approx(99.01),
                               "max": 100}
    assert s["output_len"]["max"] == 100 and s["output_len"]["mean"] == 50.5


# ----------------------------------------------------------------------------- prefix reuse

def test_shared_prefixes_give_the_exact_reuse_share():
    def req(i, prompt, hashes):
        return Request(i, float(i), prompt, 1, prefix_hashes=tuple(hashes), prefix_block_tokens=16)

    reqs = [req(0, 64, [1, 2, 3, 4]),  # first: nothing seen
            req(1, 40, [1, 2, 9]),  # blocks 1, 2 seen (32 tokens); its 8-token third block is new
            req(2, 48, [5, 2, 3]),  # 2 and 3 were seen, but after another first block: new content
            Request(3, 3.0, 20, 1),  # no hashes: its tokens count in the total, never as reuse
            req(4, 70, [1, 2, 3, 4, 7])]  # 4 blocks of request 0 (64 tokens) + 6 new
    p = prefix_reuse(reqs)
    assert p["reused_tokens"] == 32 + 64
    assert p["reuse_share"] == pytest.approx(96 / (64 + 40 + 48 + 20 + 70))
    assert p["distinct_blocks"] == 4 + 1 + 3 + 1
    assert p["hashed_token_share"] == pytest.approx((64 + 40 + 48 + 70) / 242)
    assert p["requests_with_hashes"] == 4 and p["block_tokens"] == 16


def test_a_request_never_reuses_its_own_blocks():
    p = prefix_reuse([Request(0, 0.0, 48, 1, prefix_hashes=(7, 7, 7), prefix_block_tokens=16)])
    assert p["reused_tokens"] == 0 and p["distinct_blocks"] == 3


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 80), st.lists(st.integers(0, 2), max_size=6)), min_size=1, max_size=12))
def test_reuse_matches_longest_seen_prefix(specs):
    """Reused tokens = for each request, the tokens of its longest leading run of hash ids that an
    earlier request's ids began with (brute force over the id lists themselves)."""
    size = 16
    reqs = []
    for i, (prompt, hashes) in enumerate(specs):
        hashes = hashes[:-(-prompt // size)]
        reqs.append(Request(i, float(i), prompt, 1, prefix_hashes=tuple(hashes), prefix_block_tokens=size))
    expected = 0
    for i, r in enumerate(reqs):
        best = max((k for e in reqs[:i] for k in range(len(r.prefix_hashes) + 1)
                    if e.prefix_hashes[:k] == r.prefix_hashes[:k] and len(e.prefix_hashes) >= k), default=0)
        expected += min(best * size, r.prompt_len)
    assert prefix_reuse(reqs)["reused_tokens"] == expected


def test_reuse_bounds_the_simulated_prefix_hit_rate():
    """The simulator with a cache that never evicts, at a load where no request waits on another,
    hits almost exactly the bound; it may only lose the last token it recomputes and the tail of a
    trace block that is not a whole KV block."""
    from testbed.app.assembly.run import simulate

    rng = np.random.default_rng(0)
    reqs = []
    for i in range(150):
        blocks = int(rng.integers(1, 6))
        shared = int(rng.integers(0, blocks + 1))  # leading blocks drawn from a few common prefixes
        family = int(rng.integers(0, 4))
        hashes = tuple(1000 * family + b for b in range(shared)) + tuple(10**6 + 10 * i + b for b in range(blocks - shared))
        prompt = (blocks - 1) * 64 + int(rng.integers(1, 65))
        reqs.append(Request(i, 30.0 * i, prompt, 4, prefix_hashes=hashes, prefix_block_tokens=64))
    bound = prefix_reuse(reqs)["reuse_share"]
    cfg = _compose(["kv.num_blocks=100000", "output.progress=false"])
    hit = simulate(cfg, requests=reqs).summary["prefix_cache_hit_rate"]
    assert 0.2 < bound and bound - 16 * 150 / sum(r.prompt_len for r in reqs) <= hit <= bound


# ----------------------------------------------------------------------------- sessions

def test_sessions_are_counted_by_session_id():
    reqs = [Request(i, float(i), 10, 1, session_id=s) for i, s in enumerate(["a", "b", "a", "", "a", "c"])]
    s = session_stats(reqs)
    assert s["sessions"] == 3 and s["requests_in_sessions"] == 5 and s["requests_with_parent"] == 0
    assert s["turns"]["max"] == 3 and s["turns"]["p50"] == 1.0 and s["turns"]["mean"] == pytest.approx(5 / 3)


@dataclass(frozen=True)
class _Turn:  # a Request with a parent, as the sessions work may add one: only the fields read here
    id: int
    session_id: str = ""
    parent_id: int | None = None


def test_parents_join_requests_without_a_session_id_to_their_roots_session():
    turns = [_Turn(0), _Turn(1, parent_id=0), _Turn(2, parent_id=1),  # a chain without session ids
             _Turn(3), _Turn(4, parent_id=3),
             _Turn(5, session_id="x"), _Turn(6, parent_id=5),  # joins session x
             _Turn(7),  # alone: no session
             _Turn(8, parent_id=99), _Turn(9, parent_id=8), _Turn(10, parent_id=99)]  # their first turn was cut off
    s = session_stats(turns)
    assert s["sessions"] == 4 and s["requests_in_sessions"] == 10 and s["requests_with_parent"] == 7
    assert s["turns"]["max"] == 3 and s["turns"]["mean"] == pytest.approx(10 / 4)


# ----------------------------------------------------------------------------- rejected rows

def test_rejections_are_counted_by_field_and_reason_without_their_values():
    counts = reason_counts([("GeneratedTokens", "negative length '-3'"), ("TIMESTAMP", "missing value"),
                            ("GeneratedTokens", "negative length '-5'")])
    assert counts == {"GeneratedTokens: negative length ...": 2, "TIMESTAMP: missing value": 1}


# ----------------------------------------------------------------------------- the command

def _compose(overrides):
    from hydra import compose, initialize_config_dir

    from testbed.app.entry.cli import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def test_describes_the_requests_a_run_would_replay(tmp_path):
    """Lenient rejections counted with their reasons, transforms applied, as build_requests does."""
    from testbed.app.analysis.traces import describe_config

    csv = tmp_path / "small.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:00:{s:02d}.0000000,{100 + s},{10 + s}" for s in range(0, 40, 2)]
    rows[3] = rows[3].rsplit(",", 1)[0] + ",-1"  # two bad output lengths, one bad time
    rows[7] = rows[7].rsplit(",", 1)[0] + ",-4"
    rows[15] = "yesterday," + rows[15].split(",", 1)[1]
    csv.write_text("\n".join(rows) + "\n")
    base = [f"trace.path={csv}", "trace.lenient=true", "output.print_table=false"]
    d = describe_config(_compose(base + [f"output.dir={tmp_path}/a"]))
    assert d["requests"] == 17 and d["rejected"] == 3
    (neg, n_neg), (time, n_time) = d["rejected_by_reason"].items()
    assert (neg, n_neg) == ("GeneratedTokens: negative length ...", 2)
    assert time.startswith("TIMESTAMP: unparseable time ...") and n_time == 1
    assert d["trace"] == "small" and d["transforms"] == {}
    scaled = describe_config(_compose(base + ["trace.rate_scale=2", "trace.max_requests=10",
                                              f"output.dir={tmp_path}/b"]))
    assert scaled["requests"] == 10 and scaled["transforms"] == {"max_requests": 10, "rate_scale": 2.0}
    assert scaled["rejected"] == 2  # the third bad row lies after the tenth kept request
    first10 = describe_config(_compose(base + ["trace.max_requests=10", f"output.dir={tmp_path}/c"]))
    assert scaled["mean_rate"] == pytest.approx(2 * first10["mean_rate"])
    assert scaled["span_s"] == pytest.approx(first10["span_s"] / 2)
    saved = json.loads((tmp_path / "b" / "description.json").read_text())
    assert saved["requests"] == 10 and saved["trace_config"]["rate_scale"] == 2.0


def _cli(args, cwd):
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", "testbed.app.analysis.traces", *args], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.parametrize("trace, rows, hashed", [("azure_conv", 19366, False), ("mooncake", 3993, True)])
def test_the_command_describes_the_bundled_traces(tmp_path, trace, rows, hashed):
    import matplotlib.image as mpimg

    proc = _cli(["describe", f"trace={trace}", f"output.dir={tmp_path}/d"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{rows} loaded, 0 rejected" in proc.stdout and "index of dispersion" in proc.stdout
    d = json.loads((tmp_path / "d" / "description.json").read_text())
    assert d["requests"] == rows and d["span_s"] > 0 and d["gap_cv"] > 0
    assert (d["prefix"]["reuse_share"] > 0) == hashed
    assert "index of dispersion" in (tmp_path / "d" / "description.md").read_text()
    for png in ("arrival_rate.png", "lengths.png"):
        image = mpimg.imread(tmp_path / "d" / png)
        assert image.shape[0] > 100 and image.std() > 0.01  # drawn, not blank


@pytest.mark.parametrize("args, words", [
    (["describe", "trace.rate_scale=0"], "trace.rate_scale=0.0: must be > 0"),
    (["describe", "trace.nosuch=1"], "nosuch"),
    (["summarise"], "usage: testbed-traces"),
])
def test_bad_config_is_named(tmp_path, args, words):
    proc = _cli(args + [f"output.dir={tmp_path}/x"], cwd=tmp_path)
    assert proc.returncode != 0 and words in proc.stdout + proc.stderr
    assert not (tmp_path / "x" / "description.json").exists()


def test_a_sweep_describes_each_trace_and_reports_no_failed_runs(tmp_path):
    proc = _cli(["describe", "-m", "trace=azure_code,mooncake", "trace.max_requests=200", "output.print_table=false",
                 f"hydra.sweep.dir={tmp_path}/sweep"], cwd=tmp_path)
    assert proc.returncode == 0 and "failed" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    found = sorted(json.loads(p.read_text())["trace"] for p in (tmp_path / "sweep").glob("*/description.json"))
    assert found == ["azure_code", "mooncake"]
