"""Trace files -> `Request` records: Azure CSV, Mooncake JSONL, any CSV/JSONL by mapping.

Every data row becomes a request or, under `lenient=True`, a `RejectedRow` with its
reason; in strict mode the first bad row stops the load with its file, line and field.
Request ids are the data-row index (0 for the first data row), so a rejected row keeps
its id and results can always be joined back to the file. Line numbers are 1-based as
an editor shows them (a CSV header is line 1).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from testbed.request import Request
from traces.errors import RejectedRow, TraceError

DATA_DIR = Path(__file__).resolve().parent / "data"
FORMATS = ("azure", "mooncake", "csv", "jsonl")
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
MAPPABLE = ("arrival", "prompt_len", "output_len", "prefix_hashes", "tenant", "priority", "slo_class")


@dataclass
class TraceLoad:
    requests: list[Request]
    rejected: list[RejectedRow] = field(default_factory=list)
    path: str = ""

    @property
    def rows(self) -> int:
        return len(self.requests) + len(self.rejected)


def bundled_traces() -> list[str]:
    return sorted(str(p.relative_to(DATA_DIR)) for p in DATA_DIR.rglob("*") if p.suffix in (".csv", ".jsonl"))


def resolve_path(path: str | Path) -> Path:
    """A path as given, or else relative to the bundled `traces/data/` folder."""
    p = Path(path).expanduser()
    if p.exists():
        return p
    if not p.is_absolute() and (DATA_DIR / p).exists():
        return DATA_DIR / p
    raise FileNotFoundError(f"trace file {str(path)!r} not found (relative to {Path.cwd()} or to the bundled "
                            f"traces in {DATA_DIR}: {', '.join(bundled_traces())})")


class _Rows:
    """Collects per-row validation outcomes for one file."""

    def __init__(self, file: str, lenient: bool):
        self.file, self.lenient = file, lenient
        self.rejected: list[RejectedRow] = []
        self.bad: set[int] = set()

    def reject(self, index: int, line: int, fld: str, reason: str) -> None:
        if index in self.bad:
            return
        if not self.lenient:
            raise TraceError(self.file, line, fld, reason)
        self.bad.add(index)
        self.rejected.append(RejectedRow(index, self.file, line, fld, reason))


def _check_lengths(rows: _Rows, values: list, lines: list[int], fld: str, minimum: int, what: str) -> np.ndarray:
    out = np.zeros(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        if i in rows.bad:
            continue
        if v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and not v.strip()):
            rows.reject(i, lines[i], fld, "missing value")
            continue
        try:
            f = float(v)
        except (TypeError, ValueError):
            rows.reject(i, lines[i], fld, f"not a number: {v!r}")
            continue
        if not math.isfinite(f) or f != int(f):
            rows.reject(i, lines[i], fld, f"not a whole number: {v!r}")
        elif f < 0:
            rows.reject(i, lines[i], fld, f"negative length {v!r}")
        elif f < minimum:
            rows.reject(i, lines[i], fld, f"{what} must be at least {minimum}, got {int(f)}")
        else:
            out[i] = int(f)
    return out


def _check_times(rows: _Rows, seconds: list, lines: list[int], fld: str, raw: list) -> np.ndarray:
    """Arrival times must be finite and never go backwards (order is part of a trace)."""
    out = np.zeros(len(seconds), dtype=np.float64)
    last = -math.inf
    for i, t in enumerate(seconds):
        if i in rows.bad and t is None:
            continue
        if t is None or not math.isfinite(t):
            rows.reject(i, lines[i], fld, f"unparseable or non-finite time {raw[i]!r}")
            continue
        if t < last:
            rows.reject(i, lines[i], fld, f"time goes backwards ({raw[i]!r} is before the previous row)")
            continue
        last = t
        out[i] = t
    return out


def _build(rows: _Rows, n: int, arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray, name: str,
           lines: list[int], extra: dict | None = None) -> TraceLoad:
    good = [i for i in range(n) if i not in rows.bad]
    t0 = arrival[good[0]] if good else 0.0
    extra = extra or {}
    reqs = []
    for i in good:
        kw = {k: v[i] for k, v in extra.items() if v is not None}
        reqs.append(Request(id=i, arrival=float(arrival[i] - t0), prompt_len=int(prompt[i]),
                            output_len=int(output[i]), source=f"{name}:{lines[i]}", **kw))
    rows.rejected.sort(key=lambda r: r.id)
    return TraceLoad(reqs, rows.rejected)


def _parse_datetimes(values: list) -> list:
    """Exact seconds from 'YYYY-MM-DD HH:MM:SS.fffffff' strings (7 fractional digits: ns precision)."""
    parsed = pd.to_datetime(pd.Series(values, dtype="object"), errors="coerce", format="mixed")
    ns = parsed.to_numpy(dtype="datetime64[ns]").astype("int64")
    nat = parsed.isna().to_numpy()
    base = int(ns[~nat][0]) if (~nat).any() else 0
    return [None if bad else (int(x) - base) / 1e9 for x, bad in zip(ns, nat)]


def load_azure(path: str | Path, *, lenient: bool = False) -> TraceLoad:
    return _load_table(path, "csv", {"arrival": "TIMESTAMP", "prompt_len": "ContextTokens",
                                     "output_len": "GeneratedTokens"}, "datetime", lenient)


def load_mooncake(path: str | Path, *, lenient: bool = False) -> TraceLoad:
    return _load_table(path, "jsonl", {"arrival": "timestamp", "prompt_len": "input_length",
                                       "output_len": "output_length", "prefix_hashes": "hash_ids"}, "ms", lenient)


def load_table(path: str | Path, *, columns: dict[str, str], time_unit: str = "s", format: str | None = None,
               lenient: bool = False) -> TraceLoad:
    """Any CSV or JSONL trace through a mapping {field: column}; fields: arrival, prompt_len,
    output_len (required), prefix_hashes, tenant, priority, slo_class (optional)."""
    fmt = format or ("jsonl" if str(path).endswith((".jsonl", ".json")) else "csv")
    return _load_table(path, fmt, columns, time_unit, lenient)


def load_trace(path: str | Path, format: str, *, columns: dict[str, str] | None = None, time_unit: str = "s",
               lenient: bool = False) -> TraceLoad:
    if format == "azure":
        return load_azure(path, lenient=lenient)
    if format == "mooncake":
        return load_mooncake(path, lenient=lenient)
    if format in ("csv", "jsonl"):
        if not columns:
            raise ValueError(f"trace.format={format}: give trace.columns, a mapping of arrival, prompt_len and "
                             f"output_len to the file's column names")
        return load_table(path, columns=columns, time_unit=time_unit, format=format, lenient=lenient)
    raise ValueError(f"trace.format={format!r}: expected one of {FORMATS}")


def _read_rows(p: Path, fmt: str, rows: _Rows) -> tuple[pd.DataFrame, list[int]]:
    if fmt == "csv":
        df = pd.read_csv(p, dtype=str, keep_default_na=False, skip_blank_lines=True)
        return df, list(range(2, len(df) + 2))
    if fmt != "jsonl":
        raise ValueError(f"format {fmt!r}: expected csv or jsonl")
    records, lines = [], []
    with p.open() as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
                if not isinstance(obj, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                index = len(records)
                records.append({})
                lines.append(lineno)
                rows.reject(index, lineno, "<row>", f"invalid JSON: {e}")
                continue
            records.append(obj)
            lines.append(lineno)
    return pd.DataFrame.from_records(records) if records else pd.DataFrame(), lines


def _load_table(path, fmt: str, columns: dict[str, str], time_unit: str, lenient: bool) -> TraceLoad:
    p = resolve_path(path)
    name = p.name
    for key in columns:
        if key not in MAPPABLE:
            raise ValueError(f"trace.columns: unknown field {key!r}; mappable fields: {MAPPABLE}")
    for key in ("arrival", "prompt_len", "output_len"):
        if key not in columns:
            raise ValueError(f"trace.columns: the mapping needs {key!r} (fields: {MAPPABLE})")
    if time_unit not in TIME_UNITS and time_unit != "datetime":
        raise ValueError(f"trace.time_unit={time_unit!r}: expected one of {[*TIME_UNITS, 'datetime']}")
    rows = _Rows(name, lenient)
    df, lines = _read_rows(p, fmt, rows)
    n = len(df)
    for key, col in columns.items():
        if n and col not in df.columns:
            raise TraceError(name, 1, col, f"column for {key!r} is not in the file; columns present: {list(df.columns)}")

    def column(key):
        if key not in columns or not n:
            return [None] * n
        return df[columns[key]].tolist()

    raw_t = column("arrival")
    if time_unit == "datetime":
        secs = _parse_datetimes(raw_t)
    else:
        secs = [_num(v) * TIME_UNITS[time_unit] if _num(v) is not None else None for v in raw_t]
    for i, v in enumerate(raw_t):  # name missing cells as such before time checks
        if v is None or (isinstance(v, float) and math.isnan(v)) or (isinstance(v, str) and not v.strip()):
            rows.reject(i, lines[i], columns["arrival"], "missing value")
    prompt = _check_lengths(rows, column("prompt_len"), lines, columns["prompt_len"], 1, "a prompt")
    output = _check_lengths(rows, column("output_len"), lines, columns["output_len"], 1,
                            "an output (a request generates at least one token)")
    arrival = _check_times(rows, [None if i in rows.bad else t for i, t in enumerate(secs)], lines,
                           columns["arrival"], raw_t)
    extra = {}
    if "prefix_hashes" in columns:
        hashes = []
        for i, h in enumerate(column("prefix_hashes")):
            if isinstance(h, str):
                try:
                    h = json.loads(h)
                except ValueError:
                    h = None
            if not isinstance(h, list) or not all(isinstance(x, int) for x in h):
                if i not in rows.bad:
                    rows.reject(i, lines[i], columns["prefix_hashes"], f"expected a list of integers, got {h!r}")
                hashes.append(())
            else:
                hashes.append(tuple(h))
        extra["prefix_hashes"] = hashes
    for key, conv in (("tenant", str), ("slo_class", str), ("priority", int)):
        if key in columns:
            vals = []
            for i, v in enumerate(column(key)):
                try:
                    vals.append(conv(v))
                except (TypeError, ValueError):
                    if i not in rows.bad:
                        rows.reject(i, lines[i], columns[key], f"expected {conv.__name__}, got {v!r}")
                    vals.append(conv())
            extra[key] = vals
    load = _build(rows, n, arrival, prompt, output, name, lines, extra)
    load.path = str(p)
    return load


def _num(v):
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if not math.isnan(f) else None
