"""The console scripts (pyproject.toml [project.scripts]), each its command run by `stop.run_command`.

They live here, apart from the commands' modules, so that the signal handlers (app/entry/stop.py) are in
place before a command imports Hydra, pandas or torch: a Ctrl-C or SIGTERM in the first seconds of a
command then ends it as one later does (exit 130 or 143, no traceback), instead of as a
KeyboardInterrupt in the middle of an import. This module imports nothing else (both import only the
standard library). `testbed-sim` ends its process without tearing its heap down (app/entry/one_shot.py).
"""
from __future__ import annotations

from testbed.app.entry.one_shot import run_once
from testbed.app.entry.stop import run_command


def sim() -> int | None:
    return run_once(lambda: run_command("testbed.app.entry.cli", "main", "testbed-sim"))


def capacity() -> int | None:
    return run_command("testbed.app.entry.cli", "capacity", "testbed-capacity")


def report() -> int | None:
    return run_command("testbed.app.reports.report", "main", "testbed-report")


def disagg_search() -> int | None:
    return run_command("testbed.app.analysis.disagg_search", "main", "testbed-disagg-search")


def profile() -> int | None:
    return run_command("testbed.app.profiling.profile", "main", "testbed-profile")


def fidelity() -> int | None:
    return run_command("testbed.app.analysis.fidelity", "main", "testbed-fidelity")


def referee() -> int | None:
    return run_command("testbed.app.analysis.referee", "main", "testbed-referee")


def validate() -> int | None:
    return run_command("testbed.app.analysis.validate_runs", "main", "testbed-validate")


def traces() -> int | None:
    return run_command("testbed.app.analysis.traces", "main", "testbed-traces")


def vllm_bench() -> int | None:
    return run_command("testbed.app.analysis.vllm_bench", "main", "testbed-vllm-bench")
