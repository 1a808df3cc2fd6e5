"""A user's own `traces/`, `policies/`, `engine/` or `conf/` folder in the working directory does not
shadow the testbed: every layer is a subpackage of `testbed`, so under `python -m testbed` (which
puts the working directory first on sys.path) and in `local_processes` sweep workers the
package's own modules load, not the user's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

USER_FOLDERS = ("traces", "policies", "engine", "conf", "core", "app", "sim")


@pytest.fixture
def crowded_dir(tmp_path: Path) -> Path:
    """A working directory holding importable folders named like the testbed's layers, each of which
    fails loudly if it is ever imported."""
    for name in USER_FOLDERS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('the user folder {name}/ was imported')\n")
    (tmp_path / "conf" / "config.yaml").write_text("defaults: []\nbogus: true\n")
    return tmp_path


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    return subprocess.run([sys.executable, "-m", "testbed", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=300)


def test_python_m_testbed_ignores_users_folders(crowded_dir):
    proc = _run(["trace.max_requests=30", "output.dir=out"], crowded_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((crowded_dir / "out" / "summary.json").read_text())
    assert summary["num_requests"] == 30 and summary["completed"] == 30


def test_local_processes_sweep_workers_ignore_users_folders(crowded_dir):
    proc = _run(["-m", "hydra/launcher=local_processes", "policy=vllm,static", "trace.max_requests=20",
                 "hydra.sweep.dir=sweep"], crowded_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted((crowded_dir / "sweep").glob("*/summary.json"))
    assert len(jobs) == 2
    assert all(json.loads(j.read_text())["completed"] == 20 for j in jobs)
