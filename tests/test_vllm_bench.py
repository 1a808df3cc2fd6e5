"""`vllm bench serve` interoperability: a run's vllm_bench.json reads as vLLM's own results do, vLLM's workload
is rebuilt draw for draw, and a real result file (tests/data/vllm_bench_serve_random.json, a FIXTURE made by
tests/data/make_vllm_bench_serve_fixture.py with vLLM 0.32's own generators and synthetic latencies) is
replayed and compared; a bad file ends the command with one line naming the key, exit 2."""
from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest

from signalling import environment, script_command

DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "vllm_bench_serve_random.json"
DRAWS = DATA / "vllm_bench_serve_random_draws.json"  # vLLM's own draws for the fixture's arguments
ARGS = ["--seed", "42", "--random-input-len", "256", "--random-output-len", "64", "--random-range-ratio", "0.25"]


def _json_type(v) -> str:
    if v is None:
        return "null"
    return "number" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v).__name__


# --- a reader written against `vllm bench serve` results, the way vLLM's own scripts read them -----------------

def vllm_style_read(path: Path) -> dict:
    """Reads a result as vLLM 0.32's scripts do: json.load, the "inf"/"nan" strings turned to floats
    (vllm/benchmarks/sweep/plot.py L175-197, `_json_load_bytes` and `_convert_inf_nan_strings`), the
    throughput and user count as plot_pareto.py L30-118 takes them (`_get_numeric` on output_throughput,
    request_rate, else max_concurrent_requests), and each request's timeline as serve.py L2303-2330 builds
    it for --plot-timeline (latency = ttft + sum(itl))."""
    with path.open("rb") as f:
        record = json.load(f)
    record = {k: float(v) if isinstance(v, str) and v in ("inf", "-inf", "nan") else v for k, v in record.items()}
    users = float(record["request_rate"]) or float(record["max_concurrent_requests"])
    timeline = []
    for i in range(len(record["start_times"])):
        latency = record["ttfts"][i] + sum(record["itls"][i]) if record["itls"][i] else record["ttfts"][i]
        timeline.append({"start_time": record["start_times"][i], "ttft": record["ttfts"][i], "itl": record["itls"][i],
                         "latency": latency, "prompt_len": record["input_lens"][i],
                         "output_tokens": record["output_lens"][i]})
    headline = {f"{s} {m}": float(record[f"{s}_{m}_ms"])
                for m in ("ttft", "tpot", "itl") for s in ("mean", "median", "p99")}
    return {"record": record, "throughput": float(record["output_throughput"]), "users": users,
            "timeline": timeline, "headline": headline}


def test_the_fixture_is_what_vllm_writes():
    """The reader reads the fixture (vLLM's own format) before it is trusted on ours."""
    r = vllm_style_read(FIXTURE)
    assert r["record"]["num_prompts"] == len(r["timeline"]) == 50
    assert r["users"] == 4.0
    for row, lat in zip(r["timeline"], r["record"]["latencies"]):
        assert row["latency"] == pytest.approx(lat, rel=1e-12)


@pytest.fixture(scope="module")
def simulated_run(tmp_path_factory):
    """One simulated run through the main command, per-token times recorded."""
    out = tmp_path_factory.mktemp("sim")
    done = subprocess.run(script_command("testbed-sim", ["trace.max_requests=120", "trace.rate_scale=4",
                                                         "output.record_token_times=true", f"output.dir={out}",
                                                         f"hydra.run.dir={out}", "output.print_table=false"]),
                          capture_output=True, text=True, env=environment(), cwd=out, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_a_simulated_run_reads_as_a_vllm_bench_serve_result(simulated_run):
    real_keys = {k: v for k, v in json.loads(FIXTURE.read_text()).items() if k != "fixture_note"}
    ours = json.loads((simulated_run / "vllm_bench.json").read_text())
    summary = json.loads((simulated_run / "summary.json").read_text())
    for key, value in real_keys.items():  # every key vLLM writes, with vLLM's JSON type (label, goodput: may be null)
        assert key in ours, key
        if key not in ("label", "request_goodput", "max_concurrency"):
            assert _json_type(ours[key]) == _json_type(value), (key, ours[key])
        if isinstance(value, list) and value and ours[key]:  # the elements too: itls a list of lists of numbers
            assert _json_type(ours[key][0]) == _json_type(value[0]), key
    r = vllm_style_read(simulated_run / "vllm_bench.json")
    n = summary["num_requests"]
    assert r["record"]["num_prompts"] == n == len(r["timeline"]) == 120
    assert r["record"]["backend"] == "openai" and ours["testbed_backend"] == "sim"  # vLLM's meaning, ours apart
    assert r["record"]["model_id"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert r["record"]["completed"] + r["record"]["failed"] == n
    assert r["throughput"] == pytest.approx(r["record"]["total_output_tokens"] / r["record"]["duration"])
    assert r["users"] > 0
    done = [row for row, e in zip(r["timeline"], r["record"]["errors"]) if not e]
    assert done and all(len(row["itl"]) == row["output_tokens"] - 1 for row in done)
    for row, lat in zip(r["timeline"], r["record"]["latencies"]):  # vLLM's timeline latency is the run's E2E
        if row["output_tokens"]:
            assert row["latency"] == pytest.approx(lat, rel=1e-9, abs=1e-9)
    for key, value in r["headline"].items():  # the statistics are the summary's, under vLLM's names
        assert value == pytest.approx(summary[key.replace(" ", "_") + "_ms"])
    itls = np.concatenate([row["itl"] for row in done]) * 1e3  # the per-request gaps are the summary's ITL
    assert float(np.mean(itls)) == pytest.approx(summary["mean_itl_ms"], rel=1e-9)
    ttfts = np.array([row["ttft"] for row in done]) * 1e3
    assert float(np.percentile(ttfts, 99)) == pytest.approx(summary["p99_ttft_ms"], rel=1e-9)


def test_vllms_draws_are_reproduced_to_the_bit():
    from testbed.traces.vllm_bench import random_lengths, send_times

    draws = json.loads(DRAWS.read_text())
    prompts, outputs = random_lengths(50, 256, 64, 0.25, seed=42, num_special_tokens=1)
    assert [p - 1 for p in prompts] == draws["input_lens"]  # vLLM's draw, before the server adds the BOS
    assert outputs == draws["output_lens"]
    assert send_times(50, 4.0, 0.5, seed=42) == draws["delay_ts"]
    assert send_times(50, 4.0, 0.5, seed=43) != draws["delay_ts"]
    even = send_times(4, 2.0, math.inf, seed=0)
    assert even == pytest.approx([0.5, 1.0, 1.5, 2.0])
    assert send_times(3, math.inf, 1.0, seed=0) == [0.0, 0.0, 0.0]


def test_peak_figures_are_vllms():
    """max_output_tokens_per_s and max_concurrent_requests from the fixture's requests give what vLLM's own
    calculate_metrics computed from them."""
    from testbed.app.vllm_bench_format import peak_per_second

    r = json.loads(FIXTURE.read_text())
    tokens = np.concatenate([s + t + np.concatenate([[0.0], np.cumsum(i)])
                             for s, t, i in zip(r["start_times"], r["ttfts"], r["itls"])])
    peak = peak_per_second(np.array(r["start_times"]), tokens, np.array(r["latencies"]))
    assert peak == (r["max_output_tokens_per_s"], r["max_concurrent_requests"])


def test_the_fixture_is_replayed_and_compared(tmp_path, capsys):
    from testbed.app.vllm_bench import ROWS, main
    from testbed.traces.vllm_bench import send_times

    real = json.loads(FIXTURE.read_text())
    out = tmp_path / "replay"
    assert main([str(FIXTURE), *ARGS, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "agree for 50/50 requests" in printed
    sim = json.loads((out / "vllm_bench.json").read_text())
    assert sim["num_prompts"] == real["num_prompts"] == json.loads((out / "summary.json").read_text())["num_requests"]
    assert sim["input_lens"] == real["input_lens"]  # lengths from the seed: the ones the real server counted
    assert sim["output_lens"] == real["output_lens"]
    assert sim["start_times"] == send_times(50, 4.0, 0.5, 42)
    sent = np.array(real["start_times"]) - real["start_times"][0]  # the real client sent them so (+ its jitter)
    assert np.abs(np.array(sim["start_times"]) - sim["start_times"][0] - sent).max() < 1e-3
    rows = {r["metric"]: r for r in json.loads((out / "comparison.json").read_text())["rows"]}
    assert sorted(rows) == sorted(k for k, _ in ROWS)
    for key in (*(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "p99")),
                "request_throughput", "output_throughput", "duration"):
        row = rows[key]
        assert row["real"] is not None and row["sim"] is not None, key
        assert row["rel_error"] == pytest.approx((row["sim"] - row["real"]) / row["real"]), key
        assert row["real"] == pytest.approx(real[key]) and row["sim"] == pytest.approx(sim[key]), key
    text = (out / "comparison.txt").read_text()
    assert all(label in text for _, label in ROWS) and "p99 TTFT (ms)" in printed


def test_a_file_dataset_takes_the_files_lengths(tmp_path):
    from testbed.app.vllm_bench import main

    real = json.loads(FIXTURE.read_text())
    real["input_lens"] = [p + 7 for p in real["input_lens"]]  # not what the seed draws: must come from the file
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(real))
    assert main([str(path), "--dataset-name", "sharegpt", "--seed", "42", "--out", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "vllm_bench.json").read_text())["input_lens"] == real["input_lens"]


def _bad(tmp_path, change, extra=()) -> subprocess.CompletedProcess:
    real = json.loads(FIXTURE.read_text())
    change(real)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(real))
    command = script_command("testbed-vllm-bench", [str(path), *ARGS, *extra, "--out", str(tmp_path / "o")])
    return subprocess.run(command,
                          capture_output=True, text=True, env=environment(), cwd=tmp_path, timeout=300)


def test_a_missing_key_is_named_and_exits_2(tmp_path):
    done = _bad(tmp_path, lambda r: r.pop("num_prompts"))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert "'num_prompts' is missing" in done.stderr


@pytest.mark.parametrize("key, value, says", [
    ("completed", "50", "'completed' must be int"),
    ("request_rate", "fast", "'request_rate' must be a number or \"inf\""),
    ("mean_ttft_ms", [1.0], "'mean_ttft_ms' must be number"),
    ("input_lens", [1, 2], "'input_lens' has 2 entries for num_prompts=50"),
    ("max_concurrency", 8, "'max_concurrency' is 8: the replay is open-loop"),
])
def test_a_wrong_value_is_named_and_exits_2(tmp_path, capsys, key, value, says):
    from testbed.app.vllm_bench import main

    real = json.loads(FIXTURE.read_text())
    real[key] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(real))
    assert main([str(path), *ARGS, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_a_file_dataset_without_its_lengths_and_an_unknown_model_exit_2(tmp_path, capsys):
    from testbed.app.vllm_bench import main

    real = json.loads(FIXTURE.read_text())
    del real["input_lens"]
    (tmp_path / "a.json").write_text(json.dumps(real))
    assert main([str(tmp_path / "a.json"), "--dataset-name", "sharegpt"]) == 2
    assert "'input_lens' is missing" in capsys.readouterr().err
    real = json.loads(FIXTURE.read_text())
    real["model_id"] = "acme/NoSuchModel-9B"
    (tmp_path / "b.json").write_text(json.dumps(real))
    assert main([str(tmp_path / "b.json"), *ARGS]) == 2
    assert "'acme/NoSuchModel-9B': no model config has this hf_id" in capsys.readouterr().err
    assert main([str(tmp_path / "b.json"), *ARGS, "model=llama3_1_8b", "--request-rate", "8"]) == 2
    assert "--request-rate=8.0: the result file says request_rate=4.0" in capsys.readouterr().err
