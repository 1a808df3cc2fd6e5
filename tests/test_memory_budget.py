"""A run that cannot fit in memory is refused at start, naming the key and the estimate (issue 25:
backend.replicas=5000 took 21.7 GB for 200 requests and the OOM killer ended it)."""
from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import tracemalloc

import pytest
from hydra import compose, initialize_config_dir

from testbed.app.assembly import memory_budget
from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.memory_budget import MemoryBudgetError, check_fits, replica_term, request_term
from testbed.app.assembly.run import simulate
from testbed.app.assembly.run_setup import check_memory, prepare, resolve_model_spec

FAST = ["logger=none", "output.progress=false", "cost_model=roofline"]


def cfg_for(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=[*FAST, *overrides])


def test_huge_replica_count_is_refused_before_anything_is_built():
    """A million replicas of Llama-3.1-8B on an H100 would hold 4.6 TB of KV bookkeeping: refused, on any
    machine, before a replica is built, naming backend.replicas and the estimate."""
    with pytest.raises(MemoryBudgetError, match=r"^backend\.replicas=1000000: the run would hold about 1,971 GB"):
        simulate(cfg_for("backend.replicas=1000000", "trace.max_requests=200"))


def test_the_budget_key_sets_the_limit_and_names_itself():
    cfg = cfg_for("backend.replicas=5000", "trace.max_requests=200", "backend.memory_budget_gb=5")
    with pytest.raises(MemoryBudgetError) as e:
        check_memory(cfg, resolve_model_spec(cfg.model))
    msg = str(e.value)
    assert msg.startswith("backend.replicas=5000: the run would hold about 9.86 GB (")
    assert "5000 replicas x 26197 KV blocks" in msg and "backend.memory_budget_gb=5" in msg
    check_memory(cfg_for("backend.replicas=5000", "trace.max_requests=200", "backend.memory_budget_gb=30"),
                 resolve_model_spec(cfg.model))  # a budget that holds it lets it run


def test_the_largest_term_is_named_requests_or_disagg_pools():
    cfg = cfg_for("trace=servegen", "trace.servegen_rate_scale=1000000")  # every arrival of the hour: 1e10
    with pytest.raises(MemoryBudgetError, match=r"^trace\.servegen_rate_scale=1000000\.0: .* 10,284,000,000 requests"):
        check_memory(cfg, resolve_model_spec(cfg.model))
    cut = cfg_for("trace=servegen", "trace.servegen_rate_scale=1000000", "trace.max_requests=1000")
    check_memory(cut, resolve_model_spec(cut.model))  # the generator stops at the cut: it fits
    disagg = cfg_for("disagg.enabled=true", "disagg.prefill.replicas=2000", "trace.max_requests=20",
                     "backend.memory_budget_gb=0.2", "backend.async_scheduling=false")
    with pytest.raises(MemoryBudgetError, match=r"^disagg\.prefill\.replicas=2000: "):
        simulate(disagg)


def test_a_normal_run_passes_and_the_estimate_matches_what_a_replica_holds():
    cfg = cfg_for("trace.max_requests=20", "backend.replicas=3")
    r = simulate(cfg)  # the machine's own budget
    assert r.summary["num_requests"] == 20
    setup = prepare(cfg)
    gc.collect()
    tracemalloc.start()
    loops = [setup.make_loop(cfg) for _ in range(3)]
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    estimate = replica_term("backend.replicas", 3, setup.device_blocks).bytes
    assert 0.8 * estimate <= held <= estimate, (held, estimate)
    assert len(loops) == 3


def test_available_memory_is_read_from_the_machine():
    room, source = memory_budget.available_bytes()
    if not os.path.exists("/proc/meminfo"):
        assert room == math.inf
        return
    assert 0 < room < math.inf and ("MemAvailable" in source or "cgroup" in source)
    assert check_fits([request_term("trace.max_requests", 10, 10)], None) == 10 * memory_budget.BYTES_PER_REQUEST


def test_testbed_sim_refuses_at_start_with_the_message(tmp_path):
    """The console script: exit 2 (a user error) with the message, no result folder written past the config."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    out = subprocess.run([sys.executable, "-m", "testbed", *FAST, "backend.replicas=100000", "trace.max_requests=10",
                          f"output.dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'hydra'}"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "backend.replicas=100000: the run would hold about 197 GB" in out.stderr
    assert not (tmp_path / "run" / "summary.json").exists()
