"""A sweep's output: one bar across its jobs, one line per job, a readable table at the end, and the
names of a job that failed before writing its resolved config."""
from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from test_cli import run_cli

from testbed.app.reports.sweep import format_sweep, trace_name
from testbed.app.reports.sweep_progress import Watch, job_line, plan_sweep, read_plan, record_job_end, write_plan


def test_plan_counts_jobs_and_names_the_swept_keys():
    plan = plan_sweep(["policy=vllm,static", "trace.rate_scale=1,2,4", "trace.max_requests=50"],
                      {"trace": "azure_conv,azure_code"}, basic_sweeper=True, experiment="x")
    assert plan.jobs == 2 * 3 * 2
    assert plan.swept == ["trace", "policy", "trace.rate_scale"] and plan.experiment == "x"
    assert plan_sweep(["policy=vllm,static"], None, basic_sweeper=False).jobs is None  # another sweeper decides


def test_watch_prints_one_line_per_job_as_records_arrive(tmp_path, capsys):
    plan = plan_sweep(["policy=vllm,static", "seed=1"], None, basic_sweeper=True)
    write_plan(tmp_path, plan)
    assert read_plan(tmp_path) == plan
    summaries = {"a": ("ok", {"num_requests": 60, "completed": 60, "p99_ttft_ms": 1234.56, "slo_attainment": 0.5}),
                 "b": ("failed: ValueError: kv.num_blocks=0", {})}
    watch = Watch(tmp_path, plan, lambda job: summaries[job.name], bar=False, interval_s=3600)
    record_job_end(tmp_path, 1, tmp_path / "b", ["policy=static", "seed=1"], skipped=False)
    watch.poll()
    record_job_end(tmp_path, 0, tmp_path / "a", ["policy=vllm", "seed=1"], skipped=True)
    watch.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[1/2] #1 policy=static: failed: ValueError: kv.num_blocks=0",
                     "[2/2] #0 policy=vllm: skipped: its results were already there  60/60 done  "
                     "p99 TTFT 1,234.6 ms  SLO 50.0%"]
    write_plan(tmp_path, plan)  # a rerun of the sweep starts with no job ended
    assert not list((tmp_path / ".jobs").glob("*.json"))


def test_job_line_without_a_known_plan_shows_every_override():
    line = job_line({"num": 3, "overrides": ["a=1", "b=2"]}, 4, None, None, "ok", {})
    assert line == "[4] #3 a=1 b=2: ok  "


def test_the_printed_table_fits_and_formats_each_column_one_way():
    df = pd.DataFrame({"job": ["0_policy=vllm", "1_policy=static", "10_policy=edf"],
                       "overrides": ["policy=vllm trace.rate_scale=0.25", "policy=static trace.rate_scale=1",
                                     "policy=edf trace.rate_scale=4"],
                       "status": ["ok", "failed: ValueError: a long reason that goes on and on and on", "ok"],
                       "completed": [19366, None, 7], "median_ttft_ms": [27.381, None, 123456.7],
                       "p99_ttft_ms": [98.08, None, 3.0], "slo_attainment": [1.0, None, 0.8512],
                       "request_throughput": [2.198765, None, 1e-5], "policy": ["vllm", "static", "edf"]})
    text = format_sweep(df, ["policy", "trace.rate_scale"])
    lines = text.splitlines()
    assert max(map(len, lines)) <= 120, text
    assert lines[0].split()[:4] == ["#", "policy", "rate_scale", "status"]
    rows = [line.split() for line in lines[2:5]]
    assert [r[0] for r in rows] == ["0", "1", "10"]  # by job number, not as strings
    assert rows[0][1:3] == ["vllm", "0.25"] and rows[2][1:3] == ["edf", "4"]
    assert "19,366" in text and "123,456.7" in text and "100.0%" in text and "85.1%" in text and "0.00" in text
    assert "e-05" not in text and "e+" not in text and "…" in lines[3]  # no mixed notation; a long status cut


def test_an_unresolved_trace_name_is_resolved_or_the_groups_own():
    interp = "${trace_name:azure_code,${.path},azure_llm_2023/code.csv}"
    assert trace_name({"name": interp, "path": "azure_llm_2023/code.csv"}) == "azure_code"
    assert trace_name({"name": interp, "path": "/data/day1.csv"}) == "day1"
    assert trace_name({"name": interp}) == "azure_code"  # its path missing: the group's configured name
    assert trace_name({"name": "mine"}) == "mine"


@pytest.mark.parametrize("launcher", ["basic", "local_parallel"])
def test_a_sweep_prints_a_bar_a_line_per_job_and_one_table(tmp_path, launcher):
    """Sequential (Hydra's basic launcher, jobs in the command's process) and joblib's workers alike. The
    failed job failed before writing its resolved config: its trace is still named in the table."""
    sweep = tmp_path / "sweep"
    proc = run_cli(["-m", f"hydra/launcher={launcher}", "kv.num_blocks=4000,0", "trace.max_requests=60",
                    f"hydra.sweep.dir={sweep}", "output.progress=true"], cwd=tmp_path, check=False)
    out = proc.stdout
    assert proc.returncode != 0, out + proc.stderr  # a job failed: the sweep says so
    lines = [line for line in out.splitlines() if re.match(r"\[\d/2\] #\d ", line)]
    assert len(lines) == 2, out
    by_job = {line.split()[1]: line for line in lines}
    assert "#0 kv.num_blocks=4000: ok  60/60 done" in by_job["#0"] and "p99 TTFT" in by_job["#0"]
    assert "#1 kv.num_blocks=0: failed: " in by_job["#1"]
    assert "TTFT ms " not in out and "validated configuration" not in out  # no job's own table
    assert "2/2" in proc.stderr.replace("\r", "\n").splitlines()[-1] or "2/2 [" in proc.stderr
    table = out[out.index("sweep: 2 jobs, 1 not ok"):out.index("latencies in ms")].splitlines()[1:]
    assert len(table) == 4  # header, rule, two jobs (then each job not ok, whole, on its own line)
    assert table[0].split()[:3] == ["#", "num_blocks", "status"] and all(len(x) <= 120 for x in table)
    merged = pd.read_csv(sweep / "sweep_summary.csv").set_index("job").sort_index()
    assert list(merged.trace) == ["azure_conv", "azure_conv"]  # not `${trace_name:...}`
    assert merged.status.iloc[1].startswith("failed") and merged.status.iloc[0] == "ok"
    assert json.loads((sweep / ".sweep.json").read_text())["jobs"] == 2
