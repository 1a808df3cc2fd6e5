"""Multi-turn sessions: link each turn to its parent, and name the blocks a turn shares with it.

A later turn's prompt is its parent's prompt, the parent's answer, then the new user message
(the Qwen-Bailian traces' own description: alibaba-edu/qwen-bailian-usagetraces-anon,
docs/qa-context-growth-pattern.md). So its leading blocks hold the parent's whole sequence, and
a server with a prefix cache serves them from the parent's KV: vLLM caches every full block of a
request, generated tokens included, under a key chained over all tokens before it
(`KVCacheManager.allocate_slots` -> `cache_blocks`, vllm/v1/core/kv_cache_manager.py), so a
turn that arrives while the parent's blocks are still cached recomputes only its new tokens.

The prefix rule (content ids per `block` tokens, as `Request.prefix_hashes`):

* the parent's **sequence ids** are its prompt ids followed by ids for its answer's blocks;
  the first `floor(min(turn prompt, parent prompt + output) / block)` ids of the turn are the
  parent's sequence ids (those blocks hold nothing but the parent's tokens);
* a turn whose trace gives **no ids** takes the parent's sequence ids for those shared blocks
  and fresh ids of its own (negative, so they never meet a trace's) for the rest of its prompt
  and its answer; a session root without ids gets fresh ids for its whole sequence;
* a turn whose trace **gives ids** keeps them (they already share the parent's prompt blocks);
  its parent's answer blocks take the ids that the parent's first child (in file order) has at
  those positions, when that child's ids start with the parent's full prompt blocks: the trace
  says those tokens follow the parent's prompt, and only the parent can have produced them.
  (A reasoning model's ``<think>`` markers are stripped from the next turn's context, so there
  the real cache hits less than this assumes.)

A request that is some turn's parent carries its sequence ids, marked `hashes_span_output`:
`testbed.core.kv.prefix_block_keys` then keys the answer's full blocks too.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from testbed.core.request import Request
from testbed.traces.errors import RejectedRow, TraceError

_FRESH_STRIDE = 1 << 24  # blocks per request in the fresh-id space (2**24 blocks: far beyond any context)


def fresh_id(rid: int, block: int) -> int:
    """A content id no trace uses (negative) for block `block` of request `rid`'s own tokens."""
    return -1 - (rid * _FRESH_STRIDE + block)


def link_sessions(requests: Sequence[Request], chat_ids: Sequence, parent_ids: Sequence, where: str,
                  lines: Sequence[int], *, lenient: bool = False, block_tokens: int = 16,
                  rejected_rows: Sequence[RejectedRow] = (), root_parent=-1,
                  problems: dict[int, tuple[str, str]] | None = None) -> tuple[list[Request], list[RejectedRow]]:
    """The requests with `session_id` (the root turn's chat id), `parent_id` (the parent's request
    id) and the prefix ids of the rule above; and the rows set aside.

    `chat_ids[i]` / `parent_ids[i]` are data row i's chat id and its parent's (`root_parent`: none),
    `lines[i]` its line; `requests` are the rows the loader kept (id = data row index) and
    `rejected_rows` those it set aside. Bad links, each a `TraceError` (strict) or a rejected row
    (lenient): a chat id given twice, a parent that no row has, a parent that comes later in the
    file than its turn (a turn before its parent), a cycle of parents, and (lenient) a turn whose
    parent was itself rejected. `problems`: rows already found bad (row -> (field, reason)), such as
    an id that is not an integer; they take part in no link.
    """
    name = where.rsplit("/", 1)[-1]
    n = len(chat_ids)
    row_of: dict = {}
    problems = dict(problems or {})
    for i, c in enumerate(chat_ids):
        if i in problems:
            continue
        if c in row_of:
            problems.setdefault(i, ("chat_id", f"chat_id {c!r} also on line {lines[row_of[c]]}"))
        else:
            row_of[c] = i
    parent_row = [-1] * n
    for i, p in enumerate(parent_ids):
        if i in problems or p == root_parent:
            continue
        j = row_of.get(p)
        if j is None:
            problems[i] = ("parent_chat_id", f"parent_chat_id {p!r} names no chat_id in the file")
        elif j >= i:
            cycle = _cycle(i, parent_ids, row_of, root_parent)
            if cycle:
                problems[i] = ("parent_chat_id", "a cycle of parents: " + " -> ".join(repr(chat_ids[k]) for k in cycle))
            else:
                problems[i] = ("parent_chat_id", f"the turn comes before its parent (chat_id {p!r} on line {lines[j]})")
        else:
            parent_row[i] = j
    if problems and not lenient:
        i = min(problems)
        fld, reason = problems[i]
        raise TraceError(where, int(lines[i]), fld, reason)
    # a turn whose parent is gone (rejected by the loader or here) goes too, in file order
    gone = set(problems) | {r.id for r in rejected_rows}
    for i in range(n):
        j = parent_row[i]
        if j >= 0 and j in gone and i not in gone:
            problems[i] = ("parent_chat_id", f"its parent (chat_id {parent_ids[i]!r} on line {lines[j]}) was rejected")
            gone.add(i)
    by_id = {r.id: r for r in requests}
    kept = [r for r in requests if r.id not in problems]
    rejected = [RejectedRow(i, name, int(lines[i]), fld, reason, by_id[i].arrival)
                for i, (fld, reason) in sorted(problems.items()) if i in by_id]  # the loader's own are reported
    return derive_prefixes(kept, parent_row, chat_ids, root_of(parent_row), block_tokens), rejected


def _cycle(i: int, parent_ids: Sequence, row_of: dict, root_parent) -> list[int]:
    """The rows of a cycle of parents through row i (empty if the chain from i ends)."""
    seen, k = [], i
    while True:
        seen.append(k)
        p = parent_ids[k]
        if p == root_parent or p not in row_of:
            return []
        k = row_of[p]
        if k == i:
            return seen + [i]
        if k in seen or len(seen) > len(parent_ids):
            return []


def root_of(parent_row: Sequence[int]) -> list[int]:
    """Each row's session root (parents come before their turns, so one pass in order)."""
    root = list(range(len(parent_row)))
    for i, j in enumerate(parent_row):
        if j >= 0:
            root[i] = root[j]
    return root


def derive_prefixes(requests: list[Request], parent_row: Sequence[int], chat_ids: Sequence, root: Sequence[int],
                    block: int) -> list[Request]:
    """Set session, parent and prefix ids by the module's rule (requests in file order, id = row)."""
    by_id = {r.id: r for r in requests}
    first_child: dict[int, Request] = {}
    for r in requests:
        j = parent_row[r.id]
        if j >= 0 and j in by_id:
            first_child.setdefault(j, r)
    in_session = {r.id for r in requests if parent_row[r.id] >= 0 and parent_row[r.id] in by_id} | set(first_child)
    seq: dict[int, tuple[int, ...]] = {}  # request id -> its sequence ids (prompt then output), parents only
    out = []
    for r in requests:
        if r.id not in in_session:
            out.append(r)
            continue
        j = parent_row[r.id]
        parent = by_id.get(j)
        ids = r.prefix_hashes
        derived = not ids
        if derived:  # the parent's sequence blocks, then fresh ids of its own over its prompt and answer
            shared = seq.get(j, ())[:min(r.prompt_len, parent.total_len) // block] if parent is not None else ()
            ids = shared + tuple(fresh_id(r.id, b) for b in range(len(shared), -(-r.total_len // block)))
        child = first_child.get(r.id)
        own = None if child is None else ids if derived else _sequence_ids(r, ids, child, block)
        if own is not None:
            seq[r.id] = ids = own
        else:
            ids = ids[:-(-r.prompt_len // block)]
        out.append(dataclasses.replace(r, prefix_hashes=ids, parent_id=j if parent is not None else -1,
                                       session_id=r.session_id or str(chat_ids[root[r.id]]),
                                       hashes_span_output=own is not None))
    return out


def _sequence_ids(r: Request, ids: tuple[int, ...], child: Request, block: int) -> tuple[int, ...] | None:
    """A parent's trace ids (its prompt's) extended over its answer, or None where the trace says
    nothing of it: the answer's blocks take the first child's ids when the child's prompt starts
    with this prompt's full blocks, fresh ids when the child has no ids (it derives its own from these)."""
    prompt_blocks = r.prompt_len // block
    c = child.prefix_hashes
    if not c:
        return ids[:prompt_blocks] + tuple(fresh_id(r.id, b) for b in range(prompt_blocks, -(-r.total_len // block)))
    if c[:prompt_blocks] != ids[:prompt_blocks]:
        return None  # the child's prompt does not start with this prompt
    return c[:min(r.total_len, child.prompt_len) // block]
