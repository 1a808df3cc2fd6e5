"""Published production trace formats by name: Azure 2024 and multimodal 2025, BurstGPT, length-only sets.

Why a module of its own: each public trace has quirks (units, time zones, failure rows,
size) that a hand-written column mapping gets silently wrong; here each is read by name,
with its quirks handled once and cited to the trace's own documentation. Sources:

* **Azure LLM inference 2024** (Azure/AzurePublicDataset, ``AzureLLMInferenceDataset2024.md``;
  DynamoLLM, Stojkovic et al., arXiv 2408.00741; CC-BY-4.0): week-long CSVs
  ``TIMESTAMP,ContextTokens,GeneratedTokens``, the time with a UTC offset
  (``2024-05-10 00:00:00.014+00:00``) and without a fractional part when it is zero
  (``2024-05-10 00:00:01+00:00``), tens of millions of rows. Read in bounded memory
  (`load_azure_2024`, below).
* **Azure multimodal 2025** (same repository, ``AzureLMMInferenceDataset2025.md``; ModServe,
  Qiu et al., SoCC 2025; CC-BY-4.0): ``TIMESTAMP`` (ISO 8601, ms and ``Z``), ``NumImages``,
  ``ContextTokens``, ``GeneratedTokens``. The notes say their replay "send[s] the input
  prompt with the required number of tokens and images": they do not say that the image
  tokens are inside ContextTokens. The testbed's prompt is ContextTokens; NumImages is
  checked (a whole number >= 0) but not carried (a Request has no image field), so image
  tokens count only as far as ContextTokens holds them, and no vision encoder is modelled.
* **BurstGPT** (HPMLL/BurstGPT, ``README.md`` "Schema"; Wang et al., arXiv 2401.17644; its README
  states no licence): ``Timestamp`` ("seconds from 0:00:00 on the first day", so the first request arrives at
  its own time of day, kept: the replay starts at the first row, as every trace here),
  ``Model`` (ChatGPT or GPT-4: the request's tenant), ``Request tokens``, ``Response
  tokens``, ``Total tokens`` (not read), ``Log Type`` (Conversation log or API log); later
  releases add ``Session ID`` (the README announces it as ``SessionID``: either name is read;
  -> ``Request.session_id``) and ``Elapsed time`` (not read).
  A failed request is logged with 0 response tokens: such a row is always rejected with
  the reason "failed request", strict mode included, so it shows up in the results as
  rejected, never dropped. `row_filter` keeps the rows of one Model and/or Log Type.
* **Length-only sets** (microsoft/vidur, ``data/processed_traces/*.csv``: ShareGPT,
  LMSYS-Chat-1M, arXiv summarisation, BWB): ``num_prefill_tokens,num_decode_tokens,...``,
  no times: lengths for the Poisson / Gamma generators (``trace.lengths_format=vidur``).

Nothing here is bundled: these files are the user's own download.
"""
from __future__ import annotations

import gc
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from testbed.core.request import Request
from testbed.traces.errors import RejectedRow, TraceError
from testbed.traces.loaders import (_DATETIME_CORE, _DATETIME_HELP, BEYOND_MAX_ARRIVAL, MAX_ARRIVAL_S, TraceLoad,
                                    _check_number, _datetimes_ns, _is_missing, _load, _Problems, resolve_path)
from testbed.traces.readers import (_BOM, ROW, Table, _read_csv_arrow, _read_csv_python, compression, read_csv,
                                    value)

AZURE_2024_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
AZURE_MM_2025_COLUMNS = ("TIMESTAMP", "NumImages", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = {"arrival": "Timestamp", "prompt_len": "Request tokens", "output_len": "Response tokens",
                    "tenant": "Model"}
BURSTGPT_FILTERS = ("Model", "Log Type")
BURSTGPT_FAILED = "failed request: 0 response tokens (BurstGPT logs a failed request so)"
VIDUR_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")
# Where each named format comes from: said when a preset is used without the user's file.
SOURCES = {
    "azure_2024": "Azure/AzurePublicDataset, AzureLLMInferenceDataset2024.md (AzureLLMInferenceTrace_code_1week.csv "
                  "or _conv_1week.csv)",
    "azure_multimodal_2025": "Azure/AzurePublicDataset, AzureLMMInferenceDataset2025.md "
                             "(AzureLMMInferenceTrace_multimodal.csv.gz)",
    "burstgpt": "HPMLL/BurstGPT, its releases (BurstGPT_1.csv, BurstGPT_2.csv, ...)",
    "vidur": "microsoft/vidur, data/processed_traces/ (sharegpt, lmsys_chat_1m, arxiv_summarization, bwb "
             "*_stats_llama2_tokenizer*.csv)",
}
CHUNK_BYTES = 16 << 20  # bytes of CSV parsed at a time by the streaming loader
# a time the fast path reads: ISO date and time with an offset (Z or +HH:MM / +HHMM)
_ZONED = rf"^{_DATETIME_CORE}(?:Z|[+-](?:[01]\d|2[0-3]):?[0-5]\d)$"


def missing_path(fmt: str, key: str = "trace.path") -> str:
    """The error for a preset run without the user's file: nothing of these formats is bundled."""
    where = SOURCES.get(fmt)
    if where is None:
        return f"{key} is required"
    return (f"{key} is required: the {fmt} format's files are not bundled (nothing can be downloaded here); "
            f"give the path of your copy, from {where}")


# ----------------------------------------------------------------------------- streaming CSV

def _csv_chunks(p: Path, chunk_bytes: int) -> Iterator[tuple[bytes, bytes, int]]:
    """(header record, whole records, file line of the first) pieces of a CSV, each about
    `chunk_bytes` long, decompressed as read: only one piece is held at a time."""
    codec = compression(p)
    try:
        stream = pa.input_stream(str(p), compression=codec)
    except (OSError, pa.ArrowInvalid) as e:
        raise TraceError(str(p), 1, ROW, f"cannot open it{' as ' + codec if codec else ''}: {e}") from None
    with stream as f:
        buf, header, line, eof = b"", None, 1, False
        while not eof:
            try:
                block = f.read(chunk_bytes)
            except (OSError, pa.ArrowInvalid) as e:
                raise TraceError(str(p), line, ROW, f"cannot decompress it as {codec}: {e}") from None
            eof = not block
            data = buf + block
            if header is None:
                if data.startswith(_BOM):
                    data = data[len(_BOM):]
                while True:  # the header is the first line that is not blank
                    nl = data.find(b"\n")
                    if nl < 0 and not eof:
                        break
                    first = data if nl < 0 else data[:nl + 1]
                    if first.strip():
                        header, data = first if first.endswith(b"\n") else first + b"\n", data[len(first):]
                        line += 1
                        break
                    if nl < 0:
                        break
                    data, line = data[nl + 1:], line + 1
                if header is None:
                    if eof:
                        raise TraceError(str(p), 1, "<header>",
                                         "the file is empty: expected a header line naming the columns")
                    buf = data
                    continue
            cut = len(data) if eof else _last_record_end(data)
            if cut <= 0:
                buf = data
                continue
            body, buf = data[:cut], data[cut:]
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceError(str(p), line + body[:e.start].count(b"\n"), ROW,
                                 f"not UTF-8 text ({e.reason})") from None
            yield header, body, line
            line += body.count(b"\n")


def _csv_header(p: Path) -> list[str]:
    """A CSV's column names, from its first non-blank line alone ([] for a file without data rows)."""
    import csv

    for header, _, _ in _csv_chunks(p, 1 << 16):
        return [c.strip() for c in next(csv.reader([header.decode("utf-8")]))]
    return []


def _last_record_end(data: bytes) -> int:
    """Just past the last newline that ends a record (not one inside a quoted field); 0 if none."""
    if b'"' not in data:
        return data.rfind(b"\n") + 1
    b = np.frombuffer(data, dtype=np.uint8)
    newlines = np.flatnonzero(b == 10)
    quotes = np.flatnonzero(b == 34)
    ending = newlines[np.searchsorted(quotes, newlines) % 2 == 0]
    return int(ending[-1]) + 1 if len(ending) else 0


def _parse_chunk(p: Path, header: bytes, body: bytes, first_line: int, wanted: list[str]) -> Table:
    data = header + body
    table = _read_csv_arrow(p, data, ",", wanted)
    if table is None:
        table = _read_csv_python(p, data.decode("utf-8"), ",", wanted)
    table.lines = table.lines - 2 + first_line  # the header is line 1 of `data`, the body's first line is line 2
    table.header_line = first_line - 1
    return table


def _zoned_ns(raw: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact UTC nanoseconds, a parsed mask and an offset-given mask; pyarrow parses the
    cells that match the zoned pattern, the loaders' exact row-by-row parser the rest."""
    n = len(raw)
    fast = pc.match_substring_regex(raw, _ZONED).fill_null(False).to_numpy(zero_copy_only=False)
    ns, ok, aware = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    idx = np.flatnonzero(fast)
    if len(idx):
        try:
            cells = raw if len(idx) == n else raw.take(pa.array(idx))
            ns[idx] = pc.cast(cells, pa.timestamp("ns", "UTC")).cast(pa.int64()).to_numpy(zero_copy_only=False)
            ok[idx] = aware[idx] = True
        except pa.ArrowInvalid:  # an out-of-range field (month 13): the exact parser finds which
            fast[:] = False
    rest = np.flatnonzero(~fast)
    if len(rest):
        ns[rest], ok[rest], aware[rest] = _datetimes_ns(raw.take(pa.array(rest)))
    return ns, ok, aware


# ----------------------------------------------------------------------------- Azure 2024 / multimodal 2025

@dataclass
class _Stream:
    """What the streaming load carries from one chunk to the next."""

    start: float
    end: float
    limit: float  # max_requests, or inf
    t0: int | None = None  # the first valid time, ns
    run_max: int | None = None  # the latest valid time so far, with its cell and line
    run_text: str = ""
    run_line: int = 0
    requests: list = field(default_factory=list)
    rejected: list = field(default_factory=list)
    pending: list = field(default_factory=list)  # untimed rejects after the last request before `start`
    after_full: list = field(default_factory=list)  # rejects after the max_requests-th request
    full: bool = False
    done: bool = False


def load_azure_2024(path: str | os.PathLike, *, lenient: bool = False, start_s: float | None = None,
                    end_s: float | None = None, max_requests: int | None = None, multimodal: bool = False,
                    chunk_bytes: int = CHUNK_BYTES) -> TraceLoad:
    """An Azure LLM inference trace 2024 (or, `multimodal`, the LMM trace 2025), streamed.

    Times are converted to UTC (the offset each cell carries is applied; a cell without one
    is an error), exact to the nanosecond, and arrivals are seconds since the file's first
    valid time, as `load_azure`'s. Fractional and whole-second cells may mix in a column.

    Bounded memory: the file is read `chunk_bytes` at a time (decompressed as read); each
    piece is parsed by pyarrow, checked vectorised, and only its rows inside the selection
    (`start_s` <= arrival < `end_s`, then the first `max_requests`: trace.start_s/end_s/
    max_requests) become `Request`s or `RejectedRow`s. Peak memory is O(chunk) plus
    O(selected rows), independent of the rows outside the selection; reading stops at the
    first request at or past `end_s` (or once `max_requests` are kept and the next request
    is known). The arrivals keep the file's origin (the caller's `time_window` re-bases
    them, as for any trace), and the rejected rows kept are exactly those
    `transforms.rejected_in_selection` would keep, so a windowed run reports the same as
    loading the whole file and then selecting. `TraceLoad.rows` counts the rows in the
    selection. Strict mode raises on the first bad row read (rows past where reading
    stopped are not read).
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes!r}: must be >= 1")
    p = resolve_path(path)
    wanted = list(AZURE_MM_2025_COLUMNS if multimodal else AZURE_2024_COLUMNS)
    st = _Stream(0.0 if start_s is None else float(start_s), math.inf if end_s is None else float(end_s),
                 math.inf if max_requests is None else int(max_requests))
    enabled = gc.isenabled()
    gc.disable()  # as loaders._load: the Requests made are kept; the cyclic GC's passes are pure cost
    try:
        row_base = 0
        for header, body, first_line in _csv_chunks(p, chunk_bytes):
            table = _parse_chunk(p, header, body, first_line, wanted)
            if row_base == 0:
                _check_header(p, table, wanted)
            _stream_chunk(p, table, row_base, st, lenient)
            row_base += table.rows
            if st.done:
                break
        st.rejected.extend(st.pending)
        st.rejected.extend(st.after_full)
    finally:
        if enabled:
            gc.enable()
        pa.default_memory_pool().release_unused()
    st.rejected.sort(key=lambda r: r.id)
    return TraceLoad(st.requests, st.rejected, str(p), len(st.requests) + len(st.rejected))


def load_azure_multimodal_2025(path: str | os.PathLike, **kwargs) -> TraceLoad:
    """The Azure LMM (multimodal) inference trace 2025: `load_azure_2024` with NumImages checked."""
    return load_azure_2024(path, multimodal=True, **kwargs)


def _check_header(p: Path, table: Table, wanted: list[str]) -> None:
    for col in wanted:
        if col in table.duplicates:
            raise TraceError(str(p), table.header_line, col, "the column appears more than once in the header")
        if not table.has(col):
            present = ", ".join(repr(c) for c in table.header) or "none"
            raise TraceError(str(p), table.header_line, col, f"no column {col!r} in the file; columns present: "
                                                             f"{present}")


def _stream_chunk(p: Path, table: Table, row_base: int, st: _Stream, lenient: bool) -> None:
    n = table.rows
    if n == 0:
        return
    lines = table.lines
    probs, row_err = _Problems.of_table(table)
    raw = table.cells("TIMESTAMP")
    raw = raw if isinstance(raw, pa.Array) else pa.array(raw, pa.string())
    ns, ok, aware = _zoned_ns(raw)
    missing = np.zeros(n, dtype=bool)
    for i in np.flatnonzero(~ok):
        missing[i] = _is_missing(value(raw, i))
    probs.add(missing, "TIMESTAMP", lambda i: "missing value")
    probs.add(~ok, "TIMESTAMP", lambda i: f"unparseable time {value(raw, i)!r} ({_DATETIME_HELP})")
    probs.add(ok & ~aware, "TIMESTAMP", lambda i: f"no UTC offset in {value(raw, i)!r}: this trace writes one on "
                                                  f"every time (+00:00 or Z), and a time without one is ambiguous (the 2023 "
                                                  f"trace has none: trace.format=azure)")
    valid = ok & aware & ~row_err
    # time order, against the latest valid time before (in this chunk or an earlier one)
    idx = np.flatnonzero(valid)
    if len(idx):
        tv = ns[idx]
        carry = st.run_max if st.run_max is not None else tv[0]
        run = np.maximum.accumulate(np.concatenate([[carry], tv]))
        back = tv < run[:-1]
        if back.any():
            holder = np.maximum.accumulate(np.where(np.concatenate([[True], ~back]), np.arange(len(idx) + 1), 0))
            refs = {}
            for k in np.flatnonzero(back).tolist():
                h = int(holder[k])  # position in [carry, *tv] of the running max before row k
                refs[int(idx[k])] = ((st.run_text, st.run_line) if h == 0 else
                                     (value(raw, int(idx[h - 1])), int(lines[idx[h - 1]])))
            mask = np.zeros(n, dtype=bool)
            mask[idx[back]] = True
            probs.add(mask, "TIMESTAMP", lambda i: f"time goes backwards: {value(raw, i)!r} is earlier than "
                                                   f"{refs[i][0]!r} on line {refs[i][1]}")
            valid[idx[back]] = False
        idx = np.flatnonzero(valid)
    if len(idx):
        if st.t0 is None:
            st.t0 = int(ns[idx[0]])
        last = int(idx[-1])
        if st.run_max is None or ns[last] >= st.run_max:
            st.run_max, st.run_text, st.run_line = int(ns[last]), value(raw, last), int(lines[last])
    arrival = np.zeros(n)
    if st.t0 is not None:
        arrival = (ns - st.t0) / 1e9
        far = valid & (arrival >= MAX_ARRIVAL_S)
        probs.add(far, "TIMESTAMP", lambda i: f"time {value(raw, i)!r} is too large: {arrival[i]:.3g} s after the "
                                              f"first arrival is {BEYOND_MAX_ARRIVAL}")
        valid &= ~far
    prompt = _check_number(probs, table.cells("ContextTokens"), "ContextTokens", "a prompt", 1)
    output = _check_number(probs, table.cells("GeneratedTokens"), "GeneratedTokens",
                           "the output (a request generates at least one token)", 1)
    if "NumImages" in table.columns:
        _check_number(probs, table.cells("NumImages"), "NumImages", "", 0)
    bad = probs.bad
    good = np.flatnonzero(~bad)  # request rows: valid times, in order, so their arrivals never decrease
    ga = arrival[good]
    name = p.name
    stop_k = int(np.searchsorted(ga, st.end, side="left"))  # the first request at or past `end`
    limit = int(good[stop_k]) if stop_k < len(good) else n  # rows from `limit` on are not read
    nth = -1  # rejects after this row lie after the max_requests-th request
    if st.full:  # the max_requests-th request came before this chunk; the next one decides
        if len(good):
            limit = int(good[0])
            st.done = True
            if ga[0] < st.end:  # more requests in the window: the cut applies, nothing after it counts
                st.after_full.clear()
                _raise_first(p, probs, bad, lines, limit, lenient)
                return
    else:
        window = good[(ga >= st.start) & (ga < st.end)]
        room = int(min(st.limit - len(st.requests), len(window) + 1))  # >= 1
        take = window[:room]
        if len(window) >= room:  # the max_requests-th request is in this chunk
            nth = int(take[-1])
            if len(window) > room:  # the cut applies: stop right after the last request taken
                limit, st.done = nth + 1, True
            else:
                st.full = True
        ids = (take + row_base).tolist()
        st.requests.extend(Request(i, a, pl, ol, (), 512, "default", 0, "default", f"{name}:{ln}")
                           for i, a, pl, ol, ln in zip(ids, arrival[take].tolist(), prompt[take].tolist(),
                                                       output[take].tolist(), lines[take].tolist()))
    if limit < n:
        st.done = True
    _raise_first(p, probs, bad, lines, limit, lenient)
    before = good[ga < st.start]
    last_before = int(before[-1]) if len(before) else -1
    if last_before >= 0:  # a request before the window: the untimed rejects before it lie outside
        st.pending.clear()
    for i in np.flatnonzero(bad[:limit]).tolist():
        timed = bool(valid[i])
        if not (st.start <= arrival[i] < st.end if timed else i > last_before):
            continue
        fld, reason = probs.describe(i)
        row = RejectedRow(i + row_base, name, int(lines[i]), fld, reason, float(arrival[i]) if timed else None)
        if st.full and i > nth:
            st.after_full.append(row)  # counts only if no request of the window follows
        elif timed:
            st.rejected.append(row)
        else:
            st.pending.append(row)


def _raise_first(p: Path, probs: _Problems, bad: np.ndarray, lines: np.ndarray, limit: int, lenient: bool) -> None:
    if lenient:
        return
    idx = np.flatnonzero(bad[:limit])
    if len(idx):
        i = int(idx[0])
        fld, reason = probs.describe(i)
        raise TraceError(str(p), int(lines[i]), fld, reason)


# ----------------------------------------------------------------------------- BurstGPT

def load_burstgpt(path: str | os.PathLike, *, lenient: bool = False,
                  row_filter: Mapping[str, str] | None = None) -> TraceLoad:
    """A BurstGPT trace (CSV, or those columns in Parquet): see the module's notes.

    ``Timestamp`` is in seconds; ``Model`` becomes the tenant; ``Session ID``, when the
    release has it, the session. Rows with 0 response tokens are rejected as failed
    requests (in strict mode too: they are the trace's record of failures, not damage).
    `row_filter` ({"Model": "GPT-4"}, {"Log Type": "Conversation log"}) keeps only the rows
    with those values; the others are outside the selection, as rows outside a time window
    (neither requests nor rejected).
    """
    p = resolve_path(path)
    filters = dict(row_filter or {})
    for k, v in filters.items():
        if k not in BURSTGPT_FILTERS:
            raise ValueError(f"trace.row_filter.{k}: BurstGPT rows can be kept by {', '.join(BURSTGPT_FILTERS)} only")
        if not isinstance(v, str) or not v:
            raise ValueError(f"trace.row_filter.{k}: expected the value to keep (e.g. 'GPT-4'), got {v!r}")
    cols = dict(BURSTGPT_COLUMNS)
    parquet = p.suffix.lower() in (".parquet", ".pq")
    if parquet:
        import pyarrow.parquet as pq
        header = pq.ParquetFile(p).schema_arrow.names
    else:
        header = _csv_header(p)
    for name in ("Session ID", "SessionID"):
        if name in header:
            cols["session_id"] = name
            break
    load = _load(p, "csv", cols, "s", lenient, failed_output=BURSTGPT_FAILED)
    if not filters:
        return load
    table = None if parquet else read_csv(p, ",", list(filters))
    if table is None:
        import pyarrow.parquet as pq
        t = pq.read_table(p, columns=list(filters))
        cells = {k: t.column(k).to_pylist() for k in filters}
    else:
        for k in filters:
            if not table.has(k):
                raise TraceError(str(p), table.header_line, k, f"no column {k!r} to filter on (trace.row_filter)")
        cells = {k: [v.strip() if isinstance(v, str) else v for v in
                     (table.cells(k).to_pylist() if isinstance(table.cells(k), pa.Array) else table.cells(k))]
                 for k in filters}
    keep = np.ones(load.rows, dtype=bool)
    for k, v in filters.items():
        keep &= np.array([c == v for c in cells[k]], dtype=bool)
    if load.rows and not keep.any():  # say what the file holds, not that it has no rows
        held = "; ".join(f"{k}: {', '.join(sorted({str(c) for c in cells[k]})[:10])}" for k in filters)
        raise ValueError(f"trace.row_filter={dict(filters)} keeps none of the {load.rows} rows of {p} "
                         f"(the values there: {held})")
    reqs = [r for r in load.requests if keep[r.id]]
    rej = [r for r in load.rejected if keep[r.id]]
    return TraceLoad(reqs, rej, load.path, len(reqs) + len(rej))


# ----------------------------------------------------------------------------- length-only sets

def load_vidur_lengths(path: str | os.PathLike) -> TraceLoad:
    """A length-only set as Vidur's processed traces write it: ``num_prefill_tokens`` (the
    prompt) and ``num_decode_tokens`` (the output), other columns ignored; no times, so every
    request "arrives" at 0: for `trace.lengths_from` (the generators draw pairs), never a replay.
    Strict: the first malformed row stops the load with its file, line and field."""
    p = resolve_path(path)
    table = read_csv(p, ",", list(VIDUR_COLUMNS))
    for col in VIDUR_COLUMNS:
        if not table.has(col):
            present = ", ".join(repr(c) for c in table.header) or "none"
            raise TraceError(str(p), table.header_line, col, f"no column {col!r} in the file; columns present: "
                                                             f"{present}")
    n = table.rows
    if n == 0:
        return TraceLoad([], [], str(p), 0)
    probs, _ = _Problems.of_table(table)
    prompt = _check_number(probs, table.cells("num_prefill_tokens"), "num_prefill_tokens", "a prompt", 1)
    output = _check_number(probs, table.cells("num_decode_tokens"), "num_decode_tokens",
                           "the output (a request generates at least one token)", 1)
    bad = np.flatnonzero(probs.bad)
    if len(bad):
        i = int(bad[0])
        fld, reason = probs.describe(i)
        raise TraceError(str(p), int(table.lines[i]), fld, reason)
    name = p.name
    return TraceLoad([Request(i, 0.0, pl, ol, source=f"{name}:{ln}") for i, pl, ol, ln in
                      zip(range(n), prompt.tolist(), output.tolist(), table.lines.tolist())], [], str(p), n)
