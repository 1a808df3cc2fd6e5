"""max_output_tokens_per_s without a time per token (vllm_bench_format.peak_of_even_tokens) is the figure the
token-by-token count gives: every bucket's count is the same, on random runs, on runs whose token times fall on
or next to bucket edges (where float rounding decides the bucket), and the cases it hands back to the count (a
time before the first send, a NaN) give the count's figures."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.app.analysis.vllm_bench_format import (_even_token_buckets, _even_token_times, _first_bucket,
                                                     peak_of_even_tokens, peak_per_second)


def by_token(starts, latencies, first, step, k):
    has = k > 0
    return peak_per_second(starts, _even_token_times(first[has], step[has], k[has]), latencies)


def buckets_by_token(starts, latencies, first, step, k):
    t0, n = _first_bucket(starts, latencies)
    has = k > 0
    times = _even_token_times(first[has], step[has], k[has]) - t0
    return np.bincount(times.astype(np.int64), minlength=n)[:n], _even_token_buckets(
        t0, n, first[has], step[has], k[has].astype(np.int64))[:n]


def run(rng, n, span, max_k, edge_steps=False):
    starts = np.sort(rng.uniform(0, span, n))
    ttft = rng.exponential(0.5, n)
    k = rng.integers(0, max_k, n)
    if edge_steps:  # first tokens on tenths of a second, steps of a tenth or a third: times on or by the edges
        starts = np.floor(starts)
        ttft = np.floor(ttft * 10) / 10
        step = rng.choice([0.1, 0.2, 0.3, 1 / 3, 0.7, 0.25], n)
    else:
        step = rng.exponential(0.03, n)
    latencies = ttft + step * np.maximum(k - 1, 0)
    return starts, latencies, starts + ttft, step, k


@pytest.mark.parametrize("seed", range(40))
def test_every_bucket_holds_the_tokens_the_token_by_token_count_puts_there(seed):
    rng = np.random.default_rng(seed)
    args = run(rng, int(rng.integers(1, 400)), float(rng.uniform(0.5, 300)), int(rng.integers(1, 2000)),
               edge_steps=seed % 2 == 1)
    counted, found = buckets_by_token(*args)
    assert found.tolist() == counted.tolist()
    assert peak_of_even_tokens(*args) == by_token(*args)


def test_rounding_at_a_bucket_edge_decides_as_the_token_by_token_count():
    # 0.7 + 3 * 0.1 is 1.0 exactly in floats, though 3 * 0.1 / 0.1 estimates the fourth token as the first at 1 s
    args = (np.array([0.0]), np.array([2.0]), np.array([0.7]), np.array([0.1]), np.array([12]))
    counted, found = buckets_by_token(*args)
    assert counted.tolist() == [3, 9, 0]
    assert found.tolist() == counted.tolist()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 50), st.floats(0, 20), st.floats(0, 2), st.integers(0, 300)),
                min_size=1, max_size=30))
def test_the_peak_is_the_token_by_token_count_on_any_run(rows):
    starts = np.array([r[0] for r in rows])
    ttft = np.array([r[1] for r in rows])
    step = np.array([r[2] for r in rows])
    k = np.array([r[3] for r in rows], dtype=np.int64)
    latencies = ttft + step * np.maximum(k - 1, 0)
    args = (starts, latencies, starts + ttft, step, k)
    counted, found = buckets_by_token(*args)
    assert found.tolist() == counted.tolist()
    assert peak_of_even_tokens(*args) == by_token(*args)


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
def test_a_token_before_the_first_send_or_a_nan_is_counted_token_by_token():
    starts, latencies = np.array([1.0, 2.0]), np.array([3.0, 2.0])
    early = (starts, latencies, np.array([0.2, 2.5]), np.array([0.5, 0.25]), np.array([5, 6]))
    assert peak_of_even_tokens(*early) == by_token(*early)
    nan = (starts, latencies, np.array([1.5, np.nan]), np.array([0.5, 0.25]), np.array([5, 6]))
    assert peak_of_even_tokens(*nan) == by_token(*nan)


def test_no_successful_request_has_no_peak():
    empty = np.array([])
    assert peak_of_even_tokens(empty, empty, empty, empty, np.array([], dtype=np.int64)) == (0.0, 0)
