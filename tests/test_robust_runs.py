"""Runs and sweeps that survive interruption and failure: reruns redo what did not finish,
signals keep the finished requests' results, a stall says so, a killed sweep job loses only itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TINY = ["trace.max_requests=50", "output.print_table=false"]


def run_testbed(args, cwd, **kw):
    """`python -m testbed ARGS` (the checkout's code, whatever console script is installed)."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=120, **kw)


@pytest.mark.parametrize("flag", ["interrupted", "stalled"])
def test_rerun_redoes_a_partial_run(tmp_path, flag):
    out = tmp_path / "run"
    args = TINY + [f"output.dir={out}"]
    assert run_testbed(args, tmp_path).returncode == 0
    summary = out / "summary.json"
    partial = json.loads(summary.read_text())
    partial[flag] = True  # what an interrupted (or stalled) run of this config leaves behind
    summary.write_text(json.dumps(partial))
    again = run_testbed(args, tmp_path)
    assert again.returncode == 0, again.stderr
    assert "skipped" not in again.stdout
    assert json.loads(summary.read_text())[flag] is False  # redone, complete
    third = run_testbed(args, tmp_path)
    assert "skipped" in third.stdout  # a complete run is still skipped
