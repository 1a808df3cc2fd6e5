"""The `traces` package: loaders on the bundled files and on every kind of malformed row,
the column-mapping loader, generators and transforms.

Malformed inputs are written to tmp_path; every strict error must name the file, the
editor line and the field, and lenient loading must account for every row.
"""
from __future__ import annotations

import json
import math
import pickle
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed import traces
from testbed.core.request import Request
from testbed.traces import RejectedRow, TraceError, TraceLoad

CONV = "azure_llm_2023/AzureLLMInferenceTrace_conv.csv"
CODE = "azure_llm_2023/AzureLLMInferenceTrace_code.csv"
MOON = "mooncake_synthetic/synthetic_trace.jsonl"


@pytest.fixture(scope="module")
def conv() -> TraceLoad:
    return traces.load_azure(CONV)


@pytest.fixture(scope="module")
def code() -> TraceLoad:
    return traces.load_azure(CODE)


@pytest.fixture(scope="module")
def moon() -> TraceLoad:
    return traces.load_mooncake(MOON)


def arrivals(reqs) -> np.ndarray:
    return np.array([r.arrival for r in reqs])


# ----------------------------------------------------------------------------- bundled files

def test_bundled_files_are_listed_and_resolvable():
    assert traces.bundled_traces() == [CODE, CONV, MOON]
    for name in traces.bundled_traces():
        p = traces.bundled_path(name)
        assert p.is_file() and p.is_relative_to(traces.DATA_DIR)
    for folder, files in {"azure_llm_2023": ["LICENSE-CC-BY-4.0.txt", "SOURCE.md"],
                          "mooncake_synthetic": ["LICENSE-APACHE", "README-FAST25-release.md", "SOURCE.md"]}.items():
        for f in files:
            assert (traces.DATA_DIR / folder / f).is_file()
    readme = (traces.DATA_DIR / "README.md").read_text()
    assert all(s in readme for s in ("19,366", "8,819", "3,993", "CC-BY-4.0", "Apache-2.0", "Splitwise", "Mooncake"))


def test_azure_conv(conv):
    reqs = conv.requests
    assert conv.rows == len(reqs) == 19_366 and conv.rejected == []
    assert [r.id for r in reqs] == list(range(19_366))
    assert conv.path.endswith(CONV)
    # line 2: 2023-11-16 18:15:46.6805900,374,44 ; line 3: 18:15:50.9951690,396,109
    r0, r1 = reqs[0], reqs[1]
    assert (r0.arrival, r0.prompt_len, r0.output_len) == (0.0, 374, 44)
    assert r0.source == "AzureLLMInferenceTrace_conv.csv:2"
    assert r1.arrival == pytest.approx(4.3145790, abs=1e-9)  # all 7 fractional digits kept
    assert (r1.prompt_len, r1.output_len, r1.source) == (396, 109, "AzureLLMInferenceTrace_conv.csv:3")
    # last line 19367: 2023-11-16 19:14:08.4025270,197,183
    assert reqs[-1].arrival == pytest.approx(3501.7219370, abs=1e-9)
    assert (reqs[-1].prompt_len, reqs[-1].output_len) == (197, 183)
    a = arrivals(reqs)
    assert (np.diff(a) >= 0).all()
    assert all(r.prefix_hashes == () and r.tenant == "default" for r in reqs[:100])


def test_azure_code(code):
    reqs = code.requests
    assert code.rows == len(reqs) == 8_819 and not code.rejected
    assert (reqs[0].arrival, reqs[0].prompt_len, reqs[0].output_len) == (0.0, 4808, 10)
    assert reqs[1].arrival == pytest.approx(0.052, abs=1e-9)  # 18:17:03.9799600 -> 18:17:04.0319600
    assert reqs[-1].arrival == pytest.approx(3435.948056, abs=1e-9)
    assert (np.diff(arrivals(reqs)) >= 0).all()


def test_mooncake(moon):
    reqs = moon.requests
    assert moon.rows == len(reqs) == 3_993 and not moon.rejected
    r0 = reqs[0]
    assert (r0.arrival, r0.prompt_len, r0.output_len) == (0.0, 40160, 6)
    assert r0.prefix_hashes == tuple(range(79)) and r0.prefix_block_tokens == 512
    assert r0.source == "synthetic_trace.jsonl:1"  # no header: the first line is the first row
    assert reqs[2].arrival == pytest.approx(0.04) and reqs[2].prefix_hashes[0] == 151
    assert reqs[-1].arrival == pytest.approx(1022.025, abs=1e-12)
    assert (np.diff(arrivals(reqs)) >= 0).all()
    assert all(len(r.prefix_hashes) == math.ceil(r.prompt_len / 512) for r in reqs)


def test_bundled_lookup_from_any_directory_and_local_files_win(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert traces.load_trace(CODE, "azure").rows == 8_819
    local = tmp_path / "azure_llm_2023"
    local.mkdir()
    (local / "AzureLLMInferenceTrace_code.csv").write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,5,6\n")
    load = traces.load_trace(CODE, "azure")
    assert load.rows == 1 and load.requests[0].prompt_len == 5


def test_missing_file_lists_the_bundled_traces(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        traces.load_trace("nope/missing.csv", "azure")
    msg = str(e.value)
    assert "nope/missing.csv" in msg and all(name in msg for name in traces.bundled_traces())
    with pytest.raises(FileNotFoundError, match="AzureLLMInferenceTrace_conv.csv"):
        traces.bundled_path("missing.csv")
    with pytest.raises(FileNotFoundError, match="directory"):
        traces.load_azure(tmp_path)


# ----------------------------------------------------------------------------- malformed Azure rows

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
GOOD = ["2023-11-16 18:15:46.6805900,374,44\n", "2023-11-16 18:15:50.9951690,396,109\n"]
AFTER = "2023-11-16 18:15:59.0000000,5,5\n"


@pytest.mark.parametrize("bad_row, field, words", [
    ("2023-11-16 18:15:51.0000000,,10\n", "ContextTokens", "missing"),
    ("2023-11-16 18:15:51.0000000,  ,10\n", "ContextTokens", "missing"),
    ("2023-11-16 18:15:51.0000000,abc,10\n", "ContextTokens", "not a number"),
    ("2023-11-16 18:15:51.0000000,-5,10\n", "ContextTokens", "negative"),
    ("2023-11-16 18:15:51.0000000,0,10\n", "ContextTokens", "at least 1"),
    ("2023-11-16 18:15:51.0000000,12.5,10\n", "ContextTokens", "whole number"),
    ("2023-11-16 18:15:51.0000000,inf,10\n", "ContextTokens", "finite"),
    ("2023-11-16 18:15:51.0000000,10,0\n", "GeneratedTokens", "at least 1"),
    ("2023-11-16 18:15:51.0000000,10,-1\n", "GeneratedTokens", "negative"),
    ("2023-11-16 18:15:51.0000000,10\n", "GeneratedTokens", "missing"),  # short row
    ("2023-11-16 18:15:51.0000000,10,10,7\n", "<row>", "4 fields"),  # long row
    ("not-a-time,10,10\n", "TIMESTAMP", "unparseable"),
    ("now,10,10\n", "TIMESTAMP", "unparseable"),  # numpy would read this as the clock
    ("2023-11-16,10,10\n", "TIMESTAMP", "unparseable"),
    ("2023-02-30 18:15:51.0000000,10,10\n", "TIMESTAMP", "unparseable"),  # no such day
    ("2023-11-16 25:15:51.0000000,10,10\n", "TIMESTAMP", "unparseable"),
    ("9999-11-16 18:15:51.0000000,10,10\n", "TIMESTAMP", "unparseable"),  # beyond int64 ns
    ("2023-11-16 18:15:40.0000000,10,10\n", "TIMESTAMP", "backwards"),
    (",10,10\n", "TIMESTAMP", "missing"),
])
def test_azure_bad_row(tmp_path, bad_row, field, words):
    f = tmp_path / "bad.csv"
    f.write_text(HEADER + GOOD[0] + GOOD[1] + bad_row + AFTER)
    with pytest.raises(TraceError) as e:
        traces.load_azure(f)
    err = e.value
    msg = str(err)
    assert "bad.csv:4:" in msg and repr(field) in msg and words in msg
    assert (err.line, err.field) == (4, field) and err.file.endswith("bad.csv") and words in err.reason
    lenient = traces.load_azure(f, lenient=True)
    assert lenient.rows == 4 and len(lenient.requests) == 3 and len(lenient.rejected) == 1
    rej = lenient.rejected[0]
    assert (rej.id, rej.file, rej.line, rej.field) == (2, "bad.csv", 4, field) and words in rej.reason
    assert rej.source == "bad.csv:4" and "bad.csv:4" in str(rej)
    assert [r.id for r in lenient.requests] == [0, 1, 3]
    assert [r.source for r in lenient.requests] == ["bad.csv:2", "bad.csv:3", "bad.csv:5"]
    assert lenient.requests[2].arrival == pytest.approx(59.0 - 46.68059, abs=1e-9)


def test_backwards_error_names_the_earlier_line(tmp_path):
    f = tmp_path / "back.csv"
    f.write_text(HEADER + GOOD[0] + GOOD[1] + "2023-11-16 18:15:47.0000000,1,1\n")
    with pytest.raises(TraceError, match=r"back\.csv:4: field 'TIMESTAMP': time goes backwards.*line 3"):
        traces.load_azure(f)


def test_lenient_counts_every_rejected_row_with_its_reason(tmp_path):
    f = tmp_path / "mixed.csv"
    f.write_text(HEADER +
                 "2023-11-16 18:00:00.0,0,5\n"      # line 2: zero prompt (its time still sets t=0)
                 "2023-11-16 18:00:01.5,10,5\n"     # 3: ok -> arrival 1.5
                 "2023-11-16 17:59:59.0,10,5\n"     # 4: backwards (before line 2's time)
                 "garbage,10,5\n"                   # 5: unparseable
                 "\n"                               # 6: blank, not a row
                 "2023-11-16 18:00:02.0,x,5\n"      # 7: not a number
                 "2023-11-16 18:00:03.0,7,0\n"      # 8: no output token
                 "2023-11-16 18:00:04.25,7,3\n")    # 9: ok -> arrival 4.25
    load = traces.load_azure(f, lenient=True)
    assert load.rows == 7 and len(load.requests) + len(load.rejected) == load.rows
    assert [(r.id, r.arrival, r.source) for r in load.requests] == [(1, 1.5, "mixed.csv:3"), (6, 4.25, "mixed.csv:9")]
    assert [(r.id, r.line, r.field) for r in load.rejected] == [
        (0, 2, "ContextTokens"), (2, 4, "TIMESTAMP"), (3, 5, "TIMESTAMP"), (4, 7, "ContextTokens"),
        (5, 8, "GeneratedTokens")]
    reasons = [r.reason for r in load.rejected]
    assert reasons[0] == "a prompt must be at least 1, got '0'"
    assert reasons[1] == ("time goes backwards: '2023-11-16 17:59:59.0' is earlier than "
                          "'2023-11-16 18:00:01.5' on line 3")
    assert reasons[2].startswith("unparseable time 'garbage'") and reasons[3] == "not a number: 'x'"
    assert "at least one token" in reasons[4]
    assert Counter(r.field for r in load.rejected) == {"TIMESTAMP": 2, "ContextTokens": 2, "GeneratedTokens": 1}
    with pytest.raises(TraceError, match=r"mixed\.csv:2: field 'ContextTokens'"):
        traces.load_azure(f)


def test_csv_line_numbers_with_blank_lines_crlf_bom_and_quoted_newlines(tmp_path):
    f = tmp_path / "odd.csv"
    f.write_bytes(("\ufeff" + HEADER + "\n" + GOOD[0] + "\n\n" + "2023-11-16 18:15:51.0,7,-2\n").replace(
        "\n", "\r\n").encode())
    with pytest.raises(TraceError, match=r"odd\.csv:6: field 'GeneratedTokens': negative"):
        traces.load_azure(f)
    q = tmp_path / "quoted.csv"
    q.write_text('ts,p,o,note\n0,1,1,"two\nlines"\n1,0,1,x\n')
    with pytest.raises(TraceError, match=r"quoted\.csv:4: field 'p'"):
        traces.load_table(q, columns={"arrival": "ts", "prompt_len": "p", "output_len": "o"})
    assert traces.load_table(q, columns={"arrival": "ts", "prompt_len": "p", "output_len": "o"},
                             lenient=True).requests[0].source == "quoted.csv:2"


def test_cr_only_line_endings_are_lines_too(tmp_path):
    """Classic Mac line endings (CR alone): each line a record, its line number named in an error (the
    fast reader once raised a bare `_csv.Error` naming no file)."""
    f = tmp_path / "mac.csv"
    f.write_bytes((HEADER + GOOD[0] + "2023-11-16 18:15:51.0,7,-2\n").replace("\n", "\r").encode())
    with pytest.raises(TraceError, match=r"mac\.csv:3: field 'GeneratedTokens': negative"):
        traces.load_azure(f)
    ok = tmp_path / "mac_ok.csv"
    ok.write_bytes((HEADER + "".join(GOOD)).replace("\n", "\r").encode())
    load = traces.load_azure(ok)
    assert len(load.requests) == len(GOOD) and load.requests[-1].source == f"mac_ok.csv:{len(GOOD) + 1}"


def test_empty_and_header_only_files(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(TraceError, match=r"empty\.csv:1: .*empty"):
        traces.load_azure(empty)
    header_only = tmp_path / "h.csv"
    header_only.write_text(HEADER)
    load = traces.load_azure(header_only)
    assert (load.rows, load.requests, load.rejected) == (0, [], [])


def test_trace_error_is_a_value_error_and_pickles():
    err = TraceError("a.csv", 7, "ContextTokens", "negative length '-1'")
    assert isinstance(err, ValueError) and str(err) == "a.csv:7: field 'ContextTokens': negative length '-1'"
    back = pickle.loads(pickle.dumps(err))
    assert (back.file, back.line, back.field, back.reason, str(back)) == (err.file, 7, err.field, err.reason, str(err))


# ----------------------------------------------------------------------------- malformed Mooncake rows

def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _moon(ts, p=600, o=3, h=(1, 2)):
    return {"timestamp": ts, "input_length": p, "output_length": o, "hash_ids": list(h)}


@pytest.mark.parametrize("bad, field, words", [
    ("{not json", "<row>", "invalid JSON"),
    ("[1, 2, 3]", "<row>", "JSON object"),
    ({"timestamp": 9, "input_length": 600, "output_length": 3}, "hash_ids", "missing"),
    (_moon(9, h=[1, "a"]), "hash_ids", "list of integers"),
    (_moon(9) | {"hash_ids": 5}, "hash_ids", "list of integers"),
    (_moon(9, p=600, h=[1, 2, 3]), "hash_ids", "3 prefix blocks"),  # 600 tokens fill at most 2 blocks
    (_moon(9, p="x"), "input_length", "not a number"),
    (_moon(9, p=True), "input_length", "not a number"),
    (_moon(9, p=0), "input_length", "at least 1"),
    (_moon(9, o=0), "output_length", "at least 1"),
    (_moon(9, o=None), "output_length", "missing"),
    (_moon(None), "timestamp", "missing"),
    (_moon("soon"), "timestamp", "unparseable"),
    (_moon(1), "timestamp", "backwards"),
])
def test_mooncake_bad_row(tmp_path, bad, field, words):
    f = _jsonl(tmp_path / "bad.jsonl", [_moon(0), _moon(5), bad, _moon(12)])
    with pytest.raises(TraceError) as e:
        traces.load_mooncake(f)
    msg = str(e.value)
    assert "bad.jsonl:3:" in msg and repr(field) in msg and words in msg
    load = traces.load_mooncake(f, lenient=True)
    assert load.rows == 4 and [r.id for r in load.requests] == [0, 1, 3]
    assert [(r.line, r.field) for r in load.rejected] == [(3, field)] and words in load.rejected[0].reason
    assert load.requests[2].arrival == pytest.approx(0.012) and load.requests[2].prefix_hashes == (1, 2)


def test_mooncake_blank_lines_are_not_rows_but_keep_line_numbers(tmp_path):
    f = _jsonl(tmp_path / "gaps.jsonl", [_moon(0), "", "   ", _moon(1500, h=[])])
    load = traces.load_mooncake(f)
    assert load.rows == 2 and [(r.id, r.arrival, r.source) for r in load.requests] == [
        (0, 0.0, "gaps.jsonl:1"), (1, 1.5, "gaps.jsonl:4")]
    assert load.requests[1].prefix_hashes == ()


# ----------------------------------------------------------------------------- column mapping

def test_table_csv_with_ms_units_and_every_optional_field(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("ts_ms,in,out,user,prio,cls,blocks\n"
                 "1000,10,5,alice,2,chat,\"[7, 8]\"\n"
                 "1250,20,6,bob,-1,batch,7 9\n"
                 "1250,30,7,carol,0,chat,\n")
    load = traces.load_table(f, columns={"arrival": "ts_ms", "prompt_len": "in", "output_len": "out",
                                         "tenant": "user", "priority": "prio", "slo_class": "cls",
                                         "prefix_hashes": "blocks"}, time_unit="ms", prefix_block_tokens=8)
    assert [(r.arrival, r.prompt_len, r.output_len, r.tenant, r.priority, r.slo_class, r.prefix_hashes)
            for r in load.requests] == [(0.0, 10, 5, "alice", 2, "chat", (7, 8)),
                                        (0.25, 20, 6, "bob", -1, "batch", (7, 9)),
                                        (0.25, 30, 7, "carol", 0, "chat", ())]
    assert all(r.prefix_block_tokens == 8 for r in load.requests)


def test_session_ids_are_read_from_a_mapped_column_and_an_empty_cell_is_no_session(tmp_path):
    cols = {"arrival": "t", "prompt_len": "p", "output_len": "o"}
    f = tmp_path / "s.csv"
    f.write_text("t,p,o,conv\n0,10,5,a\n1,20,6,\n2,30,7,a\n")
    load = traces.load_table(f, columns=cols | {"session_id": "conv"})
    assert [r.session_id for r in load.requests] == ["a", "", "a"]
    assert all(r.session_id == "" for r in traces.load_table(f, columns=cols).requests)
    jl = tmp_path / "s.jsonl"
    jl.write_text('{"t": 0, "p": 7, "o": 2, "s": 12}\n{"t": 1, "p": 8, "o": 3, "s": [1]}\n')
    with pytest.raises(TraceError, match=r"s.jsonl:2: field 's': expected a session id"):
        traces.load_table(jl, columns=cols | {"session_id": "s"})
    lenient = traces.load_table(jl, columns=cols | {"session_id": "s"}, lenient=True)
    assert [r.session_id for r in lenient.requests] == ["12"] and len(lenient.rejected) == 1


def test_table_jsonl_units_and_format_inference(tmp_path):
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"t": 1.5, "p": 7, "o": 2, "tenant": 3}\n{"t": 2.5, "p": 8.0, "o": "3", "tenant": "x"}\n')
    cols = {"arrival": "t", "prompt_len": "p", "output_len": "o"}
    load = traces.load_trace(jl, "jsonl", columns=cols)
    assert [(r.arrival, r.prompt_len, r.output_len) for r in load.requests] == [(0.0, 7, 2), (1.0, 8, 3)]
    us = traces.load_table(jl, columns=cols, time_unit="us")
    assert us.requests[1].arrival == pytest.approx(1e-6)
    labelled = traces.load_table(jl, columns=cols | {"tenant": "tenant"})
    assert [r.tenant for r in labelled.requests] == ["3", "x"]
    other = tmp_path / "t.data"
    other.write_text(jl.read_text())
    with pytest.raises(ValueError, match="format"):
        traces.load_table(other, columns=cols)
    assert traces.load_table(other, columns=cols, format="jsonl").rows == 2
    tsv = tmp_path / "t.tsv"
    tsv.write_text("t\tp\to\n0\t1\t1\n2\t3\t4\n")
    assert traces.load_table(tsv, columns=cols).requests[1].arrival == 2.0


def test_table_datetimes_with_offsets(tmp_path):
    f = tmp_path / "dt.csv"
    f.write_text("when,p,o\n"
                 "2024-01-01T10:00:00Z,1,1\n"
                 "2024-01-01T11:00:00.5+01:00,1,1\n"      # = 10:00:00.5 UTC
                 "2024-01-01T09:00:01.000000001-01:00,1,1\n")  # = 10:00:01.000000001 UTC
    cols = {"arrival": "when", "prompt_len": "p", "output_len": "o"}
    load = traces.load_table(f, columns=cols, time_unit="datetime")
    assert [r.arrival for r in load.requests] == [0.0, 0.5, 1.000000001]
    f.write_text("when,p,o\n2024-01-01 10:00:00,1,1\n2024-01-01 10:00:01Z,1,1\n")
    with pytest.raises(TraceError, match=r"dt\.csv:3: field 'when': mixes times"):
        traces.load_table(f, columns=cols, time_unit="datetime")


def test_mapping_errors(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("ts_ms,in,out\n0,10,5\n")
    with pytest.raises(TraceError) as e:
        traces.load_table(csv, columns={"arrival": "time", "prompt_len": "in", "output_len": "out"})
    msg = str(e.value)
    assert "t.csv:1:" in msg and "'time'" in msg and all(c in msg for c in ("'ts_ms'", "'in'", "'out'"))
    jl = _jsonl(tmp_path / "t.jsonl", [{"t": 0, "p": 1, "o": 1}, {"t": 1, "p": 1, "o": 1, "late": 2}])
    with pytest.raises(TraceError, match=r"no column 'q'.*'t', 'p', 'o', 'late'"):
        traces.load_table(jl, columns={"arrival": "t", "prompt_len": "q", "output_len": "o"})
    with pytest.raises(ValueError, match="unknown field"):
        traces.load_table(csv, columns={"arrival": "ts_ms", "prompt_len": "in", "output_len": "out", "user": "x"})
    with pytest.raises(ValueError, match="output_len"):
        traces.load_table(csv, columns={"arrival": "ts_ms", "prompt_len": "in"})
    with pytest.raises(ValueError, match="time_unit"):
        traces.load_table(csv, columns={"arrival": "ts_ms", "prompt_len": "in", "output_len": "out"}, time_unit="h")
    dup = tmp_path / "dup.csv"
    dup.write_text("t,p,p,o\n0,1,2,1\n")
    with pytest.raises(TraceError, match="more than once"):
        traces.load_table(dup, columns={"arrival": "t", "prompt_len": "p", "output_len": "o"})


def test_load_trace_dispatch(tmp_path):
    assert traces.load_trace(MOON, "mooncake").rows == 3_993
    with pytest.raises(ValueError, match="columns"):
        traces.load_trace(CONV, "csv")
    with pytest.raises(ValueError, match="columns"):
        traces.load_trace(CONV, "azure", columns={"arrival": "TIMESTAMP"})
    with pytest.raises(ValueError, match="time_unit"):
        traces.load_trace(MOON, "mooncake", time_unit="ms")
    with pytest.raises(ValueError, match="azure, mooncake, csv, jsonl, parquet"):
        traces.load_trace(CONV, "xml")
    load = traces.load_trace(CONV, "csv", columns={"arrival": "TIMESTAMP", "prompt_len": "ContextTokens",
                                                    "output_len": "GeneratedTokens"}, time_unit="datetime")
    assert load.requests[1].arrival == pytest.approx(4.314579, abs=1e-9) and load.rows == 19_366


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.tuples(st.sampled_from(["0", "1", "2.5", "-1", "x", "", "1.5"]),
                               st.sampled_from(["1", "7", "0", "-3", "a", "", "2.0"]),
                               st.sampled_from(["1", "3", "0", "", "nan"])), max_size=12))
def test_every_row_is_accounted_for(tmp_path, rows):
    """Lenient: requests + rejected == rows, ids are the row indices; strict: fails at the first rejected line."""
    f = tmp_path / "prop.csv"
    f.write_text("t,p,o\n" + "".join(",".join(r) + "\n" for r in rows))
    cols = {"arrival": "t", "prompt_len": "p", "output_len": "o"}
    load = traces.load_table(f, columns=cols, lenient=True)
    assert load.rows == len(rows) == len(load.requests) + len(load.rejected)
    assert sorted([r.id for r in load.requests] + [r.id for r in load.rejected]) == list(range(len(rows)))
    assert all(r.line == r.id + 2 for r in load.rejected)
    assert (np.diff(arrivals(load.requests)) >= 0).all() and all(r.arrival >= 0 for r in load.requests)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in load.requests)
    if load.rejected:
        with pytest.raises(TraceError) as e:
            traces.load_table(f, columns=cols)
        first = load.rejected[0]
        assert (e.value.line, e.value.field, e.value.reason) == (first.line, first.field, first.reason)
    else:
        assert traces.load_table(f, columns=cols).requests == load.requests


# ----------------------------------------------------------------------------- generators

def test_poisson_is_deterministic_with_the_asked_rate():
    a = traces.poisson(4.0, n=20_000, lengths=(100, 10), seed=1)
    assert a == traces.poisson(4.0, n=20_000, lengths=(100, 10), seed=1)
    assert a != traces.poisson(4.0, n=20_000, lengths=(100, 10), seed=2)
    assert [r.id for r in a] == list(range(20_000)) and a[0].arrival == 0.0
    gaps = np.diff(arrivals(a))
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    assert {(r.prompt_len, r.output_len) for r in a} == {(100, 10)}
    g1 = traces.gamma(4.0, 1.0, n=500, lengths=(100, 10), seed=5)  # cv=1 is Poisson, draw for draw
    assert [r.arrival for r in g1] == [r.arrival for r in traces.poisson(4.0, n=500, lengths=(100, 10), seed=5)]


@pytest.mark.parametrize("cv", [0.5, 3.0])
def test_gamma_has_the_asked_rate_and_cv(cv):
    g = np.diff(arrivals(traces.gamma(4.0, cv, n=20_000, lengths=(100, 10), seed=1)))
    assert g.mean() == pytest.approx(0.25, rel=0.1)
    assert g.std() / g.mean() == pytest.approx(cv, rel=0.1)


def test_generators_by_duration():
    reqs = traces.poisson(5.0, duration=200.0, lengths=(10, 1), seed=0)
    a = arrivals(reqs)
    assert a.max() < 200.0 and a.max() > 195.0 and len(reqs) == pytest.approx(1000, rel=0.1)
    bursty = traces.gamma(5.0, 4.0, duration=200.0, lengths=(10, 1), seed=3)  # needs several draws of gaps
    assert arrivals(bursty).max() < 200.0 and len(bursty) > 200
    assert bursty == traces.gamma(5.0, 4.0, duration=200.0, lengths=(10, 1), seed=3)


def test_generator_lengths_follow_a_trace(code):
    pool = code.requests
    sampled = traces.poisson(2.0, n=20_000, lengths=pool, seed=0)
    pairs = {(r.prompt_len, r.output_len) for r in pool}
    assert all((r.prompt_len, r.output_len) in pairs for r in sampled)
    assert np.mean([r.prompt_len for r in sampled]) == pytest.approx(np.mean([r.prompt_len for r in pool]), rel=0.05)
    assert traces.poisson(2.0, n=50, lengths=code, seed=0) == traces.poisson(2.0, n=50, lengths=pool, seed=0)


@pytest.mark.parametrize("kwargs, words", [
    (dict(rate=0, n=5), "rate"),
    (dict(rate=-1.0, n=5), "rate"),
    (dict(rate=math.inf, n=5), "rate"),
    (dict(rate=1.0), "exactly one"),
    (dict(rate=1.0, n=5, duration=2.0), "exactly one"),
    (dict(rate=1.0, n=0), "n=0"),
    (dict(rate=1.0, n=2.5), "n=2.5"),
    (dict(rate=1.0, duration=-1.0), "duration"),
    (dict(rate=1.0, n=5, lengths=(0, 3)), "lengths"),
    (dict(rate=1.0, n=5, lengths=[]), "empty"),
    (dict(rate=1.0, n=5, lengths="abc"), "lengths"),
])
def test_generator_argument_errors(kwargs, words):
    kwargs.setdefault("lengths", (10, 1))
    with pytest.raises(ValueError, match=words):
        traces.poisson(**kwargs)
    with pytest.raises(ValueError, match="cv"):
        traces.gamma(1.0, 0.0, n=5, lengths=(10, 1))


# ----------------------------------------------------------------------------- transforms

@pytest.fixture
def reqs():
    return [Request(i, 2.0 * i, 1000, 50, prefix_hashes=(9, 8, 7), source=f"x:{i + 2}") for i in range(10)]


def test_scale_rate(reqs):
    fast = traces.scale_rate(reqs, 2.0)
    assert [r.arrival for r in fast] == [i * 1.0 for i in range(10)]
    assert [r.id for r in fast] == list(range(10)) and fast[3].source == "x:5"
    assert [r.arrival for r in traces.scale_rate(reqs, 0.5)] == [4.0 * i for i in range(10)]
    assert reqs[3].arrival == 6.0  # never mutated
    for bad in (0, -1.0, math.nan, math.inf, "2"):
        with pytest.raises(ValueError, match="rate_scale"):
            traces.scale_rate(reqs, bad)


def test_time_window(reqs):
    win = traces.time_window(reqs, 5.0, 12.0)  # arrivals 6, 8, 10 (12 is excluded)
    assert [(r.id, r.arrival) for r in win] == [(3, 1.0), (4, 3.0), (5, 5.0)]
    assert [r.arrival for r in traces.time_window(reqs, 14.0)] == [0.0, 2.0, 4.0]
    assert traces.time_window(reqs, 100.0, 200.0) == []
    with pytest.raises(ValueError, match="start_s"):
        traces.time_window(reqs, -1.0, 5.0)
    with pytest.raises(ValueError, match="end_s"):
        traces.time_window(reqs, 5.0, 5.0)


def test_first_n(reqs):
    assert traces.first_n(reqs, 3) == reqs[:3] and traces.first_n(reqs, 99) == reqs
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="max_requests"):
            traces.first_n(reqs, bad)


def test_cap_lengths():
    r = [Request(0, 0.0, 1500, 80, prefix_hashes=(1, 2, 3)), Request(1, 1.0, 100, 5, prefix_hashes=(4,))]
    capped = traces.cap_lengths(r, max_prompt=600, max_output=20)
    assert [(c.prompt_len, c.output_len, c.prefix_hashes) for c in capped] == [(600, 20, (1, 2)), (100, 5, (4,))]
    assert capped[1] is r[1] and r[0].prompt_len == 1500  # unchanged rows kept; input never mutated
    assert traces.cap_lengths(r, max_output=10)[0].prompt_len == 1500
    assert traces.cap_lengths(r) == r
    with pytest.raises(ValueError, match="max_prompt"):
        traces.cap_lengths(r, max_prompt=0)
    with pytest.raises(ValueError, match="max_output"):
        traces.cap_lengths(r, max_output=-5)


def test_rejected_row_and_trace_load_accounting():
    row = RejectedRow(3, "f.csv", 5, "p", "negative length '-1'")
    assert row.source == "f.csv:5"
    with pytest.raises(ValueError, match="rows"):
        TraceLoad([], [row], "f.csv", rows=3)
    assert TraceLoad([], [row], "f.csv").rows == 1
