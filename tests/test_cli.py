"""The console script and Hydra: any directory, typed config errors, multirun, reproducibility."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

SMALL = ["trace.max_requests=300", "output.print_table=true"]


def run_cli(args, cwd, check=True):
    exe = shutil.which("testbed-sim")
    cmd = [exe] if exe else [sys.executable, "-m", "testbed"]
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run(cmd + list(args), cwd=cwd, capture_output=True, text=True, env=env, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_console_script_from_another_directory(tmp_path):
    assert shutil.which("testbed-sim"), "the testbed-sim console script is not installed"
    proc = run_cli(SMALL + [f"output.dir={tmp_path}/run"], cwd=tmp_path)
    assert "TTFT ms" in proc.stdout and "300 = " in proc.stdout
    out = tmp_path / "run"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_requests"] == 300
    assert summary["completed"] + summary["rejected"] + summary["unfinished"] == 300
    assert (out / "config.yaml").read_text().count("\npolicy:") == 1
    table = pd.read_parquet(out / "requests.parquet")
    assert len(table) == 300 and set(table.outcome) <= {"finished", "rejected", "unfinished"}
    steps = pd.read_parquet(out / "steps.parquet")
    assert steps.steps.sum() == summary["num_steps"] and len(steps) > 0


def test_same_config_same_summary_bytes(tmp_path):
    for name in ("a", "b"):
        run_cli(SMALL + ["policy=static", f"output.dir={tmp_path}/{name}"], cwd=tmp_path)
    a = (tmp_path / "a" / "summary.json").read_bytes()
    assert a == (tmp_path / "b" / "summary.json").read_bytes()


@pytest.mark.parametrize("override, words", [
    ("policy.chunked_prefil=false", "chunked_prefil"),
    ("scheduler.max_num_seqs=lots", "max_num_seqs"),
    ("policy=nosuch", "nosuch"),
    ("kv.block_size=0", "kv.block_size"),
])
def test_config_errors_are_clear(tmp_path, override, words):
    proc = run_cli(SMALL + [override, f"output.dir={tmp_path}/x"], cwd=tmp_path, check=False)
    assert proc.returncode != 0
    assert words in proc.stderr + proc.stdout


def test_small_multirun(tmp_path):
    proc = run_cli(["-m", "policy=vllm,static", "trace.rate_scale=1,2", "trace.max_requests=100",
                    f"hydra.sweep.dir={tmp_path}/sweep", "output.print_table=false"], cwd=tmp_path)
    summaries = sorted((tmp_path / "sweep").glob("*/summary.json"))
    assert len(summaries) == 4, proc.stdout + proc.stderr
    got = {(s["policy"], s["num_requests"]) for s in map(lambda p: json.loads(p.read_text()), summaries)}
    assert got == {("vllm", 100), ("static", 100)}
    merged = pd.read_csv(tmp_path / "sweep" / "sweep_summary.csv")
    assert len(merged) == 4 and set(merged.policy) == {"vllm", "static"}
    assert sorted(merged.rate_scale) == [1, 1, 2, 2]
    assert "sweep: 4 jobs" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[") and "/4] #" in line]
    assert sorted(line.split()[1] for line in lines) == ["#0", "#1", "#2", "#3"]  # one line per job, as it ends
    assert all(": ok  100/100 done" in line for line in lines), proc.stdout

    # the HTML report of that sweep: every plot is a real, non-blank image, embedded in the page
    import matplotlib.image as mpimg
    import numpy as np

    from testbed.app.reports.report import build_report

    page = build_report(tmp_path / "sweep")
    pngs = sorted((tmp_path / "sweep" / "report_figures").glob("*.png"))
    assert len(pngs) == 7  # six metrics against load, and the CDFs
    for png in pngs:
        img = mpimg.imread(png)[..., :3]
        assert (img < 0.9).mean() > 0.01, f"{png.name} is blank"
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 7 and "<table" in text and "static" in text
    assert "4 jobs plotted; policies: vllm, static." in text  # the constant trace.max_requests=100 is not a label


def test_fast_forward_changes_nothing(tmp_path):
    from hydra import compose, initialize_config_dir

    from testbed.app.entry.cli import CONF_DIR
    from testbed.app.assembly.run import simulate

    results = {}
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        for ff in (True, False):
            cfg = compose("config", overrides=["trace.max_requests=1500", "trace.rate_scale=4",
                                               f"backend.fast_forward={ff}", "kv.num_blocks=3000"])
            results[ff] = simulate(cfg)
    on, off = results[True], results[False]
    assert on.requests.equals(off.requests)
    assert on.summary["num_preemptions"] > 0  # KV pressure: the run mixes preemption with decode runs
    drop = ("num_events",)
    assert {k: v for k, v in on.summary.items() if k not in drop} == {k: v for k, v in off.summary.items() if k not in drop}
    assert on.summary["num_steps"] == off.summary["num_steps"] == int(off.steps.steps.sum())
    assert len(on.steps) < len(off.steps)


def test_lenient_rejected_rows_are_accounted(tmp_path):
    from hydra import compose, initialize_config_dir

    from testbed.app.entry.cli import CONF_DIR
    from testbed.app.assembly.run import simulate

    f = tmp_path / "t.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0000000,100,5\n"
                 "2023-11-16 18:00:01.0000000,-3,5\n2023-11-16 18:00:02.0000000,100,5\n")
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        strict = compose("config", overrides=[f"trace.path={f}"])
        lenient = compose("config", overrides=[f"trace.path={f}", "trace.lenient=true"])
    with pytest.raises(ValueError, match=r"t.csv:3: field 'ContextTokens'"):
        simulate(strict)
    r = simulate(lenient)
    assert (r.summary["num_requests"], r.summary["completed"], r.summary["rejected"]) == (3, 2, 1)
    row = r.requests.set_index("id").loc[1]
    assert row.outcome == "rejected" and "t.csv:3" == row.source and "negative" in row.reason
    assert r.summary["reject_reasons"] == {"invalid-row": 1}


def test_failed_job_keeps_the_others_and_rerun_skips_finished(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "kv.num_blocks=4000,0,3000", "trace.max_requests=80", f"hydra.sweep.dir={sweep}",
            "hydra.sweep.subdir=${hydra.job.num}", "output.print_table=false"]
    first = run_cli(args, cwd=tmp_path, check=False)
    assert first.returncode != 0 and "kv.num_blocks=0" in first.stdout + first.stderr
    done = sorted(p.parent.name for p in sweep.glob("*/summary.json"))
    assert done == ["0", "2"]  # the failed job lost nothing but itself
    stamp = (sweep / "0" / "summary.json").stat().st_mtime_ns
    again = run_cli(args, cwd=tmp_path, check=False)
    assert again.stdout.count("skipped:") == 2
    assert (sweep / "0" / "summary.json").stat().st_mtime_ns == stamp


def test_capacity_command(tmp_path):
    exe = shutil.which("testbed-capacity")
    assert exe, "the testbed-capacity console script is not installed"
    proc = subprocess.run([exe, "trace.max_requests=400", "capacity.rel_tol=0.1", "capacity.hi=16",
                           f"output.dir={tmp_path}/cap"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "cap" / "capacity.json").read_text())
    assert res["bracketed"] and res["max_rate_scale"] is not None
    curve = {p["rate_scale"]: p["slo_attainment"] for p in res["curve"]}
    assert curve[res["max_rate_scale"]] >= 0.9 and min(curve.values()) < 0.9


def test_submitit_local_launcher(tmp_path):
    """submitit's local executor (each job its own process, as SLURM runs it): hydra-submitit-launcher is in
    the [dev] extra, so CI runs this, never skips it."""
    import hydra_plugins.hydra_submitit_launcher  # noqa: F401  (missing: pip install -e '.[dev]')

    proc = run_cli(["-m", "hydra/launcher=local_processes", "policy=vllm,static", "trace.max_requests=60",
                    f"hydra.sweep.dir={tmp_path}/sweep"], cwd=tmp_path)
    _assert_two_policy_sweep(tmp_path / "sweep", proc.stdout)


def test_ray_launcher_on_a_local_instance(tmp_path):
    """Our Ray 2.x launcher (hydra_plugins/testbed_ray_launcher) on a Ray instance of the sweep's own, two
    CPUs, no dashboard. Ray is in the [dev] extra, so CI runs this, never skips it."""
    import ray  # noqa: F401  (missing: pip install -e '.[dev]', or '.[ray]')

    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run([sys.executable, "-m", "testbed", "-m", "hydra/launcher=ray", "hydra.launcher.init.num_cpus=2",
                           "policy=vllm,static", "trace.max_requests=60", f"hydra.sweep.dir={tmp_path}/sweep"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "Ray (a local instance) is launching 2 jobs" in proc.stdout
    _assert_two_policy_sweep(tmp_path / "sweep", proc.stdout)


def _assert_two_policy_sweep(sweep: Path, out: str) -> None:
    """Both jobs of `-m policy=vllm,static` ran, each in the folder of its own number, and the command
    gathered them: a line each and the table."""
    for job, policy in (("0", "vllm"), ("1", "static")):
        [summary] = [json.loads(p.read_text()) for p in sweep.glob(f"{job}_*/summary.json")]
        assert summary["policy"] == policy and summary["completed"] == 60
        assert f"#{job} policy={policy}: ok  60/60 done" in out, out
    table = pd.read_csv(sweep / "sweep_summary.csv")
    assert sorted(table.policy) == ["static", "vllm"] and set(table.status) == {"ok"}


def test_report_series_separate_swept_knobs():
    from testbed.app.reports.report import series_components, series_label
    from testbed.app.reports.report_sweep import label_keys

    df = pd.DataFrame({"policy": ["sarathi", "sarathi"], "policy_config": ["sarathi", "sarathi"],
                       "overrides": ["policy.token_budget=128 trace.rate_scale=1 trace.max_requests=9",
                                     "policy.token_budget=256 trace.rate_scale=1 trace.max_requests=9"]})
    keys = label_keys(["policy.token_budget", "trace.rate_scale"])  # what the sweep swept; load is the x axis
    assert [series_label(c) for c in series_components(df, keys)] == ["128", "256"]
    # an experiment's sub-preset (cluster size with its load) is the x axis, a router its own line
    keys = label_keys(["router", "experiment/router_mooncake"])
    df = pd.DataFrame({"policy": ["vllm"], "overrides": ["router=least_kv +experiment/router_mooncake=replicas8"]})
    assert [series_label(c) for c in series_components(df, keys)] == ["least_kv"]
    # nothing swept but load and trace: the policy's config name (sglang_lpm, not sglang)
    df = pd.DataFrame({"policy": ["sglang"], "policy_config": ["sglang_lpm"], "overrides": ["trace.rate_scale=1"]})
    assert [series_label(c) for c in series_components(df, label_keys(["trace.rate_scale"]))] == ["sglang_lpm"]
    df = pd.DataFrame({"policy": ["vllm"], "overrides": ["policy=vllm policy.token_budget=64"]})
    assert series_label(series_components(df, ["policy", "policy.token_budget"])[0]) == "vllm, token_budget=64"
