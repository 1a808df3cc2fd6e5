"""A rerun keys on the data, not only the config (issue 25 item 5): after a trace file is edited in
place, the rerun of the same command runs again, and its results are the new data's."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.inputs import INPUTS, changed_inputs, read_inputs, write_inputs
from testbed.traces.loaders import DATA_DIR

BUNDLED = DATA_DIR / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"


def run_cli(args, cwd):
    exe = shutil.which("testbed-sim")
    cmd = [exe] if exe else [sys.executable, "-m", "testbed"]
    proc = subprocess.run(cmd + list(args), cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "HYDRA_FULL_ERROR": "0"}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def write_trace(path: Path, rows: int) -> Path:
    lines = BUNDLED.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:rows + 1]))
    return path


def test_rerun_after_the_trace_changed_runs_again(tmp_path):
    trace = write_trace(tmp_path / "t.csv", 30)
    out = tmp_path / "run"
    args = [f"trace.path={trace}", f"output.dir={out}", "output.print_table=false", "output.write_steps=false"]
    run_cli(args, tmp_path)
    assert json.loads((out / "summary.json").read_text())["num_requests"] == 30

    same = run_cli(args, tmp_path)  # unchanged: skipped, the results untouched
    assert "skipped:" in same.stdout
    stamp = (out / "summary.json").stat().st_mtime_ns

    write_trace(trace, 20)  # the same path, other data
    again = run_cli(args, tmp_path)
    assert "skipped:" not in again.stdout
    assert f"rerunning: {out} holds the results of this config, but trace.path ({trace.resolve()}) changed since" \
        in again.stdout
    assert (out / "summary.json").stat().st_mtime_ns != stamp
    assert json.loads((out / "summary.json").read_text())["num_requests"] == 20  # the new data's results
    assert "skipped:" in run_cli(args, tmp_path).stdout  # and now those are the ones kept
    record = json.loads((out / INPUTS).read_text())["trace.path"]  # what the skip compared: beside the results
    assert [r["path"] for r in record] == [str(trace.resolve())] and record[0]["size"] == trace.stat().st_size


def compose_cfg(overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def test_every_file_a_run_reads_is_recorded(tmp_path):
    trace = write_trace(tmp_path / "t.csv", 5)
    cfg = compose_cfg(["trace=poisson", "trace.num_requests=5", f"trace.lengths_from={trace}",
                       "cost_model=profile", f"model.config_json={tmp_path}"])
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text("{}")
    got = read_inputs(cfg)
    assert sorted(got) == ["cost_model.profile", "model.config_json", "trace.lengths_from"]
    assert got["trace.lengths_from"][0]["path"] == str(trace.resolve())
    assert Path(got["cost_model.profile"][0]["path"]).name == "cpu_tiny_llama.csv"  # the shipped profile, as resolved
    assert [Path(r["path"]).name for r in got["model.config_json"]] == ["config.json", "generation_config.json"]
    bundled = read_inputs(compose_cfg([]))["trace.path"]  # a bundled trace, by its relative name
    assert bundled[0]["path"] == str(BUNDLED.resolve()) and len(bundled[0]["sha256"]) == 64
    servegen = read_inputs(compose_cfg(["trace=servegen"]))["trace.path"]  # a data folder: each of its files
    assert len(servegen) > 1 and all(r["size"] > 0 for r in servegen)
    assert read_inputs(compose_cfg([f"trace.path={tmp_path}/missing.csv"])) == {}  # the run names it itself


def test_a_touched_but_unchanged_file_is_still_the_same_input(tmp_path):
    trace = write_trace(tmp_path / "t.csv", 5)
    cfg = compose_cfg([f"trace.path={trace}"])
    write_inputs(tmp_path, read_inputs(cfg))
    os.utime(trace, ns=(1, 1))
    assert changed_inputs(tmp_path, read_inputs(cfg)) is None
    trace.write_text(trace.read_text().replace(",", ",1", 1))
    assert changed_inputs(tmp_path, read_inputs(cfg)) == f"trace.path ({trace.resolve()}) changed since"
    (tmp_path / INPUTS).unlink()
    assert "no record" in changed_inputs(tmp_path, read_inputs(cfg))
