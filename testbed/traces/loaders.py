"""Trace files -> `Request` records: Azure CSV, Mooncake JSONL, any CSV/JSONL/Parquet by mapping.

Reading a container (CSV, JSONL, Parquet, gzip/zstd) is `testbed.traces.readers`' job; this
module judges the cells and builds the requests.

Why it is built this way:

* **Every data row is accounted for.** A row becomes a `Request` or, under
  `lenient=True`, a `RejectedRow` naming its line, field and reason; in strict mode (the
  default) the first bad row in file order stops the load with a `TraceError` naming the
  file, the line and the field. Nothing is dropped silently, so
  ``len(requests) + len(rejected) == rows`` always. (Blank lines are not rows.)
* **Ids are data-row indices** (0 for the first data row, in file order), and a rejected
  row keeps its index, so the ids of the kept requests do not depend on which other rows
  were rejected, and a result always joins back to its line (`Request.source` is
  ``"<file name>:<line>"``).
* **Line numbers are what an editor shows**: 1-based, the CSV header is line 1, a quoted
  CSV field spanning lines is reported at the line its record starts on; a compressed
  file's lines are those of its content. A Parquet row's "line" is its 1-based row number.
* **Times are exact.** Azure timestamps carry 7 fractional digits (100 ns), more than
  Python's `datetime` keeps; they are parsed to integer nanoseconds (numpy
  ``datetime64[ns]``, after a strict pattern check) and only the difference from the
  first row is turned into float seconds. Numeric times are re-based in their own unit
  before dividing (``(t - t0) / 1000`` for ms), which keeps them exact to the float.
* **Arrival 0 is the first valid timestamp in the file** (the first row's, in strict
  mode). In lenient mode a row rejected for, say, a zero length still fixes the time
  origin and still takes part in the time-order check, so rejecting it shifts no other
  request; a row whose own time is bad or goes backwards does neither.
* **Order is part of a trace.** A time earlier than the latest accepted time before it
  is an error ("goes backwards"), never re-sorted.
* **One problem per row.** A row is reported once, for its first problem in this order:
  the row itself (not JSON, too many CSV fields), arrival, time order, prompt length,
  output length, prefix hashes, tenant, priority, SLO class, session id.
* **Fast by construction**: pyarrow parses the file, only the mapped columns, and the checks
  are vectorised (numpy, pyarrow.compute); the per-row Python work is building the
  `Request`s. Error messages are made only for bad rows. A million-row Azure CSV loads in
  about 4 s, most of it making the million `Request`s, and its peak memory is about that
  of the requests it returns (``experiments/benchmarks/trace_load.py``).
* **Times that float64 seconds cannot hold are rejected** (see `MAX_ARRIVAL_S`).
"""
from __future__ import annotations

import gc
import json
import math
import os
import re
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from testbed.core.request import Request
from testbed.traces.errors import RejectedRow, TraceError
from testbed.traces.readers import (COMPRESSIONS, ROW, Cells, pylist, read_csv, read_jsonl, read_parquet, unwrap,
                                    value)

DATA_DIR = Path(__file__).resolve().parent / "data"
TABLE_FORMATS = ("csv", "jsonl", "parquet")  # read through a column mapping
# published formats read by name in testbed.traces.formats (vidur: lengths only, for trace.lengths_from)
NAMED_FORMATS = ("azure_2024", "azure_multimodal_2025", "burstgpt", "vidur")
FORMATS = ("azure", "mooncake", *TABLE_FORMATS, "qwen_bailian", *NAMED_FORMATS)
FIXED_FORMATS = ("azure", "mooncake", "qwen_bailian")  # schemas fixed by their publishers
# time_unit -> divisor to seconds; "datetime" (ISO-8601 strings) is handled apart
TIME_UNITS = {"s": 1, "ms": 1_000, "us": 1_000_000}
FIELDS = ("arrival", "prompt_len", "output_len", "prefix_hashes", "tenant", "priority", "slo_class", "session_id")
REQUIRED = ("arrival", "prompt_len", "output_len")
AZURE_COLUMNS = {"arrival": "TIMESTAMP", "prompt_len": "ContextTokens", "output_len": "GeneratedTokens"}
MOONCAKE_COLUMNS = {"arrival": "timestamp", "prompt_len": "input_length", "output_len": "output_length",
                    "prefix_hashes": "hash_ids"}
MOONCAKE_BLOCK_TOKENS = 512
PARQUET_SUFFIXES = (".parquet", ".pq")
# Arrival times, as the simulator keeps them (float64 seconds), must stay below 2**32 s
# (136 years): there a float64's spacing is 2**-20 s (0.95 us), beyond it a microsecond is
# lost (at 1e18 s the spacing is 128 s and every TTFT reads 0.0 ms). Epoch times in s, ms or
# us (1.7e9 s) stay well inside; only their differences from the first arrival are replayed.
MAX_ARRIVAL_S = 2.0**32
BEYOND_MAX_ARRIVAL = "past 2**32 s (136 years), where float64 seconds lose sub-microsecond precision"
_MAX_LEN = 2**40  # lengths beyond this are surely a broken file, and would overflow int64 arithmetic


@dataclass
class TraceLoad:
    """What a loader read: the requests, the rows it set aside, and how many rows it read.

    `rows` is the number of data rows (blank lines excluded) and always equals
    ``len(requests) + len(rejected)``; `path` is the file actually read.
    """

    requests: list[Request]
    rejected: list[RejectedRow] = field(default_factory=list)
    path: str = ""
    rows: int = -1

    def __post_init__(self):
        if self.rows < 0:
            self.rows = len(self.requests) + len(self.rejected)
        if self.rows != len(self.requests) + len(self.rejected):
            raise ValueError(f"TraceLoad: {self.rows} rows but {len(self.requests)} requests + "
                             f"{len(self.rejected)} rejected")


# ----------------------------------------------------------------------------- paths

def bundled_traces() -> list[str]:
    """The trace files shipped in `traces/data/`, as paths relative to it."""
    return sorted(p.relative_to(DATA_DIR).as_posix() for p in DATA_DIR.rglob("*")
                  if p.is_file() and p.suffix in (".csv", ".jsonl")
                  and not p.parent.name.startswith("servegen"))  # ServeGen folders hold distributions, not requests


def _not_found(path: Any) -> FileNotFoundError:
    return FileNotFoundError(f"trace file {str(path)!r} not found, neither relative to the current directory "
                             f"({Path.cwd()}) nor among the bundled traces in {DATA_DIR}: "
                             f"{', '.join(bundled_traces())}")


def bundled_path(name: str | os.PathLike) -> Path:
    """The path of a bundled trace, e.g. ``bundled_path("azure_llm_2023/AzureLLMInferenceTrace_conv.csv")``."""
    p = DATA_DIR / name
    if not p.is_file():
        raise _not_found(name)
    return p


def resolve_path(path: str | os.PathLike) -> Path:
    """`path` as given if it is a file; else, for a relative path, the bundled trace of that name.

    This lets a config say ``azure_llm_2023/AzureLLMInferenceTrace_conv.csv`` and work from
    any directory, while a user's own file of the same relative name still wins.
    """
    p = Path(path).expanduser()
    if p.is_file():
        return p
    if p.exists():
        raise FileNotFoundError(f"trace path {str(path)!r} is a directory, not a trace file")
    if not p.is_absolute() and (DATA_DIR / p).is_file():
        return DATA_DIR / p
    raise _not_found(path)


def trace_stem_path(path: str | os.PathLike) -> str:
    """The file's name without a compression suffix (``day1.csv.gz`` -> ``day1.csv``)."""
    name = Path(path).name
    suffix = Path(name).suffix
    return name[:-len(suffix)] if suffix.lower() in COMPRESSIONS else name


def trace_stem(path: str | os.PathLike) -> str:
    """A trace file's name without its folder, compression and format suffixes
    (``/data/day1.csv.gz`` -> ``day1``): what a run replaying it is called."""
    name = trace_stem_path(path)
    return Path(name).stem or name


# ----------------------------------------------------------------------------- public loaders

def load_azure(path: str | os.PathLike, *, lenient: bool = False) -> TraceLoad:
    """An Azure LLM inference trace (2023): CSV ``TIMESTAMP,ContextTokens,GeneratedTokens``,
    TIMESTAMP like ``2023-11-16 18:15:46.6805900`` (no timezone); or those columns in Parquet."""
    return _load(path, "csv", AZURE_COLUMNS, "datetime", lenient)


def load_mooncake(path: str | os.PathLike, *, lenient: bool = False) -> TraceLoad:
    """A Mooncake (FAST'25) trace: JSON lines with ``timestamp`` (ms), ``input_length``,
    ``output_length`` and ``hash_ids`` (one id per 512-token prompt block); or those columns in Parquet."""
    return _load(path, "jsonl", MOONCAKE_COLUMNS, "ms", lenient, block_tokens=MOONCAKE_BLOCK_TOKENS)


def load_table(path: str | os.PathLike, *, columns: Mapping[str, str], time_unit: str = "s",
               format: str | None = None, lenient: bool = False, delimiter: str = ",",
               prefix_block_tokens: int = 512) -> TraceLoad:
    """Any CSV, JSONL or Parquet trace through a mapping ``{field: column}``.

    Fields: ``arrival``, ``prompt_len``, ``output_len`` (required), ``prefix_hashes``,
    ``tenant``, ``priority``, ``slo_class`` (optional; a mapped column must have a value
    on every row), ``session_id`` (optional; text or an integer, an empty cell is no session). `time_unit` is ``s``, ``ms`` or ``us`` for numbers, or ``datetime``
    for ISO-8601 strings (``YYYY-MM-DD HH:MM:SS[.fffffffff]``, ``T`` or a space between,
    an optional ``Z`` / ``+HH:MM`` offset, converted to UTC) or a Parquet timestamp column.
    `format` is ``csv``, ``jsonl`` or ``parquet``; by default it follows the extension
    (``.jsonl``/``.ndjson``/``.json`` -> jsonl, ``.csv``/``.tsv`` -> csv, ``.tsv`` with a
    tab delimiter, ``.parquet``/``.pq`` -> parquet), after a compression suffix (``.gz``,
    ``.zst``, ``.zstd``: the file is decompressed as it is read). A ``.parquet`` file is
    read as Parquet whatever `format` says. Prefix hashes are a JSON list of integers (in
    a CSV cell: ``[1, 2]`` or ``1 2`` / ``1;2``; an empty cell is no hashes; in Parquet a
    list column), one per `prefix_block_tokens` prompt tokens.
    """
    fmt = format
    if fmt is None:
        suffix = Path(trace_stem_path(path)).suffix.lower()
        if suffix in (".jsonl", ".ndjson", ".json"):
            fmt = "jsonl"
        elif suffix in (".csv", ".tsv"):
            fmt = "csv"
            if suffix == ".tsv" and delimiter == ",":
                delimiter = "\t"
        elif suffix in PARQUET_SUFFIXES:
            fmt = "parquet"
        else:
            raise ValueError(f"load_table: cannot tell the format of {str(path)!r} from its extension; "
                             f"pass format='csv', 'jsonl' or 'parquet'")
    if fmt not in TABLE_FORMATS:
        raise ValueError(f"load_table: format={fmt!r}: expected 'csv', 'jsonl' or 'parquet'")
    return _load(path, fmt, columns, time_unit, lenient, delimiter=delimiter, block_tokens=prefix_block_tokens)


# ----------------------------------------------------------------------------- validation

class _Problems:
    """The first problem of each row, found column by column with vectorised checks."""

    def __init__(self, n: int):
        self.first = np.full(n, -1, dtype=np.int32)
        self.kinds: list[tuple[str, Callable[[int], str]]] = []

    def add(self, mask: np.ndarray, fld: str, reason: Callable[[int], str]) -> None:
        new = mask & (self.first < 0)
        if new.any():
            self.first[new] = len(self.kinds)
        self.kinds.append((fld, reason))

    @property
    def bad(self) -> np.ndarray:
        return self.first >= 0

    def describe(self, i: int) -> tuple[str, str]:
        fld, reason = self.kinds[self.first[i]]
        return fld, reason(i)

    @classmethod
    def of_table(cls, table) -> tuple["_Problems", np.ndarray]:
        """A table's problems seeded with its row-level ones (a field too many or too few), and the
        mask of those rows, which the column checks then skip."""
        probs = cls(table.rows)
        row_err = np.zeros(table.rows, dtype=bool)
        if table.row_errors:
            row_err[list(table.row_errors)] = True
        probs.add(row_err, ROW, lambda i: table.row_errors[i])
        return probs, row_err


def _is_missing(v) -> bool:
    return v is None or (type(v) is str and not v.strip())


def _to_float(v) -> float:
    t = type(v)
    if t is int or t is float:
        return float(v)
    if t is str:
        try:
            return float(v)
        except ValueError:
            return math.nan
    return math.nan  # None, bool, list, dict: not a number


# a decimal number as pyarrow and Python's float() both read it (to the same, correctly rounded float)
_PLAIN_NUMBER = r"^[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?$"


def _numbers(vals: Cells) -> np.ndarray:
    """Cells as float64; NaN where a cell is not a number (missing, text, bool, list).

    Text is read as Python's float() reads it; pyarrow parses the plain decimals (nearly
    every cell), Python the rest (blanks, padding, words), which are few.
    """
    vals = unwrap(vals)
    if isinstance(vals, pa.Array):
        t = vals.type
        if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
            return pc.cast(vals, pa.float64(), safe=False).fill_null(math.nan).to_numpy(zero_copy_only=False)
        if pa.types.is_string(t):
            plain = pc.match_substring_regex(vals, _PLAIN_NUMBER).fill_null(False).to_numpy(zero_copy_only=False)
            if plain.all():
                return pc.cast(vals, pa.float64()).to_numpy(zero_copy_only=False)
            out = np.full(len(vals), math.nan)
            idx = np.flatnonzero(plain)
            out[idx] = pc.cast(vals.take(idx), pa.float64()).to_numpy(zero_copy_only=False)
            for i in np.flatnonzero(~plain).tolist():
                out[i] = _to_float(vals[i].as_py())
            return out
        vals = vals.to_pylist()
    types = set(map(type, vals))
    if types <= {str} or types <= {int, float}:
        try:
            return np.array(vals, dtype=np.float64)
        except (ValueError, TypeError, OverflowError):
            pass
    return np.fromiter(map(_to_float, vals), dtype=np.float64, count=len(vals))


def _check_number(probs: _Problems, raw: Cells, col: str, what: str, minimum: int | None) -> np.ndarray:
    """Whole numbers >= `minimum` (None: any sign); returns int64 values (0 where bad)."""
    f = _numbers(raw)
    nan = np.isnan(f)
    if nan.any():
        missing = np.zeros(len(f), dtype=bool)
        for i in np.flatnonzero(nan):
            missing[i] = _is_missing(value(raw, i))
        probs.add(missing, col, lambda i: "missing value")
        probs.add(nan & ~missing, col, lambda i: f"not a number: {value(raw, i)!r}")
    finite = np.isfinite(f)
    probs.add(~nan & ~finite, col, lambda i: f"not a finite number: {value(raw, i)!r}")
    g = np.where(finite, f, 0.0)
    probs.add(g != np.floor(g), col, lambda i: f"not a whole number: {value(raw, i)!r}")
    if minimum is not None:
        probs.add(g < 0, col, lambda i: f"negative length {value(raw, i)!r}")
        if minimum > 0:
            probs.add(g < minimum, col, lambda i: f"{what} must be at least {minimum}, got {value(raw, i)!r}")
    probs.add(np.abs(g) >= _MAX_LEN, col, lambda i: f"implausibly large value {value(raw, i)!r}")
    return np.where(np.abs(g) < _MAX_LEN, g, 0.0).astype(np.int64)


# ISO-8601 date and time (T or space), 1..9 fractional digits, optional Z / +HH:MM offset.
# Years 1700..2259 keep nanoseconds since 1970 inside int64 (numpy would wrap silently).
_DATETIME_CORE = r"(?:1[7-9]\d\d|2[01]\d\d|22[0-5]\d)-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:\.\d{1,9})?"
_DATETIME = re.compile(rf"\s*({_DATETIME_CORE})(Z|[+-](?:[01]\d|2[0-3]):?[0-5]\d)?\s*")  # offsets as ISO 8601: < 24 h
_DATETIMES_PLAIN = re.compile(rf"(?:{_DATETIME_CORE}\n)*{_DATETIME_CORE}")  # a whole column, no offsets
_DATETIME_HELP = "expected YYYY-MM-DD HH:MM:SS[.fffffffff], optionally with a Z or +HH:MM offset"


def _datetimes_ns(raw: Cells) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact integer nanoseconds (UTC where an offset is given), a valid mask, an offset-given mask."""
    n = len(raw)
    raw = unwrap(raw)
    if isinstance(raw, pa.Array):
        if pa.types.is_timestamp(raw.type):  # Parquet's own timestamps: exact, UTC when zoned
            try:
                ns = pc.cast(raw, pa.timestamp("ns", raw.type.tz)).cast(pa.int64()).fill_null(0)
                return (ns.to_numpy(zero_copy_only=False), raw.is_valid().to_numpy(zero_copy_only=False),
                        np.full(n, raw.type.tz is not None))
            except pa.ArrowInvalid:  # beyond int64 nanoseconds
                pass
        elif (pa.types.is_string(raw.type) and not raw.null_count
              and pc.all(pc.match_substring_regex(raw, f"^{_DATETIME_CORE}$")).as_py()):
            try:  # fast path: pyarrow parses ISO strings exactly to ns, as numpy does
                return (pc.cast(raw, pa.timestamp("ns")).cast(pa.int64()).to_numpy(zero_copy_only=False),
                        np.ones(n, dtype=bool), np.zeros(n, dtype=bool))
            except pa.ArrowInvalid:
                pass  # an out-of-range field somewhere (month 13, hour 25): find it row by row
        raw = raw.to_pylist()
    if n and set(map(type, raw)) == {str} and _DATETIMES_PLAIN.fullmatch("\n".join(raw)):
        try:  # fast path, one regex call for the column: numpy parses ISO strings exactly to ns
            return (np.array(raw, dtype="datetime64[ns]").astype(np.int64), np.ones(n, dtype=bool),
                    np.zeros(n, dtype=bool))
        except ValueError:
            pass  # an out-of-range field somewhere (month 13, hour 25): find it row by row
    matches = [_DATETIME.fullmatch(v) if type(v) is str else None for v in raw]
    ok = np.fromiter((m is not None for m in matches), dtype=bool, count=n)
    aware = np.fromiter((m is not None and m.group(2) is not None for m in matches), dtype=bool, count=n)
    ns = np.zeros(n, dtype=np.int64)
    idx = np.flatnonzero(ok)
    try:  # numpy parses ISO strings exactly to ns (7 fractional digits included)
        ns[idx] = np.array([matches[i].group(1) for i in idx], dtype="datetime64[ns]").astype(np.int64)
    except ValueError:  # an out-of-range field somewhere (month 13, hour 25): find it row by row
        for i in idx:
            try:
                ns[i] = np.datetime64(matches[i].group(1), "ns").astype(np.int64)
            except ValueError:
                ok[i] = False
    for i in np.flatnonzero(ok & aware):
        tz = matches[i].group(2)
        if tz != "Z":
            sign = -1 if tz[0] == "-" else 1
            ns[i] -= sign * (int(tz[1:3]) * 3600 + int(tz[-2:]) * 60) * 1_000_000_000
    return ns, ok, aware


def _check_times(probs: _Problems, raw: Cells, col: str, time_unit: str, lines: list[int],
                 row_err: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Parsed times (int64 ns or float in the file's unit) and the mask of rows whose time counts."""
    n = len(raw)
    if time_unit == "datetime":
        t, ok, aware = _datetimes_ns(raw)
    else:
        t = _numbers(raw)
        ok = np.isfinite(t)
    missing = np.zeros(n, dtype=bool)
    for i in np.flatnonzero(~ok):
        missing[i] = _is_missing(value(raw, i))
    probs.add(missing, col, lambda i: "missing value")
    if time_unit == "datetime":
        probs.add(~ok, col, lambda i: f"unparseable time {value(raw, i)!r} ({_DATETIME_HELP})")
        valid = ok & ~missing & ~row_err
        if valid.any():  # naive and offset times cannot be ordered against each other
            first = int(np.flatnonzero(valid)[0])
            mixed = valid & (aware != aware[first])
            probs.add(mixed, col, lambda i: f"mixes times with and without a timezone offset ({value(raw, i)!r}; "
                                            f"line {lines[first]} has {value(raw, first)!r})")
            valid &= ~mixed
    else:
        probs.add(~ok, col, lambda i: f"unparseable or non-finite time {value(raw, i)!r}")
        huge = ok & (np.abs(t) >= MAX_ARRIVAL_S * TIME_UNITS[time_unit])
        probs.add(huge, col, lambda i: f"time {value(raw, i)!r} is too large: "
                                       f"{abs(t[i]) / TIME_UNITS[time_unit]:.3g} s is {BEYOND_MAX_ARRIVAL}")
        valid = ok & ~huge & ~missing & ~row_err
    # time order against the latest valid time before (rows rejected for other fields count:
    # their time is still the file's; rows whose own time is bad or backwards do not)
    idx = np.flatnonzero(valid)
    if len(idx) > 1:
        tv = t[idx]
        run_max = np.maximum.accumulate(tv)
        back = np.zeros(len(idx), dtype=bool)
        back[1:] = tv[1:] < run_max[:-1]
        if back.any():
            pos = np.arange(len(idx))
            holder = np.maximum.accumulate(np.where(~back, pos, 0))  # position of the running max
            ref = {int(idx[k]): int(idx[holder[k - 1]]) for k in np.flatnonzero(back)}
            mask = np.zeros(n, dtype=bool)
            mask[idx[back]] = True
            probs.add(mask, col, lambda i: f"time goes backwards: {value(raw, i)!r} is earlier than "
                                           f"{value(raw, ref[i])!r} on line {lines[ref[i]]}")
            valid[idx[back]] = False
    # what the replay will see, the time since the first valid arrival, must be representable
    idx = np.flatnonzero(valid)
    if len(idx):
        first = int(idx[0])
        since = (t[idx].astype(np.float64) - float(t[first])) / (1e9 if time_unit == "datetime" else
                                                                  TIME_UNITS[time_unit])
        far = since >= MAX_ARRIVAL_S
        if far.any():
            after = dict(zip(idx[far].tolist(), since[far].tolist()))
            mask = np.zeros(n, dtype=bool)
            mask[idx[far]] = True
            probs.add(mask, col, lambda i: f"time {value(raw, i)!r} is too large: {after[i]:.3g} s after the first "
                                           f"arrival ({value(raw, first)!r} on line {lines[first]}) is "
                                           f"{BEYOND_MAX_ARRIVAL}")
            valid[idx[far]] = False
    return t, valid


def _parse_hashes(v) -> tuple[int, ...] | str:
    """A tuple of ints, or the reason it is not one."""
    if type(v) is str:
        s = v.strip()
        if not s:
            return ()
        if s.startswith("["):
            try:
                v = json.loads(s)
            except ValueError:
                return f"not a JSON list of integers: {v!r}"
        else:
            try:
                return tuple(int(x) for x in re.split(r"[\s;,]+", s))
            except ValueError:
                return f"not a list of integers: {v!r}"
    if type(v) is not list:
        return f"expected a list of integers, got {v!r}"
    if not set(map(type, v)) <= {int}:
        return f"expected a list of integers, got {[x for x in v if type(x) is not int][:3]!r} in it"
    return tuple(v)


def _check_labels(probs: _Problems, raw: Cells, col: str) -> list[str]:
    raw = pylist(raw)
    out, bad = [], np.zeros(len(raw), dtype=bool)
    for i, v in enumerate(raw):
        if type(v) is str and v.strip():
            out.append(v.strip())
        elif type(v) is int:
            out.append(str(v))
        else:
            out.append("")
            bad[i] = True
    probs.add(bad, col, lambda i: "missing value" if _is_missing(raw[i]) else f"expected a text label, got {raw[i]!r}")
    return out


def _check_sessions(probs: _Problems, raw: Cells, col: str) -> list[str]:
    """Session ids as text ("" where the cell is empty: a request of no session)."""
    raw = pylist(raw)
    out, bad = [], np.zeros(len(raw), dtype=bool)
    for i, v in enumerate(raw):
        if type(v) is str or type(v) is int:
            out.append(str(v).strip())
        else:
            out.append("")
            bad[i] = v is not None
    probs.add(bad, col, lambda i: f"expected a session id (text or an integer), got {raw[i]!r}")
    return out


# ----------------------------------------------------------------------------- the load

def _check_mapping(columns: Mapping[str, str], time_unit: str) -> dict[str, str]:
    if not isinstance(columns, Mapping):
        raise ValueError(f"trace.columns: expected a mapping of field -> column name, got {columns!r}")
    cols = dict(columns)
    unknown = [k for k in cols if k not in FIELDS]
    if unknown:
        raise ValueError(f"trace.columns: unknown field(s) {unknown}; mappable fields: {', '.join(FIELDS)}")
    missing = [k for k in REQUIRED if not cols.get(k)]
    if missing:
        raise ValueError(f"trace.columns: the mapping needs {', '.join(missing)} (fields: {', '.join(FIELDS)})")
    for k, v in cols.items():
        if not isinstance(v, str) or not v:
            raise ValueError(f"trace.columns.{k}: expected a column name, got {v!r}")
    if time_unit not in TIME_UNITS and time_unit != "datetime":
        raise ValueError(f"trace.time_unit={time_unit!r}: expected one of {', '.join([*TIME_UNITS, 'datetime'])}")
    return cols


def _roles(cols: dict[str, str]) -> dict[str, set[str]]:
    """Column -> how it is read (number, label, hashes): a JSON reader keeps its cells' types."""
    roles: dict[str, set[str]] = {}
    for key, col in cols.items():
        roles.setdefault(col, set()).add({"prefix_hashes": "hashes", "tenant": "label", "slo_class": "label",
                                          "session_id": "label"}.get(key, "number"))
    return roles


def _load(path, fmt: str, columns: Mapping[str, str], time_unit: str, lenient: bool, *,
          delimiter: str = ",", block_tokens: int = 512, failed_output: str | None = None) -> TraceLoad:
    # The load allocates ~10 objects a row and frees none of them until it returns: the cyclic
    # GC's passes over them are pure cost (a third of the time of a 20k-row load), so pause it.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _load_rows(path, fmt, columns, time_unit, lenient, delimiter, block_tokens, failed_output)
    finally:
        if enabled:
            gc.enable()
        pa.default_memory_pool().release_unused()  # pyarrow's allocator keeps what the parse freed (~60 MiB)


def _load_rows(path, fmt: str, columns: Mapping[str, str], time_unit: str, lenient: bool, delimiter: str,
               block_tokens: int, failed_output: str | None = None) -> TraceLoad:
    """`failed_output`: the reason for a row whose output is exactly 0, where a trace logs a
    failed request so (BurstGPT): such a row is rejected in strict mode too, never an error."""
    cols = _check_mapping(columns, time_unit)
    if isinstance(block_tokens, bool) or not (isinstance(block_tokens, Integral) and block_tokens >= 1):
        raise ValueError(f"prefix_block_tokens={block_tokens!r}: must be an integer >= 1")
    block_tokens = int(block_tokens)
    p = resolve_path(path)
    where, name = str(p), p.name
    wanted = list(dict.fromkeys(cols.values()))
    if fmt == "parquet" or p.suffix.lower() in PARQUET_SUFFIXES:
        raw = read_parquet(p, wanted)
    else:
        raw = read_csv(p, delimiter, wanted) if fmt == "csv" else read_jsonl(p, wanted, _roles(cols))
    n = raw.rows
    for key, col in cols.items():
        if col in raw.duplicates:
            raise TraceError(where, raw.header_line, col,
                             f"the column for {key!r} appears more than once in the header")
        if (raw.fixed_columns or n > len(raw.row_errors)) and not raw.has(col):
            present = ", ".join(repr(c) for c in raw.header) or "none"
            raise TraceError(where, raw.header_line, col,
                             f"no column {col!r} (mapped to {key!r}) in the file; columns present: {present}")
    if n == 0:
        return TraceLoad([], [], where, 0)

    lines = raw.lines
    probs, row_err = _Problems.of_table(raw)

    t, t_valid = _check_times(probs, raw.cells(cols["arrival"]), cols["arrival"], time_unit, lines, row_err)
    prompt = _check_number(probs, raw.cells(cols["prompt_len"]), cols["prompt_len"], "a prompt", 1)
    failed_kind = len(probs.kinds)
    if failed_output is not None:
        probs.add(_numbers(raw.cells(cols["output_len"])) == 0, cols["output_len"], lambda i: failed_output)
    output = _check_number(probs, raw.cells(cols["output_len"]), cols["output_len"],
                           "the output (a request generates at least one token)", 1)
    extra: dict[str, list] = {}
    if "prefix_hashes" in cols:
        col = cols["prefix_hashes"]
        parsed = [_parse_hashes(v) if v is not None else "missing value" for v in pylist(raw.cells(col))]
        kinds = np.fromiter((type(h) is str for h in parsed), dtype=bool, count=n)
        probs.add(kinds, col, lambda i: parsed[i])
        counts = np.fromiter((len(h) if type(h) is tuple else 0 for h in parsed), dtype=np.int64, count=n)
        blocks = -(-prompt // block_tokens)
        probs.add(counts > blocks, col, lambda i: f"{counts[i]} prefix blocks of {block_tokens} tokens, but the "
                                                  f"prompt's {prompt[i]} tokens fill at most {blocks[i]}")
        extra["prefix_hashes"] = [h if type(h) is tuple else () for h in parsed]
    if "tenant" in cols:
        extra["tenant"] = _check_labels(probs, raw.cells(cols["tenant"]), cols["tenant"])
    if "priority" in cols:
        extra["priority"] = _check_number(probs, raw.cells(cols["priority"]), cols["priority"], "", None).tolist()
    if "slo_class" in cols:
        extra["slo_class"] = _check_labels(probs, raw.cells(cols["slo_class"]), cols["slo_class"])
    if "session_id" in cols:
        extra["session_id"] = _check_sessions(probs, raw.cells(cols["session_id"]), cols["session_id"])

    bad = probs.bad
    bad_idx = np.flatnonzero(bad)
    errors = bad_idx if failed_output is None else np.flatnonzero(bad & (probs.first != failed_kind))
    if len(errors) and not lenient:
        i = int(errors[0])
        fld, reason = probs.describe(i)
        raise TraceError(where, int(lines[i]), fld, reason)
    # time origin: the first row whose time is valid (row 0 in strict mode)
    arrival = np.zeros(n, dtype=np.float64)
    if t_valid.any():
        t0 = t[np.flatnonzero(t_valid)[0]]
        if time_unit == "datetime":
            arrival = (t - t0) / 1e9
        else:
            arrival = (t - t0) / TIME_UNITS[time_unit]
    rejected = []
    for i in bad_idx.tolist():
        fld, reason = probs.describe(i)
        rejected.append(RejectedRow(i, name, int(lines[i]), fld, reason, float(arrival[i]) if t_valid[i] else None))
    keep = np.flatnonzero(~bad)
    ids = keep.tolist()
    args = [ids, arrival[keep].tolist(), prompt[keep].tolist(), output[keep].tolist()]
    line_arr = lines[keep].tolist()
    sources = [f"{name}:{ln}" for ln in line_arr]
    if not extra:
        requests = [Request(i, a, pl, ol, (), block_tokens, "default", 0, "default", s)
                    for i, a, pl, ol, s in zip(*args, sources)]
    else:
        def column(key, default):
            vals = extra.get(key)
            return [vals[i] for i in ids] if vals is not None else [default] * len(ids)
        requests = [Request(*fields_) for fields_ in zip(
            *args, column("prefix_hashes", ()), [block_tokens] * len(ids), column("tenant", "default"),
            column("priority", 0), column("slo_class", "default"), sources, column("session_id", ""))]
    return TraceLoad(requests, rejected, where, n)
