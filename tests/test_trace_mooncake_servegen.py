"""Mooncake's production traces (presets, coarse timestamps spread over their buckets) and
workloads generated from ServeGen's per-client distributions (testbed.traces.servegen)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from omegaconf import OmegaConf
from scipy import stats

from testbed import traces
from testbed.app.assembly.config import TraceConfig
from testbed.app.assembly.run_setup import build_requests
from testbed.core.request import Request
from testbed.traces import TraceError


def compose(*overrides):
    from hydra import compose as hydra_compose, initialize_config_dir

    from testbed.app.entry.cli import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return hydra_compose("config", overrides=list(overrides))


# ----------------------------------------------------------------------------- Mooncake presets

# as the FAST'25 conversation trace starts: ms stamps about 3 s apart (0, 3000, 5999, 9000), several per stamp
STAMPS_MS = [0, 0, 0, 0, 3000, 3000, 3000, 5999, 5999, 9000, 9000, 9000, 9000, 9000, 15000]


def mooncake_rows(stamps_ms, path):
    lines = []
    for i, t in enumerate(stamps_ms):
        prompt = 600 + 37 * i
        blocks = -(-prompt // 512)
        lines.append(json.dumps({"timestamp": t, "input_length": prompt, "output_length": 5 + i,
                                 "hash_ids": [0] + list(range(100 * i + 1, 100 * i + blocks))}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("preset", ["mooncake_conversation", "mooncake_toolagent"])
def test_preset_loads_a_file_with_counts_units_and_times(tmp_path, preset):
    f = mooncake_rows(STAMPS_MS, tmp_path / f"{preset}.jsonl")
    cfg = compose(f"trace={preset}", f"trace.path={f}")
    assert cfg.trace.format == "mooncake" and cfg.trace.spread == "none"
    notes = {}
    reqs, rejected = build_requests(cfg.trace, 0, notes)
    assert rejected == [] and notes == {} and len(reqs) == len(STAMPS_MS)
    assert [r.arrival for r in reqs] == [t / 1000 for t in STAMPS_MS]  # ms -> s, as given
    assert reqs[3].prompt_len == 600 + 37 * 3 and reqs[3].output_len == 8
    assert reqs[3].prefix_block_tokens == 512 and reqs[3].prefix_hashes[0] == 0


@pytest.mark.parametrize("preset", ["mooncake_conversation", "mooncake_toolagent"])
def test_preset_without_a_path_says_it_bundles_no_file(preset):
    cfg = compose(f"trace={preset}")
    assert cfg.trace.name == preset
    with pytest.raises(ValueError, match=rf"trace\.path is required .*trace={preset} bundles no file"):
        build_requests(cfg.trace, 0)


# ----------------------------------------------------------------------------- spreading

def buckets_of(times):
    """The recorded times' buckets: [t, next distinct time) (the last one open)."""
    distinct = sorted(set(times))
    return {t: (distinct[i + 1] if i + 1 < len(distinct) else math.inf) for i, t in enumerate(distinct)}


def reqs_at(times):
    return [Request(i, float(t), 10, 5, source=f"f:{i}") for i, t in enumerate(times)]


def test_detect_bucket_s_is_the_median_step_between_stamps():
    assert traces.detect_bucket_s(reqs_at([t / 1000 for t in STAMPS_MS])) == pytest.approx(3.0, abs=2e-3)
    with pytest.raises(ValueError, match=r"do not look coarse.*trace\.spread_bucket_s"):
        traces.detect_bucket_s(reqs_at([0, 1, 2, 3]))


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(1, 12), min_size=1, max_size=12),
       steps=st.lists(st.sampled_from([2.5, 3.0, 3.0, 6.0]), min_size=12, max_size=12),
       bucket=st.sampled_from([1.0, 3.0, 4.0]), mode=st.sampled_from(["uniform", "poisson"]),
       seed=st.integers(0, 2**31))
def test_spreading_keeps_counts_buckets_and_order(counts, steps, bucket, mode, seed):
    stamps = np.concatenate([[0.0], np.cumsum(steps[:len(counts) - 1])]).tolist()
    times = [t for t, n in zip(stamps, counts) for _ in range(n)]
    reqs = reqs_at(times)
    out = traces.spread_arrivals(reqs, mode, bucket, seed)
    ends = buckets_of(times)
    assert [r.id for r in out] == [r.id for r in reqs]  # order kept, every request once
    new = [r.arrival for r in out]
    assert all(b >= a for a, b in zip(new, new[1:]))
    for r, t in zip(out, times):  # inside its bucket: [t, min(t + bucket, next stamp))
        assert t <= r.arrival < min(t + bucket, ends[t])
    assert out == traces.spread_arrivals(reqs, mode, bucket, seed)  # seeded
    assert [(r.prompt_len, r.output_len, r.source) for r in out] == [(r.prompt_len, r.output_len, r.source)
                                                                     for r in reqs]


def test_uniform_spacing_is_even_and_poisson_is_not():
    reqs = reqs_at([0.0] * 10 + [3.0] * 10)
    even = [r.arrival for r in traces.spread_arrivals(reqs, "uniform", 3.0, 1)][:10]
    assert np.allclose(np.diff(even), 0.3)
    pois = [r.arrival for r in traces.spread_arrivals(reqs, "poisson", 3.0, 1)][:10]
    assert np.diff(pois).std() > 0.01
    assert traces.spread_arrivals(reqs, "poisson", 3.0, 1) != traces.spread_arrivals(reqs, "poisson", 3.0, 2)


def test_poisson_spread_is_uniform_within_its_bucket():
    reqs = reqs_at([0.0] * 4000)
    offsets = [r.arrival / 3.0 for r in traces.spread_arrivals(reqs, "poisson", 3.0, 7)]
    assert stats.kstest(offsets, "uniform").pvalue > 1e-3


def test_spreading_rejects_bad_arguments():
    reqs = reqs_at([0, 0, 3])
    with pytest.raises(ValueError, match=r"trace\.spread.*none, uniform, poisson"):
        traces.spread_arrivals(reqs, "gaussian", 3.0)
    with pytest.raises(ValueError, match=r"trace\.spread_bucket_s"):
        traces.spread_arrivals(reqs, "uniform", 0.0)
    with pytest.raises(ValueError, match="not in time order"):
        traces.spread_arrivals(reqs_at([3, 0, 0]), "uniform", 3.0)
    assert traces.spread_arrivals(reqs, "none", 3.0) == reqs


def test_spread_through_the_config_is_seeded_and_reported(tmp_path):
    f = mooncake_rows(STAMPS_MS, tmp_path / "conv.jsonl")
    cfg = compose("trace=mooncake_conversation", f"trace.path={f}", "trace.spread=poisson")
    notes = {}
    reqs, _ = build_requests(cfg.trace, 3, notes)
    assert notes == {"trace_spread": "poisson", "trace_spread_bucket_s": pytest.approx(3.0, abs=2e-3)}
    assert reqs == build_requests(cfg.trace, 3)[0] != build_requests(cfg.trace, 4)[0]
    assert len(reqs) == len(STAMPS_MS) and any(r.arrival != t / 1000 for r, t in zip(reqs, STAMPS_MS))
    given_width = compose("trace=mooncake_conversation", f"trace.path={f}", "trace.spread=uniform",
                          "trace.spread_bucket_s=1.5")
    notes = {}
    reqs, _ = build_requests(given_width.trace, 0, notes)
    assert notes["trace_spread_bucket_s"] == 1.5
    assert all(t / 1000 <= r.arrival < t / 1000 + 1.5 for r, t in zip(reqs, STAMPS_MS))


def test_the_summary_says_the_trace_was_spread(tmp_path):
    from testbed.app.assembly.run import simulate

    f = mooncake_rows(STAMPS_MS, tmp_path / "conv.jsonl")
    base = ["trace=mooncake_conversation", f"trace.path={f}", "output.print_table=false"]
    spread = simulate(compose(*base, "trace.spread=uniform")).summary
    assert spread["trace_spread"] == "uniform" and spread["trace_spread_bucket_s"] == pytest.approx(3.0, abs=2e-3)
    plain = simulate(compose(*base)).summary
    assert "trace_spread" not in plain and plain["num_requests"] == spread["num_requests"] == len(STAMPS_MS)


# ----------------------------------------------------------------------------- ServeGen

def pmf_text(pmf: dict) -> str:
    return "{" + ", ".join(f"{k}: {v}" for k, v in pmf.items()) + "}"


PROMPTS = {100: 0.25, 400: 0.5, 2000: 0.25}
OUTPUTS = {10: 0.5, 50: 0.3, 300: 0.2}
LATER_PROMPTS = {5000: 1.0}


def write_servegen(folder, *, windows=6, size=600):
    """Client 7: Gamma, rate 2, shape 0.25 (CV 2) in windows 0-2; idle, then Weibull shape 0.5 rate 1.
    Client 9: Gamma shape 1 (Poisson) rate 0.5 throughout. Lengths: one distribution at 0, prompts change at 1800."""
    folder.mkdir(parents=True, exist_ok=True)
    rows7, rows9 = [], []
    for i in range(windows):
        t = i * size
        if i < 3:
            rows7.append(f"{t},2.0,2.0,Gamma,0.25,2.0")
        elif i == 3:
            rows7.append(f"{t},0,0,,0,0")
        else:
            rows7.append(f"{t},1.0,4.5,Weibull,0.5,0.3")
        rows9.append(f"{t},0.5,1.0,Gamma,1.0,2.0")
    (folder / "chunk-7-trace.csv").write_text("\n".join(rows7) + "\n")
    (folder / "chunk-9-trace.csv").write_text("\n".join(rows9) + "\n")
    ds = {"0": {"input_tokens": pmf_text(PROMPTS), "output_tokens": pmf_text(OUTPUTS)},
          "1800": {"input_tokens": pmf_text(LATER_PROMPTS), "output_tokens": pmf_text(OUTPUTS)},
          "2400": {"input_tokens": "{}", "output_tokens": "{}"}}
    for cid in (7, 9):
        (folder / f"chunk-{cid}-dataset.json").write_text(json.dumps(ds))
    return folder


def per_window(reqs, client, start, size=600):
    return np.array([r.arrival for r in reqs if r.tenant == f"client-{client}" and start <= r.arrival < start + size])


def test_servegen_reads_a_folder(tmp_path):
    data = traces.read_servegen(write_servegen(tmp_path / "sg"))
    assert [c.id for c in data.clients] == [7, 9] and data.starts == [0, 600, 1200, 1800, 2400, 3000]
    assert data.category == "language"
    c7 = data.clients[0]
    assert (c7.windows[0].pattern, c7.windows[0].rate, c7.windows[0].shape) == ("Gamma", 2.0, 0.25)
    assert c7.windows[3].pattern == "" and c7.windows[3].rate == 0.0 and c7.windows[-1].size == 600
    assert sorted(c7.datasets) == [0, 1800]  # the empty 2400 window falls back to 1800's, as upstream
    assert c7.datasets[0]["input_tokens"].mean() == pytest.approx(sum(k * p for k, p in PROMPTS.items()))


def test_servegen_reproduces_rates_burstiness_and_lengths(tmp_path):
    folder = write_servegen(tmp_path / "sg", windows=3, size=600)
    # many seeds of the same 3 windows: the counts' mean is rate * window, the gaps' CV the fitted law's
    counts7, counts9, cv7, cv9, prompts, outputs = [], [], [], [], [], []
    data = traces.read_servegen(folder)
    for seed in range(40):
        reqs = traces.servegen(data, seed=seed)
        for w in (0, 600, 1200):
            a7, a9 = per_window(reqs, 7, w), per_window(reqs, 9, w)
            counts7.append(len(a7))
            counts9.append(len(a9))
            cv7.extend(np.diff(a7))
            cv9.extend(np.diff(a9))
        prompts += [r.prompt_len for r in reqs]
        outputs += [r.output_len for r in reqs]
    assert np.mean(counts7) == pytest.approx(2.0 * 600, rel=0.01)  # rounded at random around 1200: exact mean
    assert np.mean(counts9) == pytest.approx(0.5 * 600, rel=0.01)
    gaps7, gaps9 = np.array(cv7), np.array(cv9)
    assert gaps7.std() / gaps7.mean() == pytest.approx(2.0, rel=0.1)  # Gamma shape 0.25: CV 1/sqrt(0.25)
    assert gaps9.std() / gaps9.mean() == pytest.approx(1.0, rel=0.1)
    values, counts = np.unique(prompts, return_counts=True)
    assert set(values) == set(PROMPTS)
    for v, c in zip(values, counts):
        p = PROMPTS[v]
        assert abs(c / len(prompts) - p) < 4 * math.sqrt(p * (1 - p) / len(prompts))
    values, counts = np.unique(outputs, return_counts=True)
    assert set(values) == set(OUTPUTS)
    for v, c in zip(values, counts):
        p = OUTPUTS[v]
        assert abs(c / len(outputs) - p) < 4 * math.sqrt(p * (1 - p) / len(outputs))


def test_servegen_weibull_windows_and_length_windows(tmp_path):
    data = traces.read_servegen(write_servegen(tmp_path / "sg"))
    gaps = []
    for seed in range(30):
        reqs = traces.servegen(data, seed=seed, start_s=2400)
        assert len(per_window(reqs, 7, 1800)) == 0  # idle window
        for w in (2400, 3000):
            gaps.extend(np.diff(per_window(reqs, 7, w)))
        assert {r.prompt_len for r in reqs} == {5000}  # the 6-h window at 1800 holds (2400's is empty)
    gaps = np.array(gaps)
    k = 0.5  # a Weibull law's CV depends on its shape only
    want = math.sqrt(math.gamma(1 + 2 / k) / math.gamma(1 + 1 / k) ** 2 - 1)
    assert gaps.std() / gaps.mean() == pytest.approx(want, rel=0.2)


def test_servegen_is_seeded_and_windows_do_not_depend_on_each_other(tmp_path):
    data = traces.read_servegen(write_servegen(tmp_path / "sg"))
    a, b = traces.servegen(data, seed=5), traces.servegen(data, seed=5)
    assert a == b and a != traces.servegen(data, seed=6)
    assert [r.id for r in a] == list(range(len(a)))
    assert all(x.arrival <= y.arrival for x, y in zip(a, a[1:]))
    part = traces.servegen(data, seed=5, start_s=1200, end_s=2400)
    whole = [(r.arrival, r.prompt_len, r.output_len, r.tenant) for r in a if 1200 <= r.arrival < 2400]
    assert [(r.arrival, r.prompt_len, r.output_len, r.tenant) for r in part] == whole
    assert traces.servegen(data, seed=5, rate_scale=0.5) != a
    half = [len(traces.servegen(data, seed=s, rate_scale=0.5, end_s=1800)) for s in range(10)]
    full = [len(traces.servegen(data, seed=s, end_s=1800)) for s in range(10)]
    assert np.mean(half) == pytest.approx(np.mean(full) / 2, rel=0.02)


def test_servegen_multimodal_prompts_add_the_items_tokens(tmp_path):
    folder = tmp_path / "mm"
    folder.mkdir()
    (folder / "chunk-0-trace.csv").write_text("0,1.0,1.0,Gamma,1.0,1.0\n")
    (folder / "chunk-0-dataset.json").write_text(json.dumps({"0": {
        "text_tokens": "{100: 1.0}", "image_tokens": "{1000: 0.5, 2000: 0.5}", "image_count": "{0: 0.5, 2: 0.5}",
        "audio_tokens": "{0: 1.0}", "audio_count": "{0: 1.0}", "video_tokens": "{0: 1.0}", "video_count": "{0: 1.0}",
        "output_tokens": "{0: 0.5, 20: 0.5}"}}))
    data = traces.read_servegen(folder)
    assert data.category == "multimodal"
    reqs = traces.servegen(data, seed=1)
    assert {r.prompt_len for r in reqs} <= {100, 2100, 3100, 4100} and {r.prompt_len for r in reqs} >= {100, 3100}
    assert {r.output_len for r in reqs} == {1, 20}  # a 0-token output becomes 1


def test_servegen_preset_and_config(tmp_path):
    cfg = compose("trace=servegen", "trace.max_requests=50")
    assert cfg.trace.kind == "servegen" and cfg.trace.name == "servegen"
    reqs, rejected = build_requests(cfg.trace, 0)
    assert rejected == [] and len(reqs) == 50 and reqs[0].arrival >= 0 and reqs[0].tenant.startswith("client-")
    assert reqs == build_requests(cfg.trace, 0)[0] != build_requests(cfg.trace, 1)[0]
    folder = write_servegen(tmp_path / "mine")
    own = compose("trace=servegen", f"trace.path={folder}", "trace.start_s=0", "trace.duration_s=1200")
    assert own.trace.name == "mine"
    reqs, _ = build_requests(own.trace, 0)
    assert all(r.arrival < 1200 for r in reqs) and len(reqs) == pytest.approx(2.5 * 1200, rel=0.1)
    with pytest.raises(ValueError, match=r"trace\.num_requests does not apply"):
        build_requests(OmegaConf.merge(own.trace, {"num_requests": 10}), 0)
    with pytest.raises(FileNotFoundError, match="ServeGen data folder"):
        build_requests(OmegaConf.merge(own.trace, {"path": str(tmp_path / "nope")}), 0)


@pytest.mark.parametrize("trace_csv, dataset, match", [
    ("0,1.0,1.0,Gamma,1.0\n", None, r"chunk-1-trace\.csv:1: field '<row>': 5 fields"),
    ("0,1.0,1.0,Pareto,1.0,1.0\n", None, r"chunk-1-trace\.csv:1: field 'pattern': 'Pareto'"),
    ("0,fast,1.0,Gamma,1.0,1.0\n", None, r"chunk-1-trace\.csv:1: field 'rate': 'fast' is not a number"),
    ("0,1.0,1.0,Gamma,0,1.0\n", None, r"chunk-1-trace\.csv:1: field 'shape'.*needs shape > 0"),
    ("600,1.0,1.0,Gamma,1,1\n0,1.0,1.0,Gamma,1,1\n", None, r"chunk-1-trace\.csv:2: field 'timestamp'.*does not come after"),
    ("0,1.0,1.0,Gamma,1,1\n", "{not json", r"chunk-1-dataset\.json:1: field '<row>': not JSON"),
    ("0,1.0,1.0,Gamma,1,1\n", {"0": {"input_tokens": "{1: 0.5}", "output_tokens": "{1: 1.0}"}},
     r"field 'window 0\.input_tokens': probabilities .* sum to 0\.5"),
    ("0,1.0,1.0,Gamma,1,1\n", {"0": {"input_tokens": "{1: __import__('os')}", "output_tokens": "{1: 1.0}"}},
     r"field 'window 0\.input_tokens': cannot read"),
    ("0,1.0,1.0,Gamma,1,1\n", {"0": {"output_tokens": "{1: 1.0}"}}, r"field 'window 0': needs output_tokens and input"),
    ("0,1.0,1.0,Gamma,1,1\n", {"600": {"input_tokens": "{1: 1.0}", "output_tokens": "{1: 1.0}"}},
     r"field 'window 0': client 1 sends requests .* no length distribution"),
])
def test_servegen_malformed_input_gets_named_errors(tmp_path, trace_csv, dataset, match):
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "chunk-1-trace.csv").write_text(trace_csv)
    ok = {"0": {"input_tokens": "{1: 1.0}", "output_tokens": "{1: 1.0}"}}
    ds = ok if dataset is None else dataset
    (folder / "chunk-1-dataset.json").write_text(ds if isinstance(ds, str) else json.dumps(ds))
    with pytest.raises(TraceError, match=match):
        traces.servegen(folder, seed=0)


def test_servegen_folder_problems(tmp_path):
    with pytest.raises(FileNotFoundError, match="no chunk-<id>-trace.csv"):
        traces.read_servegen(tmp_path)
    write_servegen(tmp_path / "a")
    (tmp_path / "a" / "chunk-9-dataset.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"client 9: chunk-9-dataset\.json is missing"):
        traces.read_servegen(tmp_path / "a")
    write_servegen(tmp_path / "b")
    (tmp_path / "b" / "chunk-9-trace.csv").write_text("0,1,1,Gamma,1,1\n")
    with pytest.raises(TraceError, match=r"chunk-9-trace\.csv:1: field 'timestamp': the windows start at other"):
        traces.read_servegen(tmp_path / "b")


def test_bundled_servegen_sample_is_attributed():
    folder = traces.resolve_servegen_path("servegen_language_sample")
    assert {p.name for p in folder.iterdir()} >= {"LICENSE-APACHE", "SOURCE.md", "chunk-1-trace.csv",
                                                    "chunk-1-dataset.json"}
    assert "Apache" in (folder / "LICENSE-APACHE").read_text()[:200]
    assert "servegen_language_sample" in (traces.DATA_DIR / "README.md").read_text()
    assert not any("servegen" in name for name in traces.bundled_traces())  # distributions, not request traces


# ----------------------------------------------------------------------------- bounded generation (issue 25)

def drawn_lengths(monkeypatch):
    """How many requests' lengths each (client, window) drew: a spy on servegen's `_lengths`."""
    import sys

    sg = sys.modules["testbed.traces.servegen"]  # the module (the package's `servegen` is its function)
    drawn, real = [], sg._lengths

    def spy(pmfs, rng, n):
        drawn.append(n)
        if n > 100_000:  # what the unbounded generator drew at this rate: fail before holding it
            raise AssertionError(f"drew {n} requests' lengths for a cut of a few hundred")
        return real(pmfs, rng, n)

    monkeypatch.setattr(sg, "_lengths", spy)
    return drawn


def test_servegen_max_requests_stops_at_the_windows_it_needs(tmp_path, monkeypatch):
    data = traces.read_servegen(write_servegen(tmp_path / "sg"))
    whole = traces.servegen(data, seed=3)
    drawn = drawn_lengths(monkeypatch)
    cut = traces.servegen(data, seed=3, max_requests=40)
    assert cut == whole[:40]  # windows this small are drawn whole: exactly the uncut run's first requests
    assert len(drawn) == 2  # the first window of each client, not the six
    with pytest.raises(ValueError, match=r"max_requests=0 \(trace\.max_requests\)"):
        traces.servegen(data, max_requests=0)


def test_servegen_huge_rate_scale_generates_only_what_max_requests_keeps(monkeypatch):
    """trace.servegen_rate_scale=1000000 trace.max_requests=1000 once drew every arrival of the hour
    (21.5 GB) before the cut; at any scale only the first max_requests are drawn."""
    cfg = compose("trace=servegen", "trace.servegen_rate_scale=1000000", "trace.max_requests=1000")
    drawn = drawn_lengths(monkeypatch)
    reqs, _ = build_requests(cfg.trace, 0)
    assert len(reqs) == 1000 and sum(drawn) <= 3 * 1000
    assert all(x.arrival <= y.arrival for x, y in zip(reqs, reqs[1:])) and reqs[0].arrival >= 0
    # about 2.2e6 arrivals a second at this scale (the preset's first window): 1000 take about half a millisecond
    assert reqs[-1].arrival - reqs[0].arrival == pytest.approx(1000 / 2.2e6, rel=0.5)


@pytest.mark.parametrize("start", [600, 900])  # on a window's start, inside a window
def test_servegen_cut_window_follows_the_uncut_law(tmp_path, monkeypatch, start):
    """A window cut by max_requests draws its first gaps as the whole window does; inside a window (start_s
    mid-window) its arrival times are the uncut ones exactly, on its start they differ only by the scaling
    total drawn from the rest's law (Gamma: exact; within a few per cent at this size)."""
    folder = write_servegen(tmp_path / "sg", windows=2)
    for f in folder.glob("chunk-9-*"):
        f.unlink()  # client 7 alone: 240,000 arrivals a window at this scale
    data = traces.read_servegen(folder)
    span = dict(seed=2, start_s=start, end_s=1200, rate_scale=200)
    whole = traces.servegen(data, **span)[:300]
    drawn = drawn_lengths(monkeypatch)
    cut = traces.servegen(data, **span, max_requests=300)
    assert drawn == [300] and len(cut) == 300 and cut[0].arrival >= start
    got, want = np.array([r.arrival for r in cut]) - 600, np.array([r.arrival for r in whole]) - 600
    if start == 900:
        assert got == pytest.approx(want, rel=1e-9)
    else:
        assert got == pytest.approx(want, rel=0.05)


def test_poisson_duration_stops_at_max_requests():
    """A duration's generation honours max_requests: the first arrivals as num_requests draws them."""
    cut = traces.poisson(1e6, duration=3600.0, lengths=(10, 5), seed=4, max_requests=100)
    assert cut == traces.poisson(1e6, n=100, lengths=(10, 5), seed=4)
    few = traces.gamma(1.0, 2.0, duration=5.0, lengths=(10, 5), seed=4, max_requests=100)
    assert few == traces.gamma(1.0, 2.0, duration=5.0, lengths=(10, 5), seed=4)  # fewer than the cut: all of them
    cfg = compose("trace=poisson", "trace.num_requests=null", "trace.duration_s=3600", "trace.rate=1000000",
                  "trace.max_requests=50")
    reqs, _ = build_requests(cfg.trace, 0)
    assert len(reqs) == 50
