"""A sweep's job folders: one each, directly in the sweep folder, whatever the overrides' values
(issue 25 item 1: a file path's '/' nested the folder and '..' climbed out of it, so jobs overwrote
each other, wrote outside the sweep, and the sweep's table found none of them)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yaml

from testbed.app.entry.job_dirs import MAX_CHARS, safe_dirname
from testbed.traces.loaders import DATA_DIR

BUNDLED = "azure_llm_2023/AzureLLMInferenceTrace_conv.csv"


def run_cli(args, cwd):
    exe = shutil.which("testbed-sim")
    cmd = [exe] if exe else [sys.executable, "-m", "testbed"]
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(cmd + list(args), cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


def small_trace(path: Path, rows: int = 30) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (DATA_DIR / BUNDLED).read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:rows + 1]))
    return path


def job_folders(sweep: Path) -> list[Path]:
    return sorted(d for d in sweep.iterdir() if d.is_dir() and not d.name.startswith("."))


def test_safe_dirname_is_one_readable_component():
    for value in ("trace.path=/data/x.csv", "trace.path=../../d/x.csv", "trace.path=..", "a=b\\c:d*e?\"f\"<g>|h",
                  "trace.name='a b',x=é", "k=" + "v/" * 300, ".."):
        name = safe_dirname(value)
        assert "/" not in name and "\\" not in name and name not in ("", ".", "..") and not name.endswith(".")
        assert len(name) <= MAX_CHARS and name.isascii() and Path(name).name == name
    assert safe_dirname("policy=vllm,trace.path=azure_llm_2023/x.csv") == "policy=vllm,trace.path=azure_llm_2023_x.csv"
    assert safe_dirname("policy=static,trace.rate_scale=2") == "policy=static,trace.rate_scale=2"  # plain ones unchanged
    assert safe_dirname("") == ""
    long_a, long_b = "trace.path=/" + "d" * 200 + "/a.csv", "trace.path=/" + "d" * 200 + "/b.csv"
    assert safe_dirname(long_a) != safe_dirname(long_b)  # cut names still differ where the overrides do
    assert safe_dirname(long_a).startswith("trace.path=_ddd")


def test_sweep_over_trace_paths_keeps_every_job_inside_the_sweep(tmp_path):
    """Relative (bundled), with '..' (enough to climb out of the sweep folder under the old names)
    and absolute trace paths, under two policies: six jobs, six folders directly in the sweep folder,
    and a table of all six. Before the fix both policies' '..' jobs wrote one folder outside the sweep,
    and the sweep's table found no job folder at all (every folder was nested)."""
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    mine = small_trace(tmp_path / "x" / "t.csv")
    paths = [BUNDLED, "../../x/t.csv", str(mine)]
    sweep = work / "sweep"
    proc = run_cli(["-m", "policy=vllm,static", "trace.path=" + ",".join(paths), "trace.max_requests=25",
                    f"hydra.sweep.dir={sweep}", "output.print_table=false", "output.write_steps=false"], cwd=work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in work.iterdir()) == ["sweep"]  # nothing written beside the sweep
    assert sorted(p.name for p in (tmp_path / "x").iterdir()) == ["t.csv"]
    jobs = job_folders(sweep)
    assert len(jobs) == 6, [str(p.relative_to(sweep)) for p in sweep.rglob("summary.json")]
    assert sorted(int(j.name.split("_", 1)[0]) for j in jobs) == list(range(6))
    for job in jobs:  # results, the resolved config and Hydra's record of the job, all in the job's one folder
        assert (job / "summary.json").is_file() and (job / "config.yaml").is_file()
        assert (job / ".hydra" / "overrides.yaml").is_file()
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        config = yaml.safe_load((job / "config.yaml").read_text())
        assert f"policy={config['policy']['name']}" in overrides and f"trace.path={config['trace']['path']}" in overrides
        assert config["output"]["dir"] == str(job.resolve())
    assert any("AzureLLMInferenceTrace_conv.csv" in j.name for j in jobs)  # still readable
    got = {(json.loads((j / "summary.json").read_text())["policy"],
            yaml.safe_load((j / "config.yaml").read_text())["trace"]["path"]) for j in jobs}
    assert got == {(p, t) for p in ("vllm", "static") for t in paths}

    table = pd.read_csv(sweep / "sweep_summary.csv")
    assert len(table) == 6 and set(table.status) == {"ok"}
    assert sorted(table.job) == sorted(j.name for j in jobs)
    assert {(p, dict(o.split("=", 1) for o in overrides.split())["trace.path"])
            for p, overrides in zip(table.policy, table.overrides)} == got
    assert len(pd.read_parquet(sweep / "sweep_summary.parquet")) == 6
    assert "sweep: 6 jobs" in proc.stdout


def test_sweep_over_trace_paths_with_a_failing_job_tables_every_job(tmp_path):
    """One trace path is missing: that job fails alone, its failure recorded in its own folder, and the
    table lists both jobs with their status (before the fix: no table, every folder nested or outside)."""
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    mine = small_trace(tmp_path / "x" / "t.csv")
    sweep = work / "sweep"
    proc = run_cli(["-m", f"trace.path={mine},../../x/missing.csv", "trace.max_requests=20",
                    f"hydra.sweep.dir={sweep}", "output.print_table=false", "output.write_steps=false"], cwd=work)
    assert proc.returncode != 0
    assert sorted(p.name for p in work.iterdir()) == ["sweep"]
    jobs = job_folders(sweep)
    assert len(jobs) == 2, proc.stdout + proc.stderr
    assert (jobs[0] / "summary.json").is_file() and (jobs[1] / "failed.json").is_file()
    table = pd.read_csv(sweep / "sweep_summary.csv").sort_values("job")
    assert list(table.job) == [j.name for j in jobs]
    assert table.status.iloc[0] == "ok"
    assert table.status.iloc[1].startswith("failed: ") and "missing.csv" in table.status.iloc[1]
    assert "sweep: 2 jobs, 1 not ok" in proc.stdout


def test_table_finds_job_folders_a_subdir_of_ones_own_nests(tmp_path):
    """A `hydra.sweep.subdir` set by hand may still nest a job's folder: the table lists it, by its path
    in the sweep folder, beside the plain ones (it looked at the sweep folder's own children only)."""
    from testbed.app.analysis.results import record_failure
    from testbed.app.reports.sweep import write_sweep_table

    sweep = tmp_path / "sweep"
    plain, nested = sweep / "0_policy=vllm", sweep / "1_trace.path=data" / "t.csv"
    for job, overrides in ((plain, ["policy=vllm"]), (nested, ["trace.path=data/t.csv"])):
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (plain / "summary.json").write_text(json.dumps({"policy": "vllm", "completed": 3}))
    record_failure(nested, "FileNotFoundError: data/t.csv")
    (nested / "inner").mkdir()  # a job's own folders are not jobs
    (nested / "inner" / "summary.json").write_text("{}")
    (sweep / ".submitit" / "1").mkdir(parents=True)  # nor are hidden ones
    (sweep / ".submitit" / "1" / "summary.json").write_text("{}")
    (sweep / "report_figures").mkdir()
    (sweep / "loop").symlink_to(sweep)
    table = write_sweep_table(sweep).set_index("job")
    assert sorted(table.index) == ["0_policy=vllm", "1_trace.path=data/t.csv"]
    assert table.status["0_policy=vllm"] == "ok"
    assert table.status["1_trace.path=data/t.csv"] == "failed: FileNotFoundError: data/t.csv"
    assert table.overrides["1_trace.path=data/t.csv"] == "trace.path=data/t.csv"
    assert len(pd.read_csv(sweep / "sweep_summary.csv")) == 2
