"""Arrival times a float64 second cannot hold: rejected at load, never produced by a transform.

The simulator keeps time as float64 seconds; past 2**32 s (136 years) their spacing
exceeds a microsecond, so a trace time of 1e18 s made every TTFT 0.0 ms and +-1e308
made an arrival of inf that was reported as finished.
"""
from __future__ import annotations

import math

import pytest

from testbed import traces
from testbed.core.request import Request
from testbed.traces import TraceError

COLS = {"arrival": "t", "prompt_len": "p", "output_len": "o"}


def _csv(tmp_path, times, name="t.csv"):
    f = tmp_path / name
    f.write_text("t,p,o\n" + "".join(f"{t},5,5\n" for t in times))
    return f


@pytest.mark.parametrize("unit, times, bad_lines, words", [
    ("s", ["0", "1e18", "1e18"], [3, 4], "too large"),
    ("s", ["0", "1", "1e308"], [4], "too large"),
    ("s", ["-1e308", "0", "1"], [2], "too large"),
    ("s", ["0", "1", str(2**32)], [4], "too large"),
    ("ms", ["0", "1", "5e12"], [4], "too large"),
    ("us", ["0", "1", "5e15"], [4], "too large"),
    ("s", ["0", "1", "inf"], [4], "non-finite"),
])
def test_unrepresentable_times_are_rejected(tmp_path, unit, times, bad_lines, words):
    f = _csv(tmp_path, times)
    with pytest.raises(TraceError) as e:
        traces.load_table(f, columns=COLS, time_unit=unit)
    assert (e.value.line, e.value.field) == (bad_lines[0], "t") and words in e.value.reason
    load = traces.load_table(f, columns=COLS, time_unit=unit, lenient=True)
    assert [r.line for r in load.rejected] == bad_lines and all(words in r.reason for r in load.rejected)
    assert all(math.isfinite(r.arrival) and r.arrival < 2**32 for r in load.requests)


def test_epoch_times_in_every_unit_still_load(tmp_path):
    for unit, times in (("s", ["1700000000", "1700000000.25"]), ("ms", ["1700000000000", "1700000000250"]),
                        ("us", ["1700000000000000", "1700000000250000"])):
        f = _csv(tmp_path, times)
        assert [r.arrival for r in traces.load_table(f, columns=COLS, time_unit=unit).requests] == [0.0, 0.25]


def test_datetimes_too_far_from_the_first_arrival(tmp_path):
    f = tmp_path / "dt.csv"
    f.write_text("t,p,o\n2000-01-01 00:00:00,5,5\n2100-01-01 00:00:00,5,5\n2200-01-01 00:00:00,5,5\n")
    with pytest.raises(TraceError, match=r"dt\.csv:4: field 't': .*too large"):
        traces.load_table(f, columns=COLS, time_unit="datetime")
    load = traces.load_table(f, columns=COLS, time_unit="datetime", lenient=True)
    assert len(load.requests) == 2 and [r.line for r in load.rejected] == [4]


def test_rate_scaling_cannot_make_such_times():
    reqs = [Request(0, 0.0, 5, 5), Request(1, 3500.0, 5, 5)]
    assert traces.scale_rate(reqs, 1e-6)[1].arrival == pytest.approx(3.5e9)
    for factor in (1e-7, 1e-300, 5e-324):
        with pytest.raises(ValueError, match=r"trace\.rate_scale.*2\*\*32 s"):
            traces.scale_rate(reqs, factor)


def test_generators_cannot_make_such_times():
    with pytest.raises(ValueError, match=r"trace\.rate.*2\*\*32 s"):
        traces.poisson(1e-300, n=3, lengths=(5, 5))


@pytest.mark.parametrize("offset, ok", [("+00:00", True), ("-08:00", True), ("+0530", True), ("+23:59", True),
                                        ("+99:99", False), ("+24:00", False), ("-05:60", False)])
def test_timezone_offsets_beyond_iso_8601_are_refused(tmp_path, offset, ok):
    """An offset of +99:99 once moved its row by about 100 h without a word."""
    f = tmp_path / "tz.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5+00:00,100,10\n"
                 f"2023-11-17 18:15:47.5{offset},100,10\n")
    if ok:
        assert len(traces.load_azure(f).requests) == 2
    else:
        with pytest.raises(TraceError, match=r"tz.csv:3: field 'TIMESTAMP': unparseable time"):
            traces.load_azure(f)
