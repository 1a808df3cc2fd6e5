"""One rule for lenient loading (issue 25): trace.lenient=true counts bad rows and does not stop, even when
every row is bad: the run exits 0 with results that count the rows and serve no request; strict mode stops
at the first bad row, naming it."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pandas as pd

BAD = "TIMESTAMP,ContextTokens,GeneratedTokens\nx,1,2\n2023-11-16 18:15:46.6805900,abc,3\n"
FAST = ["logger=none", "output.progress=false", "cost_model=roofline", "output.print_table=false", "trace=azure_conv"]


def run_sim(tmp_path, *args):
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", "testbed", *FAST, f"hydra.run.dir={tmp_path / 'hydra'}", *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_lenient_run_of_only_bad_rows_exits_0_with_results_that_count_them(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text(BAD)
    out = tmp_path / "sweep" / "0_lenient"
    proc = run_sim(tmp_path, f"trace.path={bad}", "trace.lenient=true", f"output.dir={out}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout + proc.stderr  # Hydra's log goes to stdout
    assert "all 2 rows selected from" in said and "were rejected" in said
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["num_requests"], summary["completed"], summary["rejected"]) == (2, 0, 2)
    assert summary["reject_reasons"] == {"invalid-row": 2} and summary["request_throughput"] == 0.0
    assert summary["p99_ttft_ms"] is None and summary["mean_e2el_ms"] is None
    table = pd.read_parquet(out / "requests.parquet")
    assert len(table) == 2 and set(table["outcome"]) == {"rejected"} and table["ttft_ms"].isna().all()
    assert {"id", "source", "replica", "ttft_ms", "tpot_ms", "e2el_ms"} <= set(table.columns)
    assert (out / "steps.parquet").exists() and len(pd.read_parquet(out / "steps.parquet")) == 0

    # strict: the first bad row stops the load, naming it
    strict = run_sim(tmp_path, f"trace.path={bad}", f"output.dir={tmp_path / 'strict'}")
    assert strict.returncode == 2, strict.stdout[-2000:]  # a user error (app/entry/user_errors.py)
    assert "bad.csv:2: field 'TIMESTAMP': unparseable time 'x'" in strict.stderr and not (tmp_path / "strict" / "summary.json").exists()

    # a sweep holding such a run: its merged table and testbed-report take it
    from testbed.app.reports.report import build_report
    from testbed.app.reports.sweep import write_sweep_table

    ok = run_sim(tmp_path, "trace.max_requests=5", f"output.dir={tmp_path / 'sweep' / '1_ok'}")
    assert ok.returncode == 0, ok.stderr[-2000:]
    merged = write_sweep_table(tmp_path / "sweep").set_index("job")
    assert list(merged["status"]) == ["ok", "ok"] and merged.loc["0_lenient", "completed"] == 0
    assert merged.loc["0_lenient", "rejected"] == 2 and math.isnan(merged.loc["0_lenient", "p99_ttft_ms"])
    page = build_report(tmp_path / "sweep")
    assert page.read_text().split("<tbody>")[-1].count("<tr") == 2  # both jobs in its merged table
