"""Multi-turn sessions: the Qwen-Bailian loader, the prefix rule of later turns, open and closed replay.

The fixtures are Qwen-Bailian-format files written here (the published schema:
alibaba-edu/qwen-bailian-usagetraces-anon README.md): each session's later turns extend the
earlier turn's prompt and answer, as the trace's documentation says.
"""
from __future__ import annotations

import json
import random

import pytest
from hydra import compose, initialize_config_dir
from hypothesis import given, settings, strategies as st

from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.run import simulate
from testbed.app.assembly.validate import ConfigError, check_config
from testbed.core.kv import prefix_block_keys
from testbed.core.request import Request
from testbed.traces import TraceError, load_trace
from testbed.traces.sessions import derive_prefixes, root_of

BLOCK = 16


def session_rows(n_sessions=10, turns=4, hashes=True, strip=False, seed=0, gap=20.0, spacing=1.5):
    """Rows of a Qwen-Bailian file: turn k's prompt = turn k-1's prompt + answer + a new message.
    `hashes`: trace hash ids (turn k's ids start with the ids of turn k-1's full sequence blocks);
    `strip`: every turn a root of its own (parent -1), the same lengths and times."""
    rng = random.Random(seed)
    rows, next_hash = [], [0]
    chat_ids = rng.sample(range(10 * n_sessions * turns), n_sessions * turns)  # randomised, as the trace's

    def new_ids(k):
        out = list(range(next_hash[0], next_hash[0] + k))
        next_hash[0] += k
        return out

    for s in range(n_sessions):
        parent, prev_total, prev_seq = -1, 0, []
        for k in range(turns):
            prompt = rng.randint(100, 300) if k == 0 else prev_total + rng.randint(20, 120)
            out = rng.randint(40, 160)
            shared = prev_seq[:prev_total // BLOCK]
            ids = shared + new_ids(-(-prompt // BLOCK) - len(shared))
            seq = ids[:prompt // BLOCK] + new_ids(-(-(prompt + out) // BLOCK) - prompt // BLOCK)
            cid = chat_ids[s * turns + k]
            rows.append({"chat_id": cid, "parent_chat_id": -1 if strip else parent,
                         "timestamp": round(s * spacing + k * gap, 3), "input_length": prompt, "output_length": out,
                         "type": "text", "turn": k + 1, "hash_ids": ids if hashes else []})
            parent, prev_total, prev_seq = cid, prompt + out, seq
    rows.sort(key=lambda r: r["timestamp"])  # stable: a parent (earlier) stays before its turn
    return rows


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(path, *overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        # frontend=none: closed-loop release is in the engine's times (run.closed_loop_sessions refuses a front end)
        cfg = compose("config", overrides=["trace=qwen_bailian", f"trace.path={path}", "output.progress=false",
                                           "frontend=none", *overrides])
    return simulate(cfg)


# ----------------------------------------------------------------------------- the loader

def test_the_loader_maps_chats_parents_sessions_times_and_blocks(tmp_path):
    rows = session_rows(n_sessions=3, turns=3)
    load = load_trace(write(tmp_path / "s.jsonl", rows), "qwen_bailian")
    assert load.rows == len(rows) and len(load.requests) == len(rows) and not load.rejected
    row_of_chat = {r["chat_id"]: i for i, r in enumerate(rows)}
    t0 = rows[0]["timestamp"]
    for i, (row, req) in enumerate(zip(rows, load.requests)):
        assert req.id == i and req.source == f"s.jsonl:{i + 1}"
        assert req.arrival == pytest.approx(row["timestamp"] - t0)  # seconds, from the first row
        assert (req.prompt_len, req.output_len, req.prefix_block_tokens) == (row["input_length"],
                                                                            row["output_length"], BLOCK)
        assert req.parent_id == (-1 if row["parent_chat_id"] == -1 else row_of_chat[row["parent_chat_id"]])
        root = row
        while root["parent_chat_id"] != -1:
            root = rows[row_of_chat[root["parent_chat_id"]]]
        assert req.session_id == str(root["chat_id"])
        assert req.think_time == -1.0  # the trace records none
        # a turn keeps its trace ids over its prompt's full blocks; a parent's last, partial prompt block
        # and its answer's blocks take its next turn's ids (that block holds prompt tail and answer head)
        is_parent = any(r["parent_chat_id"] == row["chat_id"] for r in rows)
        full = req.prompt_len // BLOCK if is_parent else len(row["hash_ids"])
        assert tuple(req.prefix_hashes[:full]) == tuple(row["hash_ids"][:full])
        keys = prefix_block_keys(req, BLOCK)
        assert len(keys) == ((req.prompt_len + req.output_len) if is_parent else req.prompt_len) // BLOCK


def test_a_turns_keys_start_with_its_parents_whole_sequence(tmp_path):
    for hashes in (True, False):
        load = load_trace(write(tmp_path / f"s{hashes}.jsonl", session_rows(n_sessions=4, turns=3, hashes=hashes)),
                          "qwen_bailian")
        by_id = {r.id: r for r in load.requests}
        for r in load.requests:
            if r.parent_id < 0:
                continue
            p = by_id[r.parent_id]
            parent_keys = prefix_block_keys(p, BLOCK)
            assert len(parent_keys) == p.total_len // BLOCK  # its answer's full blocks are keyed too
            shared = min(r.prompt_len, p.total_len) // BLOCK
            assert prefix_block_keys(r, BLOCK)[:shared] == parent_keys[:shared]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 400), st.integers(1, 200), st.integers(0, 300)), min_size=1, max_size=6),
       st.integers(1, 64))
def test_derived_keys_share_exactly_the_parents_sequence_blocks(turns, kv_block):
    """A chain of turns without trace ids: each turn's KV keys equal its parent's over the blocks its
    prompt shares with the parent's prompt and answer, and no further."""
    reqs, total = [], 0
    for i, (extra, out, _) in enumerate(turns):
        prompt = total + extra
        reqs.append(Request(i, float(i), prompt, out, (), BLOCK))
        total = prompt + out
    parent_row = [i - 1 for i in range(len(reqs))]
    linked = derive_prefixes(reqs, parent_row, list(range(len(reqs))), root_of(parent_row), BLOCK)
    for child, parent in zip(linked[1:], linked):
        assert child.parent_id == parent.id and child.session_id == "0"
        ck, pk = prefix_block_keys(child, kv_block), prefix_block_keys(parent, kv_block)
        shared = parent.total_len // BLOCK * BLOCK // kv_block  # kv blocks inside the parent's hashed blocks
        assert ck[:shared] == pk[:shared]
        assert not set(ck[-(-parent.total_len // kv_block):]) & set(pk)  # past the parent's tokens: its own


@pytest.mark.parametrize("mutate, field, reason", [
    (lambda rows: rows[3].update(parent_chat_id=987_654), "parent_chat_id", "names no chat_id"),
    (lambda rows: rows[2].update(chat_id=rows[1]["chat_id"]), "chat_id", "also on line 2"),
    (lambda rows: rows[1].update(chat_id="x"), "chat_id", "expected an integer"),
    (lambda rows: rows[0].update(parent_chat_id=rows[1]["chat_id"]), "parent_chat_id", "before its parent"),
])
def test_bad_links_are_named_errors_or_counted_rejections(tmp_path, mutate, field, reason):
    rows = session_rows(n_sessions=2, turns=4)
    mutate(rows)
    path = write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TraceError, match=rf"bad.jsonl:\d+: field '{field}'.*{reason}"):
        load_trace(path, "qwen_bailian")
    load = load_trace(path, "qwen_bailian", lenient=True)
    assert load.rows == len(rows) == len(load.requests) + len(load.rejected)
    assert any(reason in r.reason for r in load.rejected)
    kept = {r.id for r in load.requests}
    for r in load.requests:  # no kept turn points at a rejected parent
        assert r.parent_id < 0 or r.parent_id in kept


def test_a_cycle_of_parents_is_named(tmp_path):
    rows = session_rows(n_sessions=1, turns=3)
    rows[0]["parent_chat_id"] = rows[2]["chat_id"]  # 0 -> 2 -> 1 -> 0
    with pytest.raises(TraceError, match=r"a cycle of parents: .* -> .* -> .*"):
        load_trace(write(tmp_path / "cyc.jsonl", rows), "qwen_bailian")


def test_a_turn_of_a_rejected_parent_is_rejected_too(tmp_path):
    rows = session_rows(n_sessions=2, turns=3)
    first_turn = next(i for i, r in enumerate(rows) if r["parent_chat_id"] == -1)
    rows[first_turn]["input_length"] = 0  # the loader rejects the root
    load = load_trace(write(tmp_path / "r.jsonl", rows), "qwen_bailian", lenient=True)
    assert load.rows == len(rows) == len(load.requests) + len(load.rejected)
    assert len(load.rejected) == 3  # the root and, through it, its two later turns
    assert sum("was rejected" in r.reason for r in load.rejected) == 2


# ----------------------------------------------------------------------------- replay

@pytest.mark.parametrize("hashes, decode", [(False, "scheduled"), (True, "scheduled"), (False, "finished"),
                                           (True, "finished")])
def test_later_turns_hit_their_parents_kv(tmp_path, hashes, decode):
    """With sessions, turns hit their parent's prompt and answer blocks; stripped of the links
    (every turn a root, the same lengths, times and trace ids), derived ids share nothing and trace
    ids share the prompts only: the hit rate is clearly lower. Decoded blocks are cached when
    scheduled (vLLM) or when the request finishes (SGLang's radix cache): either way."""
    linked = run(write(tmp_path / "linked.jsonl", session_rows(hashes=hashes)), f"kv.cache_decode_tokens={decode}")
    stripped = run(write(tmp_path / "stripped.jsonl", session_rows(hashes=hashes, strip=True)),
                   f"kv.cache_decode_tokens={decode}")
    hit, base = linked.summary["prefix_cache_hit_rate"], stripped.summary["prefix_cache_hit_rate"]
    assert hit > 0.5 and hit > base + 0.1, (hit, base)  # measured: 0.76 vs 0.0 (derived ids) / 0.60 (trace ids)
    if not hashes:
        assert base == 0.0
    df = linked.requests
    later = df[df["prompt_len"] > 0]
    load = load_trace(tmp_path / "linked.jsonl", "qwen_bailian")
    parents = {r.id: r.parent_id for r in load.requests}
    turns = later[later["id"].map(parents) >= 0]
    # each later turn hit at least its parent's full prompt blocks (they stay cached: the KV is ample)
    total = {r.id: r.total_len for r in load.requests}
    for _, row in turns.iterrows():
        assert row["prefix_hit_tokens"] >= min(row["prompt_len"] - 1, total[parents[row["id"]]]) // BLOCK * BLOCK - BLOCK


def _parents(path):
    return {r.id: r.parent_id for r in load_trace(path, "qwen_bailian").requests}


@pytest.mark.parametrize("overrides", [(), ("trace.think_time_s=0.5",), ("backend.replicas=3", "router=session_affinity"),
                                       ("backend.replicas=2", "backend.async_scheduling=true")])
def test_closed_loop_turns_arrive_only_after_their_parent_finished(tmp_path, overrides):
    path = write(tmp_path / "s.jsonl", session_rows(gap=0.05))  # a gap shorter than an answer: open loop would overlap
    parents = _parents(path)
    load = {r.id: r for r in load_trace(path, "qwen_bailian").requests}
    res = run(path, "trace.session_replay=closed", *overrides)
    df = res.requests.set_index("id")
    assert (df["outcome"] == "finished").all()
    think = 0.5 if "trace.think_time_s=0.5" in overrides else None
    for rid, pid in parents.items():
        if pid < 0:
            assert df.at[rid, "arrival_s"] == pytest.approx(load[rid].arrival)  # a first turn: its timestamp
            continue
        pause = think if think is not None else load[rid].arrival - load[pid].arrival
        assert df.at[rid, "arrival_s"] >= df.at[pid, "finish_s"] + pause - 1e-9
        assert df.at[rid, "arrival_s"] == pytest.approx(df.at[pid, "finish_s"] + pause)
        assert df.at[rid, "first_scheduled_s"] >= df.at[rid, "arrival_s"]
    if "router=session_affinity" in overrides:  # a session stays on one replica
        sessions = {r.id: r.session_id for r in load.values()}
        assert df.groupby(df.index.map(sessions))["replica"].nunique().max() == 1
    # open loop with the same short gap: turns arrive at their timestamps, before their parents finish
    open_df = run(path).requests.set_index("id")
    for rid in parents:
        assert open_df.at[rid, "arrival_s"] == pytest.approx(load[rid].arrival)
    assert any(open_df.at[rid, "arrival_s"] < open_df.at[pid, "finish_s"] for rid, pid in parents.items() if pid >= 0)


def test_closed_loop_is_reproducible_and_conserves_every_row(tmp_path):
    rows = session_rows(gap=0.2)
    rows[5]["input_length"] = 0  # rejected at load (lenient), and its later turns with it
    path = write(tmp_path / "s.jsonl", rows)
    a = run(path, "trace.session_replay=closed", "trace.lenient=true")
    b = run(path, "trace.session_replay=closed", "trace.lenient=true")
    assert a.summary == b.summary
    assert a.requests.drop(columns=[]).equals(b.requests)
    s = a.summary
    assert s["num_requests"] == len(rows) == s["completed"] + s["rejected"] + s["unfinished"]
    assert s["rejected"] >= 1


def test_a_parent_rejected_or_unfinished_takes_its_turns_with_it(tmp_path):
    rows = session_rows(n_sessions=3, turns=3, gap=0.1)
    big = next(i for i, r in enumerate(rows) if r["parent_chat_id"] == -1)
    rows[big]["input_length"] = 5000  # beyond max_model_len below: rejected at arrival
    path = write(tmp_path / "s.jsonl", rows)
    res = run(path, "trace.session_replay=closed", "scheduler.max_model_len=4000")
    df = res.requests.set_index("id")
    parents = _parents(path)
    child = next(rid for rid, pid in parents.items() if pid == big)
    grandchild = next(rid for rid, pid in parents.items() if pid == child)
    assert df.at[big, "outcome"] == "rejected"
    for rid, pid in ((child, big), (grandchild, child)):
        assert df.at[rid, "outcome"] == "rejected"
        assert df.at[rid, "reason"].startswith(f"parent-rejected: its parent request {pid} was rejected")
    assert res.summary["num_requests"] == len(rows)
    # a horizon that ends before the first answers are in: the later turns never arrive, naming their parent
    res = run(path, "trace.session_replay=closed", "backend.horizon_s=0.001")
    df = res.requests.set_index("id")
    for rid, pid in parents.items():
        if pid >= 0:
            assert df.at[rid, "outcome"] == "unfinished"
            assert df.at[rid, "reason"].startswith(f"parent-unfinished: its parent request {pid} never finished")
    assert res.summary["num_requests"] == len(rows)


def test_closed_loop_is_refused_where_it_is_not_modelled(tmp_path):
    path = write(tmp_path / "s.jsonl", session_rows(n_sessions=1, turns=2))
    with pytest.raises(ValueError, match=r"trace.session_replay=closed.*disagg"):
        run(path, "trace.session_replay=closed", "disagg.enabled=true")
    with pytest.raises(ValueError, match=r"trace.session_replay='sideways': expected one of open, closed"):
        run(path, "trace.session_replay=sideways")


def test_the_engine_and_vllm_refuse_closed_loop_replay(tmp_path):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["trace=qwen_bailian", "trace.path=x.jsonl", "trace.session_replay=closed"])
    check_config(cfg)  # the simulator's
    for backend in ("engine", "vllm"):
        with pytest.raises(ConfigError, match=r"trace.session_replay=closed: the simulator's only"):
            check_config(cfg, backend)


@pytest.mark.parametrize("extra", [(), ("backend.async_scheduling=true",), ("trace.think_time_s=0",),
                                   ("backend.replicas=3",), ("backend.replicas=3", "backend.async_scheduling=true")])
def test_closed_loop_fast_forward_is_exact(tmp_path, extra):
    """A replica's decode run is planned and completed once and cut only by an arrival routed to it (the
    other replicas' step ends are replayed as cut points that neither plan nor complete: sim/decode_runs.py
    WindowedRun), so a turn released by a finish anywhere is seen as it would be step by step: merging
    steps changes no request's times."""
    path = write(tmp_path / "s.jsonl", session_rows(n_sessions=30, turns=3, hashes=False, gap=3.0, spacing=0.2))
    merged = run(path, "trace.session_replay=closed", *extra)
    stepped = run(path, "trace.session_replay=closed", "backend.fast_forward=false", *extra)
    assert merged.summary["num_events"] < stepped.summary["num_events"]  # it did merge steps
    assert merged.requests.equals(stepped.requests)
