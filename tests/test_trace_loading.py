"""Trace loaders on the bundled files and on every kind of malformed row; generators; transforms."""
from __future__ import annotations

import json

import numpy as np
import pytest

import traces
from traces import TraceError


def test_azure_conv_bundled():
    load = traces.load_trace("azure_llm_2023/AzureLLMInferenceTrace_conv.csv", "azure")
    reqs = load.requests
    assert load.rows == len(reqs) == 19_366 and not load.rejected
    assert reqs[0].arrival == 0.0 and (reqs[0].prompt_len, reqs[0].output_len) == (374, 44)
    # lines 2 and 3: 18:15:46.6805900 and 18:15:50.9951690 -> 4.3145790 s apart (7 fractional digits kept)
    assert reqs[1].arrival == pytest.approx(4.3145790, abs=1e-9)
    assert (reqs[1].prompt_len, reqs[1].output_len) == (396, 109)
    assert reqs[1].source == "AzureLLMInferenceTrace_conv.csv:3"
    arrivals = np.array([r.arrival for r in reqs])
    assert (np.diff(arrivals) >= 0).all()
    assert [r.id for r in reqs] == list(range(19_366))


def test_azure_code_and_mooncake_bundled():
    code = traces.load_trace("azure_llm_2023/AzureLLMInferenceTrace_code.csv", "azure")
    assert code.rows == 8_819 and code.requests[0].arrival == 0.0
    moon = traces.load_trace("mooncake_synthetic/synthetic_trace.jsonl", "mooncake")
    r0 = moon.requests[0]
    assert moon.rows == 3_993 and (r0.prompt_len, r0.output_len) == (40160, 6)
    assert len(r0.prefix_hashes) == 79 and r0.prefix_hashes[:3] == (0, 1, 2) and r0.prefix_block_tokens == 512
    assert moon.requests[-1].arrival == pytest.approx(1022.025)


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
GOOD = ["2023-11-16 18:15:46.6805900,374,44\n", "2023-11-16 18:15:50.9951690,396,109\n"]


@pytest.mark.parametrize("bad_row, field, words", [
    ("2023-11-16 18:15:51.0000000,,10\n", "ContextTokens", "missing"),
    ("2023-11-16 18:15:51.0000000,abc,10\n", "ContextTokens", "not a number"),
    ("2023-11-16 18:15:51.0000000,-5,10\n", "ContextTokens", "negative"),
    ("2023-11-16 18:15:51.0000000,0,10\n", "ContextTokens", "at least 1"),
    ("2023-11-16 18:15:51.0000000,10,0\n", "GeneratedTokens", "at least 1"),
    ("not-a-time,10,10\n", "TIMESTAMP", "unparseable"),
    ("2023-11-16 18:15:40.0000000,10,10\n", "TIMESTAMP", "backwards"),
    (",10,10\n", "TIMESTAMP", "missing"),
])
def test_azure_bad_rows(tmp_path, bad_row, field, words):
    f = tmp_path / "bad.csv"
    f.write_text(AZURE_HEADER + GOOD[0] + GOOD[1] + bad_row + "2023-11-16 18:15:59.0000000,5,5\n")
    with pytest.raises(TraceError) as e:
        traces.load_azure(f)
    msg = str(e.value)
    assert "bad.csv:4" in msg and field in msg and words in msg
    lenient = traces.load_azure(f, lenient=True)
    assert lenient.rows == 4 and len(lenient.requests) == 3 and len(lenient.rejected) == 1
    rej = lenient.rejected[0]
    assert (rej.id, rej.line, rej.field) == (2, 4, field) and words in rej.reason
    assert [r.id for r in lenient.requests] == [0, 1, 3]


def test_mooncake_bad_rows(tmp_path):
    f = tmp_path / "bad.jsonl"
    rows = [{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 5, "input_length": 600, "output_length": 3},  # no hash_ids
            "{not json",
            {"timestamp": 9, "input_length": "x", "output_length": 3, "hash_ids": [1]}]
    f.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    with pytest.raises(TraceError) as e:
        traces.load_mooncake(f)
    assert "bad.jsonl:" in str(e.value)
    load = traces.load_mooncake(f, lenient=True)
    assert load.rows == 4 and len(load.requests) == 1
    assert {(r.line, r.field) for r in load.rejected} == {(2, "hash_ids"), (3, "<row>"), (4, "input_length")}


def test_table_loader_with_mapping(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("ts_ms,in,out,user\n0,10,5,alice\n250,20,6,bob\n")
    load = traces.load_table(csv, columns={"arrival": "ts_ms", "prompt_len": "in", "output_len": "out",
                                           "tenant": "user"}, time_unit="ms")
    assert [(r.arrival, r.prompt_len, r.output_len, r.tenant) for r in load.requests] == \
        [(0.0, 10, 5, "alice"), (0.25, 20, 6, "bob")]
    jl = tmp_path / "t.jsonl"
    jl.write_text('{"t": 1.5, "p": 7, "o": 2}\n{"t": 2.5, "p": 8, "o": 3}\n')
    load = traces.load_trace(jl, "jsonl", columns={"arrival": "t", "prompt_len": "p", "output_len": "o"})
    assert [r.arrival for r in load.requests] == [0.0, 1.0]
    with pytest.raises(TraceError) as e:
        traces.load_table(csv, columns={"arrival": "time", "prompt_len": "in", "output_len": "out"})
    assert "'time'" in str(e.value) and "ts_ms" in str(e.value)
    with pytest.raises(ValueError, match="columns"):
        traces.load_trace(csv, "csv")


def test_missing_file_lists_bundled_traces():
    with pytest.raises(FileNotFoundError, match="AzureLLMInferenceTrace_conv.csv"):
        traces.load_trace("nope.csv", "azure")


def test_generators_are_deterministic_and_have_the_asked_rate_and_cv():
    a = traces.poisson(4.0, n=20_000, lengths=(100, 10), seed=1)
    b = traces.poisson(4.0, n=20_000, lengths=(100, 10), seed=1)
    assert a == b and a != traces.poisson(4.0, n=20_000, lengths=(100, 10), seed=2)
    gaps = np.diff([r.arrival for r in a])
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    bursty = traces.gamma(4.0, 3.0, n=20_000, lengths=(100, 10), seed=1)
    g = np.diff([r.arrival for r in bursty])
    assert g.mean() == pytest.approx(0.25, rel=0.1) and g.std() / g.mean() == pytest.approx(3.0, rel=0.15)
    pool = traces.load_trace("azure_llm_2023/AzureLLMInferenceTrace_code.csv", "azure").requests
    sampled = traces.poisson(1.0, duration=100.0, lengths=pool, seed=0)
    pairs = {(r.prompt_len, r.output_len) for r in pool}
    assert all(r.arrival < 100 for r in sampled) and all((r.prompt_len, r.output_len) in pairs for r in sampled)
    with pytest.raises(ValueError, match="rate"):
        traces.poisson(0, n=5, lengths=(1, 1))


def test_transforms():
    reqs = traces.poisson(2.0, n=100, lengths=(1000, 50), seed=3)
    fast = traces.scale_rate(reqs, 2.0)
    assert [f.arrival for f in fast] == pytest.approx([r.arrival / 2 for r in reqs])
    win = traces.time_window(reqs, 10.0, 20.0)
    assert win and all(0 <= r.arrival < 10 for r in win)
    assert len(traces.first_n(reqs, 7)) == 7
    capped = traces.cap_lengths(reqs, max_prompt=300, max_output=20)
    assert {(r.prompt_len, r.output_len) for r in capped} == {(300, 20)}
    assert reqs[0].prompt_len == 1000  # inputs are never mutated
    with pytest.raises(ValueError, match="rate_scale"):
        traces.scale_rate(reqs, 0)
