"""Published trace formats by name (`testbed.traces.formats`): Azure 2024 (streamed), Azure
multimodal 2025, BurstGPT and Vidur's length-only sets, each on a small fixture written here
in its format; their presets; and the streaming loader's selection against loading the
whole file and selecting after."""
from __future__ import annotations

import gzip
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from testbed import traces
from testbed.app.assembly.config import TraceConfig
from testbed.app.assembly.run_setup import build_requests
from testbed.traces import TraceError

AZ_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
MM_HEADER = "TIMESTAMP,NumImages,ContextTokens,GeneratedTokens\n"
BURST_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
BURST_HEADER_SESSIONS = "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def write(tmp_path, name, text):
    f = tmp_path / name
    f.write_text(text)
    return f


def trace_cfg(**kw):
    return OmegaConf.structured(TraceConfig(name="t", **kw))


def compose_trace(*overrides):
    from hydra import compose, initialize_config_dir

    from testbed.app.entry.cli import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides)).trace


# ----------------------------------------------------------------------------- Azure 2024

AZ_ROWS = ("2024-05-10 00:00:00.014+00:00,10,5\n"  # fractional
           "2024-05-10 00:00:01+00:00,20,6\n"  # no fractional part
           "2024-05-10 02:00:02.5+02:00,30,7\n"  # another offset: 00:00:02.5 UTC
           "2024-05-09 19:00:03-05:00,40,8\n"  # a negative offset: 00:00:03 UTC
           "2024-05-10T00:00:04.1234567Z,50,9\n")  # T, Z and 100-ns digits


def test_azure_2024_converts_offsets_to_utc_and_mixes_fractional_formats(tmp_path):
    load = traces.load_trace(write(tmp_path, "week.csv", AZ_HEADER + AZ_ROWS), "azure_2024")
    assert load.rows == 5 and not load.rejected
    assert [r.arrival for r in load.requests] == [0.0, 0.986, 2.486, 2.986, 4.1094567]
    assert [(r.id, r.prompt_len, r.output_len, r.source) for r in load.requests][2] == (2, 30, 7, "week.csv:4")


@pytest.mark.parametrize("chunk_bytes", [1, 17, 64, 10_000])
def test_azure_2024_reads_the_same_in_any_chunk_size_and_compressed(tmp_path, chunk_bytes):
    whole = traces.load_azure_2024(write(tmp_path, "w.csv", AZ_HEADER + "\n" + AZ_ROWS + "\n"))
    f = tmp_path / "w.csv.gz"
    f.write_bytes(gzip.compress((AZ_HEADER + "\n" + AZ_ROWS).encode()))
    load = traces.load_azure_2024(f, chunk_bytes=chunk_bytes)
    assert [(r.id, r.arrival, r.prompt_len, r.source.replace(".gz", "")) for r in load.requests] == \
           [(r.id, r.arrival, r.prompt_len, r.source) for r in whole.requests]
    assert whole.requests[0].source == "w.csv:3"  # a blank line keeps the editor's numbering


@pytest.mark.parametrize("row, field, reason", [
    ("2024-05-10 00:00:05,1,1", "TIMESTAMP", "no UTC offset"),
    ("2024-05-10 00:00:05.5+00:00x,1,1", "TIMESTAMP", "unparseable time"),
    (",1,1", "TIMESTAMP", "missing value"),
    ("2024-05-10 00:00:00+00:00,1,1", "TIMESTAMP", "goes backwards.*line 6"),
    ("2024-05-10 00:00:05+00:00,0,1", "ContextTokens", "at least 1"),
    ("2024-05-10 00:00:05+00:00,1,2.5", "GeneratedTokens", "not a whole number"),
    ("2024-05-10 00:00:05+00:00,1,1,9", "<row>", "4 fields"),
])
def test_azure_2024_malformed_rows_are_named_or_counted(tmp_path, row, field, reason):
    f = write(tmp_path, "bad.csv", AZ_HEADER + AZ_ROWS + row + "\n" + "2024-05-10 00:00:06+00:00,1,1\n")
    for chunk_bytes in (20, 1 << 20):
        with pytest.raises(TraceError, match=reason) as e:
            traces.load_azure_2024(f, chunk_bytes=chunk_bytes)
        assert (e.value.file, e.value.line, e.value.field) == (str(f), 7, field)
        load = traces.load_azure_2024(f, lenient=True, chunk_bytes=chunk_bytes)
        assert load.rows == 7 and [(r.line, r.field) for r in load.rejected] == [(7, field)]
        assert load.requests[-1].arrival == 6.0 - 0.014


def test_azure_2024_header_errors_name_the_column(tmp_path):
    with pytest.raises(TraceError, match="no column 'GeneratedTokens'") as e:
        traces.load_azure_2024(write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens\n2024-05-10 00:00:00Z,1\n"))
    assert (e.value.line, e.value.field) == (1, "GeneratedTokens")
    with pytest.raises(TraceError, match="empty"):
        traces.load_azure_2024(write(tmp_path, "e.csv", "\n\n"))


_STAMPS = st.lists(st.tuples(
    st.one_of(st.integers(0, 50).map(lambda k: k * 0.25), st.sampled_from(["bad", "", "back"])),
    st.sampled_from([0, 1, 7]), st.sampled_from(["+00:00", "+01:00", "Z"])), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=_STAMPS, start=st.one_of(st.none(), st.sampled_from([0.0, 2.0, 5.5])),
       span=st.one_of(st.none(), st.sampled_from([0.5, 3.0, 100.0])), n=st.one_of(st.none(), st.integers(1, 6)),
       chunk_bytes=st.sampled_from([1, 40, 200, 1 << 20]))
def test_streaming_selection_equals_loading_everything_then_selecting(tmp_path, rows, start, span, n, chunk_bytes):
    """The streamed window / first-N keeps exactly the requests and the rejected rows that the
    whole-file load followed by `time_window`, `first_n` and `rejected_in_selection` keeps."""
    lines, t = [], 0.0
    for time_, prompt, zone in rows:
        if time_ == "back":
            cell = "2024-05-09 23:00:00+00:00"  # before every other row: goes backwards (unless first)
        elif isinstance(time_, str):
            cell = time_
        else:
            t += time_
            hours = {"+00:00": 0, "Z": 0, "+01:00": 1}[zone]
            whole, frac = divmod(t, 1)
            cell = (f"2024-05-10 {hours:02d}:{int(whole) // 60:02d}:{int(whole) % 60:02d}"
                    + (f".{round(frac * 100):02d}" if frac else "") + zone)
        lines.append(f"{cell},{prompt},3\n")
    f = tmp_path / "p.csv"
    f.write_text(AZ_HEADER + "".join(lines))
    end = None if start is None or span is None else start + span
    reference = traces.load_table(f, columns={"arrival": "TIMESTAMP", "prompt_len": "ContextTokens",
                                              "output_len": "GeneratedTokens"}, time_unit="datetime", lenient=True)
    kept = reference.requests
    if start is not None or end is not None:
        kept = traces.time_window(kept, start or 0.0, math.inf if end is None else end)
    if n is not None:
        kept = traces.first_n(kept, n)
    want_rejected = traces.rejected_in_selection(reference.rejected, reference.requests, kept, start, end)
    load = traces.load_azure_2024(f, lenient=True, start_s=start, end_s=end, max_requests=n, chunk_bytes=chunk_bytes)
    got = load.requests
    if start is not None or end is not None:
        got = traces.time_window(got, start or 0.0, math.inf if end is None else end)
    if n is not None:
        got = traces.first_n(got, n)
    assert [(r.id, r.arrival, r.prompt_len, r.source) for r in got] == \
           [(r.id, r.arrival, r.prompt_len, r.source) for r in kept]
    assert [(r.id, r.line, r.field, r.arrival) for r in load.rejected] == \
           [(r.id, r.line, r.field, r.arrival) for r in want_rejected]
    assert load.rows == len(load.requests) + len(load.rejected)


def test_a_windowed_run_of_the_azure_2024_preset(tmp_path):
    rows = "".join(f"2024-05-10 00:{s // 60:02d}:{s % 60:02d}+00:00,{10 + s},5\n" for s in range(100))
    f = write(tmp_path, "week.csv", AZ_HEADER + rows)
    reqs, rejected = build_requests(trace_cfg(path=str(f), format="azure_2024", start_s=10.0, end_s=20.0,
                                              max_requests=4), 0)
    assert [(r.id, r.arrival, r.prompt_len) for r in reqs] == [(10, 0.0, 20), (11, 1.0, 21), (12, 2.0, 22),
                                                                (13, 3.0, 23)]
    assert rejected == []


# ----------------------------------------------------------------------------- Azure multimodal 2025

def test_azure_multimodal_2025_reads_z_times_with_milliseconds(tmp_path):
    f = write(tmp_path, "mm.csv", MM_HEADER + "2024-10-15T00:00:00.120Z,2,500,20\n2024-10-15T00:00:01.000Z,0,40,3\n"
                                              "2024-10-15T00:00:01.5Z,1,700,9\n")
    load = traces.load_trace(f, "azure_multimodal_2025")
    assert [(r.arrival, r.prompt_len, r.output_len) for r in load.requests] == [(0.0, 500, 20), (0.88, 40, 3),
                                                                                (1.38, 700, 9)]


@pytest.mark.parametrize("cells, field", [("-1,5,5", "NumImages"), ("x,5,5", "NumImages"), ("1,,5", "ContextTokens")])
def test_azure_multimodal_2025_malformed_rows(tmp_path, cells, field):
    f = write(tmp_path, "mm.csv", MM_HEADER + "2024-10-15T00:00:00.120Z,2,500,20\n" f"2024-10-15T00:00:01.000Z,{cells}\n")
    with pytest.raises(TraceError) as e:
        traces.load_trace(f, "azure_multimodal_2025")
    assert (e.value.line, e.value.field) == (3, field)
    load = traces.load_trace(f, "azure_multimodal_2025", lenient=True)
    assert (load.rows, len(load.requests), load.rejected[0].field) == (2, 1, field)
    with pytest.raises(TraceError, match="no column 'NumImages'"):
        traces.load_trace(write(tmp_path, "az.csv", AZ_HEADER + AZ_ROWS), "azure_multimodal_2025")


# ----------------------------------------------------------------------------- BurstGPT

BURST_ROWS = ("5,ChatGPT,472,18,490,Conversation log\n"
              "45,ChatGPT,1087,230,1317,Conversation log\n"
              "118,GPT-4,417,0,417,API log\n"  # failed: 0 response tokens
              "120.5,GPT-4,300,40,340,API log\n")


def test_burstgpt_times_from_midnight_tenants_and_failed_requests(tmp_path):
    load = traces.load_trace(write(tmp_path, "BurstGPT_1.csv", BURST_HEADER + BURST_ROWS), "burstgpt")
    assert load.rows == 4
    assert [(r.id, r.arrival, r.prompt_len, r.output_len, r.tenant) for r in load.requests] == [
        (0, 0.0, 472, 18, "ChatGPT"), (1, 40.0, 1087, 230, "ChatGPT"), (3, 115.5, 300, 40, "GPT-4")]
    [failed] = load.rejected  # strict mode: a failure is the trace's record, not damage
    assert (failed.id, failed.line, failed.field, failed.arrival) == (2, 4, "Response tokens", 113.0)
    assert failed.reason.startswith("failed request")


def test_burstgpt_failed_rows_reach_the_run_as_rejected(tmp_path):
    f = write(tmp_path, "BurstGPT_1.csv", BURST_HEADER + BURST_ROWS)
    reqs, rejected = build_requests(trace_cfg(path=str(f), format="burstgpt"), 0)
    assert len(reqs) == 3
    assert rejected == [(2, "BurstGPT_1.csv:4", "failed-in-trace: field Response tokens: " + traces.formats.BURSTGPT_FAILED)]


def test_burstgpt_sessions_and_row_filter(tmp_path):
    f = write(tmp_path, "b2.csv", BURST_HEADER_SESSIONS +
              "0,s1,1.5,ChatGPT,10,5,15,Conversation log\n3,,0.2,GPT-4,20,0,20,API log\n"
              "4,s1,2.0,ChatGPT,30,6,36,Conversation log\n7,9,1.0,GPT-4,40,7,47,Conversation log\n")
    load = traces.load_burstgpt(f)
    assert [r.session_id for r in load.requests] == ["s1", "s1", "9"]
    gpt4 = traces.load_burstgpt(f, row_filter={"Model": "GPT-4"})
    assert ([r.id for r in gpt4.requests], [r.id for r in gpt4.rejected], gpt4.rows) == ([3], [1], 2)
    conv = traces.load_burstgpt(f, row_filter={"Model": "GPT-4", "Log Type": "Conversation log"})
    assert [r.id for r in conv.requests] == [3] and conv.rows == 1
    with pytest.raises(ValueError, match="row_filter.Session ID"):
        traces.load_burstgpt(f, row_filter={"Session ID": "s1"})
    with pytest.raises(ValueError, match="format=burstgpt only"):
        traces.load_trace(f, "azure_2024", row_filter={"Model": "GPT-4"})
    # a filter that keeps nothing names itself and what the file holds (it once said "no data rows")
    with pytest.raises(ValueError, match=r"trace.row_filter=\{'Model': 'GPT-5'\} keeps none of the 4 rows of .*b2\.csv "
                                         r"\(the values there: Model: ChatGPT, GPT-4\)"):
        traces.load_burstgpt(f, row_filter={"Model": "GPT-5"})


def test_burstgpt_reads_the_session_column_under_either_name(tmp_path):
    f = write(tmp_path, "b3.csv", "Timestamp,SessionID,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                                  "0,a,ChatGPT,10,5,15,Conversation log\n")
    assert traces.load_burstgpt(f).requests[0].session_id == "a"
    assert traces.load_burstgpt(write(tmp_path, "b4.csv", BURST_HEADER + BURST_ROWS)).requests[0].session_id == ""


@pytest.mark.parametrize("row, field", [("x,ChatGPT,1,1,2,API log", "Timestamp"), ("9,,1,1,2,API log", "Model"),
                                        ("9,ChatGPT,-3,1,2,API log", "Request tokens"),
                                        ("9,ChatGPT,3,1.5,2,API log", "Response tokens"),
                                        ("1,ChatGPT,3,1,4,API log", "Timestamp")])
def test_burstgpt_malformed_rows(tmp_path, row, field):
    f = write(tmp_path, "b.csv", BURST_HEADER + "5,ChatGPT,472,18,490,Conversation log\n" + row + "\n")
    with pytest.raises(TraceError) as e:
        traces.load_burstgpt(f)
    assert (e.value.line, e.value.field) == (3, field)
    load = traces.load_burstgpt(f, lenient=True)
    assert (load.rows, [r.field for r in load.rejected]) == (2, [field])


# ----------------------------------------------------------------------------- length-only sets

VIDUR = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n3772,54,3826,69.85\n2015,156,2171,12.9\n"


def test_vidur_lengths_feed_the_generators(tmp_path):
    f = write(tmp_path, "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv", VIDUR)
    load = traces.load_trace(f, "vidur", lengths_only=True)
    assert [(r.prompt_len, r.output_len) for r in load.requests] == [(3772, 54), (2015, 156)]
    reqs, _ = build_requests(trace_cfg(kind="poisson", rate=2.0, num_requests=50, lengths_from=str(f),
                                       lengths_format="vidur"), 0)
    assert len(reqs) == 50 and {(r.prompt_len, r.output_len) for r in reqs} <= {(3772, 54), (2015, 156)}
    with pytest.raises(ValueError, match="lengths but no arrival times"):
        build_requests(trace_cfg(path=str(f), format="vidur"), 0)


def test_a_lengths_file_that_gives_no_lengths_is_named(tmp_path):
    header_only = write(tmp_path, "h.csv", VIDUR.splitlines()[0] + "\n")
    with pytest.raises(ValueError, match=r"trace.lengths_from=.*h\.csv: no lengths to sample from .*h\.csv: it has no "
                                         r"data rows"):
        build_requests(trace_cfg(kind="poisson", rate=2.0, num_requests=5, lengths_from=str(header_only),
                                 lengths_format="vidur"), 0)


@pytest.mark.parametrize("row, field", [("12,0,12,inf", "num_decode_tokens"), (",5,5,0", "num_prefill_tokens")])
def test_vidur_malformed_rows(tmp_path, row, field):
    f = write(tmp_path, "v.csv", VIDUR + row + "\n")
    with pytest.raises(TraceError) as e:
        traces.load_vidur_lengths(f)
    assert (e.value.line, e.value.field) == (4, field)
    with pytest.raises(TraceError, match="no column 'num_decode_tokens'"):
        traces.load_vidur_lengths(write(tmp_path, "w.csv", "num_prefill_tokens\n5\n"))


# ----------------------------------------------------------------------------- presets

@pytest.mark.parametrize("preset, fmt, key", [
    ("azure_2024", "azure_2024", "trace.path"), ("azure_multimodal_2025", "azure_multimodal_2025", "trace.path"),
    ("burstgpt", "burstgpt", "trace.path"), ("sharegpt", "vidur", "trace.lengths_from"),
    ("lmsys_chat", "vidur", "trace.lengths_from"), ("arxiv_summarization", "vidur", "trace.lengths_from"),
    ("bwb", "vidur", "trace.lengths_from")])
def test_presets_need_the_users_file_and_say_where_it_comes_from(preset, fmt, key):
    tc = compose_trace(f"trace={preset}")
    assert tc.name == preset and (tc.format if tc.kind == "file" else tc.lengths_format) == fmt
    with pytest.raises(ValueError, match=rf"{key} is required: .*not bundled.*{traces.formats.SOURCES[fmt][:20]}"):
        build_requests(tc, 0)


def test_a_preset_with_the_users_file_is_named_after_it(tmp_path):
    f = write(tmp_path, "BurstGPT_1.csv", BURST_HEADER + BURST_ROWS)
    tc = compose_trace("trace=burstgpt", f"trace.path={f}", "+trace.row_filter={Model: GPT-4, Log Type: API log}")
    assert tc.name == "BurstGPT_1"
    reqs, rejected = build_requests(tc, 0)
    assert [r.id for r in reqs] == [3] and [i for i, *_ in rejected] == [2]
