"""The trace section of a run (`testbed.app.assembly.run_setup.build_requests`): what a config selects, what
the run is told about the rows it did not serve, and how it fails when nothing is left."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from testbed.app.assembly.config import TraceConfig
from testbed.app.assembly.run_setup import build_requests

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def trace_cfg(path, **kw):
    return OmegaConf.structured(TraceConfig(name="t", path=str(path), **kw))


def azure_rows(seconds, prompt=10):
    return "".join(f"2023-11-16 18:00:{s:09.6f},{prompt},5\n" for s in seconds)


# ----------------------------------------------------------------------------- nothing to simulate

def test_header_only_file_says_there_is_nothing_to_simulate(tmp_path):
    f = tmp_path / "empty.csv"
    f.write_text(HEADER)
    with pytest.raises(ValueError, match=r"nothing to simulate: .*empty\.csv has no data rows"):
        build_requests(trace_cfg(f), 0)


def test_a_window_after_the_last_arrival_names_the_keys(tmp_path):
    f = tmp_path / "short.csv"
    f.write_text(HEADER + azure_rows([0, 1, 2.5]))
    with pytest.raises(ValueError, match=r"nothing to simulate: trace\.start_s=100.* selects none of the 3 "
                                         r"requests of .*short\.csv.*arrive from 0 to 2\.5 s"):
        build_requests(trace_cfg(f, start_s=100.0), 0)
    with pytest.raises(ValueError, match=r"trace\.start_s=1\.5, trace\.end_s=2\.0 selects none"):
        build_requests(trace_cfg(f, start_s=1.5, end_s=2.0), 0)
    assert len(build_requests(trace_cfg(f, start_s=1.0), 0)[0]) == 2


def test_every_row_rejected_is_counted_under_lenient_and_stops_a_strict_load(tmp_path):
    """Lenient means "count bad rows, do not stop", even when all are bad: no request, every row rejected
    (issue 25; it once stopped with 'nothing to simulate'). Strict stops at the first, naming it."""
    f = tmp_path / "bad.csv"
    f.write_text(HEADER + azure_rows([0, 1], prompt=0))
    reqs, rejected = build_requests(trace_cfg(f, lenient=True), 0)
    assert reqs == [] and [(i, src) for i, src, _ in rejected] == [(0, "bad.csv:2"), (1, "bad.csv:3")]
    assert all(why.startswith("invalid-row: field ContextTokens") for _, _, why in rejected)
    with pytest.raises(ValueError, match=r"bad\.csv:2: field 'ContextTokens'"):
        build_requests(trace_cfg(f), 0)


# ----------------------------------------------------------------------------- the trace's name

def compose_trace(*overrides):
    from hydra import compose, initialize_config_dir

    from testbed.app.entry.cli import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides)).trace


@pytest.mark.parametrize("overrides, name", [
    ((), "azure_conv"),
    (("trace=mooncake",), "mooncake"),
    (("trace=poisson",), "poisson"),
    (("trace.kind=file", "trace.format=csv", "trace.path=/data/my_trace.csv"), "my_trace"),
    (("trace.path=runs/day1.csv.gz",), "day1"),
    (("trace=mooncake", "trace.path=other.jsonl"), "other"),
    (("trace=poisson", "trace.kind=file", "trace.path=x/y.parquet"), "y"),
    (("trace.path=/data/my_trace.csv", "trace.name=mine"), "mine"),
])
def test_a_users_file_is_named_after_its_stem(overrides, name):
    """A file of one's own keeps no bundled trace's name: the summary, the table title and
    the output folder all read trace.name."""
    assert compose_trace(*overrides).name == name


# ----------------------------------------------------------------------------- rejected rows of a selection

def _mixed(tmp_path, n):
    """Rows at t = 0, 1, 2, ... seconds; odd rows have a zero prompt (rejected, time known)."""
    f = tmp_path / "mixed.csv"
    f.write_text(HEADER + "".join(f"2023-11-16 18:{i // 60:02d}:{i % 60:02d}.0,{0 if i % 2 else 10},5\n"
                                  for i in range(n)))
    return f


def test_max_requests_counts_only_the_rejected_rows_among_the_kept(tmp_path):
    """Finding 2: 100 requests kept used to report every bad row of the whole file."""
    f = _mixed(tmp_path, 2000)
    reqs, rejected = build_requests(trace_cfg(f, lenient=True, max_requests=100), 0)
    assert [r.id for r in reqs] == list(range(0, 200, 2))
    assert [i for i, *_ in rejected] == list(range(1, 198, 2))  # row 199 lies after the 100th request
    assert len(build_requests(trace_cfg(f, lenient=True), 0)[1]) == 1000  # no selection: every row counts


def test_a_window_counts_rejected_rows_by_time_or_else_by_place(tmp_path):
    f = tmp_path / "w.csv"
    f.write_text(HEADER +
                 "2023-11-16 18:00:00.0,10,5\n"   # 2: t=0, before the window
                 "2023-11-16 18:00:01.0,0,5\n"    # 3: bad, t=1: before the window by its time
                 "garbage,10,5\n"                 # 4: bad, no time: between t=0 and t=4, inside by place
                 "2023-11-16 18:00:04.0,10,5\n"   # 5: t=4, kept
                 "2023-11-16 18:00:05.0,0,5\n"    # 6: bad, t=5: inside by time
                 "2023-11-16 18:00:06.0,10,5\n"   # 7: t=6, kept
                 "2023-11-16 18:00:07.0,10,0\n"   # 8: bad, t=7: inside by time (after the last kept)
                 "also garbage,10,5\n"            # 9: bad, no time: before the first request after the window
                 "2023-11-16 18:00:09.0,10,5\n"   # 10: t=9, after the window
                 "garbage again,10,5\n"           # 11: bad, no time, after the window
                 "2023-11-16 18:00:09.5,0,5\n")   # 12: bad, t=9.5, after the window
    reqs, rejected = build_requests(trace_cfg(f, lenient=True, start_s=2.0, end_s=8.0), 0)
    assert [r.id for r in reqs] == [3, 5] and [r.arrival for r in reqs] == [2.0, 4.0]
    assert [src for _, src, _ in rejected] == ["w.csv:4", "w.csv:6", "w.csv:8", "w.csv:9"]
    # and max_requests=1 cuts the window after its first request (line 5)
    _, rejected = build_requests(trace_cfg(f, lenient=True, start_s=2.0, end_s=8.0, max_requests=1), 0)
    assert [src for _, src, _ in rejected] == ["w.csv:4"]


def test_rejected_rows_carry_their_time_when_it_is_known(tmp_path):
    from testbed import traces

    load = traces.load_azure(_mixed(tmp_path, 4), lenient=True)
    assert [(r.id, r.arrival) for r in load.rejected] == [(1, 1.0), (3, 3.0)]
    f = tmp_path / "g.csv"
    f.write_text(HEADER + "2023-11-16 18:00:00.0,10,5\nnope,1,1\n2023-11-16 17:00:00.0,1,1\n")
    assert [r.arrival for r in traces.load_azure(f, lenient=True).rejected] == [None, None]
