"""Trace containers -> a table of raw cells, each row with the line (or row) it came from.

Why it is built this way:

* **pyarrow does the reading** wherever it can still say where a row came from. A CSV is
  parsed by `pyarrow.csv` in C, only the mapped columns, every cell kept as text so the
  loader judges it (and quotes it in an error) exactly as written; a Parquet file is read
  by `pyarrow.parquet`, again only the mapped columns; JSONL by `pyarrow.json`; gzip and zstd streams (``.gz``,
  ``.zst``, ``.zstd``) are decompressed by pyarrow.
* **Line numbers come from one numpy pass over the bytes**: the positions of the newlines
  that end records (a newline inside a quoted field does not: an even number of quotes
  precedes a record's end) give every record's first line, and the delimiters outside
  quotes give its field count. pyarrow drops empty lines, so its rows map one to one onto
  the non-blank records after the header, as long as every record is as wide as the header.
* **Rows that do not fit** (wider or narrower than the header, whitespace-only lines) are
  skipped by pyarrow and read one by one by the standard library's csv module, which
  reports each exactly. A file pyarrow and the scan disagree on (a stray quote inside an
  unquoted field) is read wholly by the csv module; only such files pay for it.
* **JSONL** is parsed by `pyarrow.json` when every row is an object whose mapped values have
  one JSON type per column (pyarrow skips blank lines as the scan does); otherwise (a line
  that is not JSON or not an object, a key twice, a column mixing numbers and text) line by
  line with `json.loads`, so each such row is judged on its own.
* **Parquet rows have no lines**: their "line" is the 1-based row number, and problems
  with the file as a whole are reported at row 1.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.json as pj
import pyarrow.parquet as pq

from testbed.traces.errors import TraceError

# pyarrow, while it reads or writes (here, and pandas' parquet files), takes SIGINT for itself and cancels the
# operation (ArrowCancelled): a sweep job stopped by Ctrl-C lost its results mid-write. A signal is the command's
# (testbed/app/entry/stop.py: it stops at a step's end and writes what it has), so pyarrow's handler is off.
pa.enable_signal_handlers(False)

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}  # file suffix -> pyarrow codec
ROW = "<row>"  # the pseudo-field of row-level problems
Cells = Union[list, pa.Array, "JsonNumbers"]  # a column's cells: Python values (line by line) or a pyarrow array
_BOM = b"\xef\xbb\xbf"


@dataclass
class Table:
    """A file's data rows as raw cells, by column, with where each row came from.

    `cells(col)` is a list of Python values (str for CSV, JSON values, None where absent)
    or a pyarrow array; only the requested columns are kept. `fixed_columns` is true
    where every row has the same columns (CSV, Parquet), false for JSONL, whose keys vary
    by row.
    """

    header: list[str]
    header_line: int
    lines: np.ndarray  # per data row: the editor line its record starts on, or its 1-based row number
    columns: dict[str, Cells]
    row_errors: dict[int, str] = field(default_factory=dict)  # row index -> reason (field "<row>")
    duplicates: set[str] = field(default_factory=set)  # columns named twice in the header
    fixed_columns: bool = True

    @property
    def rows(self) -> int:
        return len(self.lines)

    def has(self, col: str) -> bool:
        return col in self.header

    def cells(self, col: str) -> Cells:
        return self.columns[col]


@dataclass
class JsonNumbers:
    """A JSON column pyarrow read as float64, though some of its cells may be ints: computed
    on as the array, but a cell quoted in a message is re-read from its own line, so a bad
    row's 5 is quoted as 5 (json.loads' value), not as 5.0."""

    array: pa.Array
    key: str
    data: bytes
    starts: np.ndarray
    ends: np.ndarray

    def __len__(self) -> int:
        return len(self.array)


def value(cells: Cells, i: int):
    """The Python value of one cell (for messages: a bad row's cell as the file wrote it)."""
    if isinstance(cells, JsonNumbers):
        return json.loads(cells.data[cells.starts[i]:cells.ends[i]]).get(cells.key)
    return cells[i].as_py() if isinstance(cells, pa.Array) else cells[i]


def unwrap(cells: Cells) -> list | pa.Array:
    """The cells to compute on: a list or a pyarrow array."""
    return cells.array if isinstance(cells, JsonNumbers) else cells


def pylist(cells: Cells) -> list:
    cells = unwrap(cells)
    return cells.to_pylist() if isinstance(cells, pa.Array) else cells


def compression(p: Path) -> str | None:
    return COMPRESSIONS.get(p.suffix.lower())


def read_bytes(p: Path) -> bytes:
    """The file's content, decompressed when its suffix names a codec."""
    codec = compression(p)
    if codec is None:
        return p.read_bytes()
    try:
        with pa.input_stream(str(p), compression=codec) as f:
            return f.read()
    except (OSError, pa.ArrowInvalid) as e:
        raise TraceError(str(p), 1, ROW, f"cannot decompress it as {codec}: {e}") from None


def _header_index(header: list[str]) -> tuple[dict[str, int], set[str]]:
    """Column -> position (of its first occurrence), and the names that occur twice."""
    index: dict[str, int] = {}
    for j, h in enumerate(header):
        index.setdefault(h, j)
    return index, {h for j, h in enumerate(header) if index[h] != j}


# ----------------------------------------------------------------------------- CSV

def read_csv(p: Path, delimiter: str, wanted: list[str]) -> Table:
    data = read_bytes(p)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TraceError(str(p), data[:e.start].count(b"\n") + 1, ROW, f"not UTF-8 text ({e.reason})") from None
    if data.startswith(_BOM):
        data = data[len(_BOM):]
    if b"\r" in data and b"\n" not in data:  # classic Mac line endings (CR only): a line is a record all the same
        data = data.replace(b"\r", b"\n")
    fast = _read_csv_arrow(p, data, delimiter, wanted) if len(delimiter.encode()) == 1 else None
    return fast if fast is not None else _read_csv_python(p, data.decode("utf-8"), delimiter, wanted)


def _records(b: np.ndarray, delimiter: int, quoted: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each record's start and end offsets, first line, and number of fields."""
    newlines = np.flatnonzero(b == 10)
    if quoted:  # a newline or delimiter inside quotes is data: an odd number of quotes precedes it
        quotes = np.flatnonzero(b == 34)
        ending = np.flatnonzero(np.searchsorted(quotes, newlines) % 2 == 0)
    else:
        ending = np.arange(len(newlines))
    ends = newlines[ending]
    first_lines = np.concatenate([[1], ending + 2])
    if len(b) and b[-1] != 10:  # a last record without its newline
        ends = np.append(ends, len(b))
    else:
        first_lines = first_lines[:-1]
    starts = np.concatenate([[0], ends + 1])[:len(ends)].astype(np.int64)
    delims = np.flatnonzero(b == delimiter)
    if quoted:
        delims = delims[np.searchsorted(quotes, delims) % 2 == 0]
    fields = np.searchsorted(delims, ends) - np.searchsorted(delims, starts) + 1
    return starts, ends, first_lines, fields


def _read_csv_arrow(p: Path, data: bytes, delimiter: str, wanted: list[str]) -> Table | None:
    """pyarrow's parse of a CSV, or None where the file needs the line-by-line reader.

    Rows wider or narrower than the header (few, in any file worth loading) are skipped by
    pyarrow and read one by one by the csv module, so a bad row costs the fast path nothing.
    """
    b = np.frombuffer(data, dtype=np.uint8)
    quoted = b'"' in data
    starts, ends, first_lines, fields = _records(b, ord(delimiter), quoted)
    length = ends - starts
    blank = (length == 0) | ((length == 1) & (b[np.minimum(starts, max(len(b) - 1, 0))] == 13))
    for k in np.flatnonzero((fields == 1) & ~blank):  # one field: blank if it is only whitespace
        blank[k] = not data[starts[k]:ends[k]].strip()
    records = np.flatnonzero(~blank)
    if not len(records):
        raise TraceError(str(p), 1, "<header>", "the file is empty: expected a header line naming the columns")
    h, rows = records[0], records[1:]
    try:
        header = [c.strip() for c in next(csv.reader([data[starts[h]:ends[h]].decode("utf-8")], delimiter=delimiter))]
    except csv.Error:
        return None  # the csv module's line-by-line reader names the file and line of what it cannot read
    width, header_line = len(header), int(first_lines[h])
    if width != fields[h]:
        return None  # a quoted newline in the header: leave it to the csv module
    index, duplicates = _header_index(header)
    take = {c: index[c] for c in wanted if c in index}
    if not len(rows):
        return Table(header, header_line, first_lines[rows], {c: [] for c in take}, {}, duplicates)
    odd = fields[rows] != width
    names = [f"f{j}" for j in range(width)]
    try:
        table = pcsv.read_csv(
            pa.py_buffer(data)[int(ends[h]) + 1:], read_options=pcsv.ReadOptions(column_names=names),
            parse_options=pcsv.ParseOptions(delimiter=delimiter, newlines_in_values=quoted, ignore_empty_lines=True,
                                            invalid_row_handler=lambda row: "skip" if row.actual_columns != width
                                            else "error"),
            convert_options=pcsv.ConvertOptions(include_columns=sorted({names[j] for j in take.values()}),
                                                column_types={n: pa.string() for n in names}, null_values=[],
                                                strings_can_be_null=False, quoted_strings_can_be_null=False))
    except pa.ArrowInvalid:
        return None
    if table.num_rows != len(rows) - odd.sum():
        return None  # a stray quote: pyarrow and the scan disagree on the records
    columns = {c: table.column(names[j]).combine_chunks() for c, j in take.items()}
    row_errors = {}
    if odd.any():
        odd_rows = np.flatnonzero(odd)
        recs = [next(csv.reader(io.StringIO(data[starts[r]:ends[r]].decode("utf-8"), newline=""), delimiter=delimiter))
                for r in rows[odd_rows].tolist()]
        row_errors = {int(k): _too_many(len(rec), header_line, width) for k, rec in zip(odd_rows, recs)
                      if len(rec) > width}
        order = np.empty(len(rows), dtype=np.int64)  # row -> its place in (pyarrow's rows + the odd ones)
        order[~odd] = np.arange(table.num_rows)
        order[odd_rows] = table.num_rows + np.arange(len(odd_rows))
        for c, j in take.items():
            extra = pa.array([rec[j] if j < len(rec) else None for rec in recs], pa.string())
            columns[c] = pa.concat_arrays([columns[c], extra]).take(pa.array(order))
    return Table(header, header_line, first_lines[rows], columns, row_errors, duplicates)


def _too_many(fields: int, header_line: int, width: int) -> str:
    return f"{fields} fields, but the header (line {header_line}) names {width}"


def _read_csv_python(p: Path, text: str, delimiter: str, wanted: list[str]) -> Table:
    """The standard library's csv reader, record by record: slow, but exact for any file."""
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter)
    rows, prev = [], 0
    try:
        for rec in reader:
            start, prev = prev + 1, reader.line_num
            if rec and not (len(rec) == 1 and not rec[0].strip()):
                rows.append((start, rec))
    except csv.Error as e:
        raise TraceError(str(p), prev + 1, ROW, f"malformed CSV: {e}") from None
    if not rows:
        raise TraceError(str(p), 1, "<header>", "the file is empty: expected a header line naming the columns")
    header_line, header = rows[0]
    header = [h.strip() for h in header]
    records = [rec for _, rec in rows[1:]]
    row_errors = {k: _too_many(len(rec), header_line, len(header)) for k, rec in enumerate(records)
                  if len(rec) > len(header)}
    index, duplicates = _header_index(header)
    columns = {c: [r[index[c]] if index[c] < len(r) else None for r in records] for c in wanted if c in index}
    return Table(header, header_line, np.array([line for line, _ in rows[1:]], dtype=np.int64), columns, row_errors,
                 duplicates)


# ----------------------------------------------------------------------------- JSONL

def read_jsonl(p: Path, wanted: list[str], roles: dict[str, set[str]] | None = None) -> Table:
    """`roles`: column -> what it is read as (``number``, ``label``, ``hashes``; default number)."""
    data = read_bytes(p)
    fast = _read_jsonl_arrow(data, wanted, roles or {})
    return fast if fast is not None else _read_jsonl_python(data, wanted)


# the column types whose Python values are exactly json.loads': pyarrow promotes a column of
# ints and floats to double, which for a label or a hash list would change the verdict
_JSON_TYPES = {"number": {"int64", "double", "string", "null"}, "label": {"int64", "string", "null"},
               "hashes": {"list<item: int64>", "list<item: null>", "null"}}
_WHITESPACE = np.zeros(256, dtype=bool)
_WHITESPACE[list(b" \t\n\r\x0b\x0c")] = True  # what bytes.strip() strips


def _read_jsonl_arrow(data: bytes, wanted: list[str], roles: dict[str, set[str]]) -> Table | None:
    """pyarrow.json's parse, or None where a row must be judged on its own (not JSON, not an
    object, a key twice, a column mixing types) and the line-by-line reader takes over.

    A number column mixing ints and floats is read as floats (the same values); its cells
    are quoted from their lines (`JsonNumbers`).
    """
    b = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(b == 10)
    starts = np.concatenate([[0], newlines + 1])
    if len(b) and b[-1] == 10:
        starts = starts[:-1]  # no line after the final newline
    full = np.flatnonzero(starts < np.append(newlines, len(b))[:len(starts)])  # lines with any byte
    nonblank = np.zeros(len(starts), dtype=bool)
    if len(full):  # a segment runs to the next such line's start: only whitespace lies in between
        nonblank[full] = np.logical_or.reduceat(~_WHITESPACE[b], starts[full])
    try:
        table = pj.read_json(pa.py_buffer(data))
    except (pa.ArrowInvalid, ValueError):
        return None
    rows = np.flatnonzero(nonblank)
    if table.num_rows != len(rows):
        return None
    columns: dict[str, Cells] = {}
    for c in dict.fromkeys(wanted):
        if c in table.schema.names:
            arr = table.column(c).combine_chunks()
            if not all(str(arr.type) in _JSON_TYPES[role] for role in roles.get(c, {"number"})):
                return None
            ends = np.append(newlines, len(b))
            columns[c] = JsonNumbers(arr, c, data, starts[rows], ends[rows]) if pa.types.is_floating(arr.type) else arr
    return Table(table.schema.names, 1, (rows + 1).astype(np.int64), columns, fixed_columns=False)


def _read_jsonl_python(data: bytes, wanted: list[str]) -> Table:
    lines, records, row_errors = [], [], {}
    for lineno, text in enumerate(io.BytesIO(data), 1):
        if not text.strip():
            continue
        k = len(records)
        lines.append(lineno)
        try:
            obj = json.loads(text)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            records.append({})
            row_errors[k] = f"invalid JSON: {getattr(e, 'msg', e)}" + (
                f" (column {e.colno})" if isinstance(e, json.JSONDecodeError) else "")
            continue
        if not isinstance(obj, dict):
            records.append({})
            row_errors[k] = f"expected a JSON object, got {type(obj).__name__}"
            continue
        records.append(obj)
    header = list(dict.fromkeys(k for r in records for k in r))
    columns = {c: [r.get(c) for r in records] for c in wanted}  # a key no row has: all None
    return Table(header, 1, np.array(lines, dtype=np.int64), columns, row_errors, fixed_columns=False)


# ----------------------------------------------------------------------------- Parquet

def read_parquet(p: Path, wanted: list[str]) -> Table:
    try:
        f = pq.ParquetFile(p)
        header = f.schema_arrow.names
        index, duplicates = _header_index(header)
        present = [c for c in dict.fromkeys(wanted) if c in index and c not in duplicates]
        table = f.read(columns=present)
    except (OSError, pa.ArrowException) as e:
        raise TraceError(str(p), 1, ROW, f"not a readable Parquet file: {e}") from None
    columns = {c: _plain(table.column(c).combine_chunks()) for c in present}
    return Table(header, 1, np.arange(1, table.num_rows + 1, dtype=np.int64), columns, {}, duplicates)


def _plain(arr: pa.Array) -> pa.Array:
    """Dictionary-encoded and large/view string columns as plain ones, so one code path reads them."""
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    if pa.types.is_large_string(arr.type) or pa.types.is_string_view(arr.type):
        arr = arr.cast(pa.string())
    return arr
