"""Trace containers beyond plain CSV and JSONL: gzip/zstd streams and Parquet, read through
pyarrow with the same per-row validation, line (or row) numbers and lenient accounting."""
from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from testbed import traces
from testbed.traces import TraceError

HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROWS = ["2023-11-16 18:15:46.6805900,374,44\n", "2023-11-16 18:15:50.9951690,396,109\n",
        "2023-11-16 18:15:51.0000000,0,10\n",  # line 4: a zero prompt
        "2023-11-16 18:15:59.0000000,5,5\n"]
COLS = {"arrival": "t", "prompt_len": "p", "output_len": "o"}


def _compressed(path, text: str, codec: str):
    with pa.CompressedOutputStream(str(path), codec) as out:
        out.write(text.encode())
    return path


def _fields(reqs):
    return [(r.id, r.arrival, r.prompt_len, r.output_len, r.prefix_hashes) for r in reqs]


@pytest.mark.parametrize("suffix, codec", [(".csv.gz", "gzip"), (".csv.zst", "zstd"), (".csv.zstd", "zstd")])
def test_compressed_csv_loads_as_the_plain_file(tmp_path, suffix, codec):
    text = HEADER + "".join(ROWS)
    plain = tmp_path / "t.csv"
    plain.write_text(text)
    packed = _compressed(tmp_path / f"t{suffix}", text, codec)
    with pytest.raises(TraceError) as e:
        traces.load_azure(packed)
    assert (e.value.file, e.value.line, e.value.field) == (str(packed), 4, "ContextTokens")
    a, b = traces.load_azure(plain, lenient=True), traces.load_azure(packed, lenient=True)
    assert _fields(a.requests) == _fields(b.requests) and len(b.requests) == 3
    assert [(r.line, r.field, r.reason) for r in b.rejected] == [(r.line, r.field, r.reason) for r in a.rejected]
    assert b.rejected[0].file == f"t{suffix}" and b.requests[2].source == f"t{suffix}:5"
    # through the column mapping too, the format told by the suffix under the compression
    mapped = traces.load_table(packed, columns={"arrival": "TIMESTAMP", "prompt_len": "ContextTokens",
                                                "output_len": "GeneratedTokens"}, time_unit="datetime", lenient=True)
    assert _fields(mapped.requests) == _fields(a.requests)


def test_compressed_jsonl_and_a_broken_stream(tmp_path):
    f = tmp_path / "m.jsonl.gz"
    f.write_bytes(gzip.compress(b"".join(json.dumps(
        {"timestamp": t, "input_length": 600, "output_length": o, "hash_ids": [1, 2]}).encode() + b"\n"
        for t, o in ((0, 3), (5, 0), (12, 3)))))
    with pytest.raises(TraceError, match=r"m\.jsonl\.gz:2: field 'output_length': .*at least"):
        traces.load_mooncake(f)
    load = traces.load_mooncake(f, lenient=True)
    assert _fields(load.requests) == [(0, 0.0, 600, 3, (1, 2)), (2, 0.012, 600, 3, (1, 2))]
    broken = tmp_path / "b.csv.gz"
    broken.write_bytes(gzip.compress((HEADER + "".join(ROWS)).encode())[:40])
    with pytest.raises(TraceError, match=r"b\.csv\.gz:1: .*cannot decompress it as gzip"):
        traces.load_azure(broken)


def test_parquet_matches_csv_and_names_rows(tmp_path):
    strings = pa.table({"t": ["0", "1.5", "2", "x", "4"], "p": [10, 20, 0, 5, 7], "o": [1, 2, 3, 4, None]})
    f = tmp_path / "t.parquet"
    pq.write_table(strings, f)
    with pytest.raises(TraceError) as e:
        traces.load_table(f, columns=COLS)
    assert str(e.value).startswith(f"{f}:3: field 'p': a prompt must be at least 1, got 0")
    load = traces.load_table(f, columns=COLS, lenient=True)
    assert load.rows == 5 and _fields(load.requests) == [(0, 0.0, 10, 1, ()), (1, 1.5, 20, 2, ())]
    assert [(r.id, r.line, r.field) for r in load.rejected] == [(2, 3, "p"), (3, 4, "t"), (4, 5, "o")]
    assert [r.reason for r in load.rejected][1:] == ["unparseable or non-finite time 'x'", "missing value"]
    assert load.requests[1].source == "t.parquet:2"
    # the same rows as CSV give the same requests and rejections, at lines one further down
    csv = tmp_path / "t.csv"
    csv.write_text("t,p,o\n0,10,1\n1.5,20,2\n2,0,3\nx,5,4\n4,7,\n")
    same = traces.load_table(csv, columns=COLS, lenient=True)
    assert _fields(same.requests) == _fields(load.requests)
    assert [(r.line - 1, r.field) for r in same.rejected] == [(r.line, r.field) for r in load.rejected]
    assert same.rejected[0].reason == "a prompt must be at least 1, got '0'"  # quoted as written: text in a CSV


def test_parquet_typed_columns(tmp_path):
    f = tmp_path / "typed.parquet"
    ts = pa.array([0, 250_000_000, 1_000_000_001], pa.timestamp("ns", tz="UTC"))
    pq.write_table(pa.table({"when": ts, "p": pa.array([600, 2, 3], pa.int32()), "o": [1.0, 2.0, 2.5],
                             "h": [[1, 2], [], [3]],
                             "user": pa.array(["a", "b", "a"]).dictionary_encode()}), f)
    cols = {"arrival": "when", "prompt_len": "p", "output_len": "o", "prefix_hashes": "h", "tenant": "user"}
    load = traces.load_trace(f, "parquet", columns=cols, time_unit="datetime", lenient=True)
    assert [(r.arrival, r.prompt_len, r.output_len, r.prefix_hashes, r.tenant) for r in load.requests] == [
        (0.0, 600, 1, (1, 2), "a"), (0.25, 2, 2, (), "b")]
    assert [(r.line, r.field, r.reason) for r in load.rejected] == [(3, "o", "not a whole number: 2.5")]


def test_parquet_by_suffix_schema_errors_and_a_file_that_is_not_parquet(tmp_path):
    f = tmp_path / "az.parquet"
    pq.write_table(pa.table({"TIMESTAMP": [r.split(",")[0] for r in ROWS], "ContextTokens": [374, 396, 1, 5],
                             "GeneratedTokens": [44, 109, 10, 5]}), f)
    assert traces.load_trace(f, "azure").requests[1].arrival == pytest.approx(4.314579, abs=1e-9)
    assert traces.load_table(f, columns={"arrival": "TIMESTAMP", "prompt_len": "ContextTokens",
                                         "output_len": "GeneratedTokens"}, time_unit="datetime", format="csv").rows == 4
    with pytest.raises(TraceError, match=r"az\.parquet:1: field 'time': no column 'time'.*'TIMESTAMP', 'Context"):
        traces.load_table(f, columns={"arrival": "time", "prompt_len": "ContextTokens",
                                      "output_len": "GeneratedTokens"})
    fake = tmp_path / "fake.parquet"
    fake.write_text(HEADER)
    with pytest.raises(TraceError, match=r"fake\.parquet:1: .*not a readable Parquet file"):
        traces.load_table(fake, columns=COLS)


def test_the_format_follows_the_suffix_under_a_compression(tmp_path):
    f = _compressed(tmp_path / "x.tsv.gz", "t\tp\to\n0\t1\t1\n2\t3\t4\n", "gzip")
    assert _fields(traces.load_table(f, columns=COLS).requests) == [(0, 0.0, 1, 1, ()), (1, 2.0, 3, 4, ())]
    with pytest.raises(ValueError, match="parquet"):
        traces.load_table(tmp_path / "x.dat.gz", columns=COLS)


# ----------------------------------------------------------------------------- pyarrow's CSV parse vs line by line

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_CELL = st.sampled_from(["0", "1.5", " 2", "x", "", '"a,b"', '"two\nlines"', '"say ""hi"""', "7 ", "-3"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.one_of(st.lists(_CELL, min_size=3, max_size=3), st.lists(_CELL, min_size=1, max_size=5),
                               st.sampled_from(["", "   ", "\t"])), max_size=10),
       crlf=st.booleans(), bom=st.booleans(), last_newline=st.booleans())
def test_pyarrow_csv_rows_keep_their_lines(tmp_path, rows, crlf, bom, last_newline):
    """The fast path (pyarrow, lines from a scan of the bytes, the csv module for rows wider or
    narrower than the header) reads a file exactly as the csv module alone does, line
    numbers and row errors included."""
    from testbed.traces import readers

    text = "t,p,o\n" + "\n".join(r if isinstance(r, str) else ",".join(r) for r in rows)
    text += "\n" if last_newline else ""
    if crlf:
        text = text.replace("\n", "\r\n")
    data = (b"\xef\xbb\xbf" if bom else b"") + text.encode()
    f = tmp_path / "w.csv"
    f.write_bytes(data)
    fast = readers._read_csv_arrow(f, data.removeprefix(b"\xef\xbb\xbf"), ",", ["t", "p", "o"])
    slow = readers._read_csv_python(f, data.decode("utf-8-sig"), ",", ["t", "p", "o"])
    assert fast is not None
    assert fast.lines.tolist() == slow.lines.tolist() and fast.header_line == slow.header_line
    assert {c: readers.pylist(v) for c, v in fast.columns.items()} == slow.columns
    assert fast.row_errors == slow.row_errors


_JSON_VALUE = st.sampled_from([0, 5, -3, 2.5, 8.0, "6", "", None, True, [1, 2], [], 2**60, "x"])


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.one_of(st.dictionaries(st.sampled_from(["t", "p", "h"]), _JSON_VALUE),
                               st.sampled_from(["", "  ", "[1]", "{bad", '{"t": 1, "t": 2}'])), max_size=8),
       crlf=st.booleans())
def test_pyarrow_json_rows_keep_their_lines_and_values(tmp_path, rows, crlf):
    """pyarrow.json's parse, where it is taken, gives every row the line and the values
    (quoted as json.loads reads them) that the line-by-line reader gives."""
    from testbed.traces import readers

    text = "\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n"
    data = (text.replace("\n", "\r\n") if crlf else text).encode()
    roles = {"h": {"hashes"}}
    fast = readers._read_jsonl_arrow(data, ["t", "p", "h"], roles)
    slow = readers._read_jsonl_python(data, ["t", "p", "h"])
    if fast is None:  # a row pyarrow cannot read as json.loads does: the line-by-line reader's job
        return
    assert fast.lines.tolist() == slow.lines.tolist() and fast.header == slow.header
    for c, cells in fast.columns.items():
        assert [readers.value(cells, i) for i in range(fast.rows)] == slow.columns[c]


def test_mooncake_is_read_by_pyarrow():
    from testbed.traces import readers

    table = readers.read_jsonl(traces.bundled_path("mooncake_synthetic/synthetic_trace.jsonl"),
                               ["timestamp", "input_length", "output_length", "hash_ids"], {"hash_ids": {"hashes"}})
    assert all(isinstance(c, pa.Array) for c in table.columns.values()) and table.rows == 3_993
