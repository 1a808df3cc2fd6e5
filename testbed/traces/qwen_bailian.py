"""The Qwen-Bailian usage traces (Alibaba Cloud Bailian, KVCache@ATC'25): multi-turn sessions.

Source: github.com/alibaba-edu/qwen-bailian-usagetraces-anon, README.md ("Data Specification of
the Traces"), Apache-2.0; files such as ``qwen_coder_blksz_16.jsonl`` (130 MB, Git LFS, so
nothing is bundled: give its path). One JSON object a line::

    {"chat_id": 159, "parent_chat_id": 55, "timestamp": 61.114, "input_length": 521,
     "output_length": 132, "type": "text", "turn": 2, "hash_ids": [1089, 1090, ...]}

``timestamp`` is seconds since the trace's start, ``parent_chat_id`` is -1 for a session's
first turn, ``hash_ids`` are salted SipHash ids of 16-token prompt blocks remapped to integers.
Mapping: a row's request id is its data-row index (as every loader's); ``chat_id`` ->
`Request.source` keeps the line, the parent's chat id -> `parent_id` (the parent's request id),
the session's root chat id -> `session_id`, ``hash_ids`` -> `prefix_hashes` with
`prefix_block_tokens` = 16; the turn's prefix ids follow `testbed.traces.sessions`' rule.
``type`` and ``turn`` are not used. The trace records no think time (`think_time` stays -1).
"""
from __future__ import annotations

import os

from testbed.traces.errors import TraceError
from testbed.traces.loaders import TraceLoad, _load, resolve_path
from testbed.traces.readers import pylist, read_jsonl
from testbed.traces.sessions import link_sessions

COLUMNS = {"arrival": "timestamp", "prompt_len": "input_length", "output_len": "output_length",
           "prefix_hashes": "hash_ids"}
BLOCK_TOKENS = 16
ROOT_PARENT = -1


def load_qwen_bailian(path: str | os.PathLike, *, lenient: bool = False) -> TraceLoad:
    """A Qwen-Bailian trace (JSONL, optionally .gz/.zst): requests linked into sessions."""
    load = _load(path, "jsonl", COLUMNS, "s", lenient, block_tokens=BLOCK_TOKENS)
    p = resolve_path(path)
    table = read_jsonl(p, ["chat_id", "parent_chat_id"], {"chat_id": {"label"}, "parent_chat_id": {"label"}})
    if table.rows != load.rows:  # both readers skip the same blank lines
        raise AssertionError(f"{p}: {table.rows} rows of chat ids for {load.rows} trace rows")
    lines = table.lines
    problems: dict[int, tuple[str, str]] = {}
    chat_ids = pylist(table.cells("chat_id")) if table.has("chat_id") else [None] * table.rows
    parents = pylist(table.cells("parent_chat_id")) if table.has("parent_chat_id") else [None] * table.rows
    for col, vals in (("chat_id", chat_ids), ("parent_chat_id", parents)):
        for i, v in enumerate(vals):
            if i not in problems and (type(v) is not int or (col == "chat_id" and v < 0)):
                what = "missing value" if v is None else f"expected {'an integer >= 0' if col == 'chat_id' else 'an integer (-1: none)'}, got {v!r}"
                problems[i] = (col, what)
    loaded_bad = {r.id for r in load.rejected}
    problems = {i: v for i, v in problems.items() if i not in loaded_bad}  # one problem a row: the loader's first
    if problems and not lenient:
        i = min(problems)
        raise TraceError(str(p), int(lines[i]), *problems[i])
    requests, rejected = link_sessions(load.requests, chat_ids, parents, str(p), lines, lenient=lenient,
                                       block_tokens=BLOCK_TOKENS, rejected_rows=load.rejected,
                                       root_parent=ROOT_PARENT, problems=problems)
    all_rejected = sorted([*load.rejected, *rejected], key=lambda r: r.id)
    return TraceLoad(requests, all_rejected, load.path, load.rows)
