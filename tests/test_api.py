"""The Python API (testbed/api.py) is a second door to the command line's run: the same configs, the
same refusals with the same words, the same summaries and tables, and it reads back what either wrote."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from omegaconf import OmegaConf

import testbed
from testbed.app.entry import cli

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["trace.max_requests=120", "policy=sarathi", "backend.replicas=2"]


def run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`testbed-sim args` from this checkout, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "testbed", *args], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "run"
    run_cli(SMALL + [f"output.dir={out}"], cwd=out.parent)
    return out


def test_simulate_gives_the_cli_summary_and_tables(cli_run, tmp_path):
    res = testbed.simulate(SMALL, output_dir=tmp_path / "api")
    assert res.summary == json.loads((cli_run / "summary.json").read_text())
    assert res.summary["policy_config"] == "sarathi" and res.summary["num_requests"] == 120
    pd.testing.assert_frame_equal(res.requests, pd.read_parquet(cli_run / "requests.parquet"))
    pd.testing.assert_frame_equal(res.steps, pd.read_parquet(cli_run / "steps.parquet"))
    # the files are the command line's too; only where they were written differs
    cli_config = OmegaConf.load(cli_run / "config.yaml")
    cli_config.output.dir = str((tmp_path / "api").resolve())
    assert res.config == cli_config and res.output_dir == (tmp_path / "api").resolve()
    assert (tmp_path / "api" / "summary.json").read_bytes() == (cli_run / "summary.json").read_bytes()
    assert OmegaConf.load(tmp_path / "api" / ".hydra" / "overrides.yaml") == SMALL


def test_without_output_dir_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = testbed.simulate(["trace.max_requests=60", "policy=static"])
    assert list(tmp_path.iterdir()) == [] and res.output_dir is None
    assert OmegaConf.is_missing(res.config.output, "dir")
    assert len(res.requests) == 60 and res.summary["policy"] == "static"
    assert "static on azure_conv" in repr(res) and "not written" in repr(res)


def test_the_replica_table_adds_up_to_the_run(cli_run):
    res = testbed.load(cli_run)
    reps = res.replicas
    assert list(reps.replica) == [0, 1]
    assert reps.requests.sum() == (res.requests.replica >= 0).sum()
    assert reps.finished.sum() == res.summary["completed"]
    assert reps.steps.sum() == res.summary["num_steps"]
    assert reps.preemptions.sum() == res.requests.preemptions.sum()
    assert ((reps.utilization > 0) & (reps.utilization <= 1)).all()


def test_load_round_trips_a_cli_run_folder(cli_run):
    res = testbed.load(cli_run)
    assert isinstance(res, testbed.Results) and res.output_dir == cli_run
    assert res.summary == json.loads((cli_run / "summary.json").read_text())
    pd.testing.assert_frame_equal(res.requests, pd.read_parquet(cli_run / "requests.parquet"))
    pd.testing.assert_frame_equal(res.steps, pd.read_parquet(cli_run / "steps.parquet"))
    assert res.config == OmegaConf.load(cli_run / "config.yaml")


def test_load_refuses_a_folder_that_is_neither(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a run folder"):
        testbed.load(tmp_path)


BAD = [
    pytest.param(["+scheduler.max_num_seq=10"], "scheduler.max_num_seq: unknown key", id="unknown key with +"),
    pytest.param(["+kv.numblocks=5", "+trace.rate_scal=2"], "2 problem(s)", id="two unknown keys"),
    pytest.param(["policy.chunked_prefil=false"], "Could not override 'policy.chunked_prefil'", id="misspelt key"),
    pytest.param(["policy=nosuch"], "Could not find 'policy/nosuch'", id="bad group choice"),
    pytest.param(["kv.block_size=0"], "kv.block_size=0: must be >= 1", id="value out of range"),
    pytest.param(["scheduler.max_num_seqs=lots"], "max_num_seqs", id="wrong type"),
    pytest.param(["policy=orca", "+policy.max_batch_sise=3"], "policy.max_batch_sise: unknown key", id="policy knob"),
]


@pytest.mark.parametrize("overrides, words", BAD)
def test_the_api_refuses_what_the_cli_refuses_with_its_message(overrides, words, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["testbed-sim", *overrides, f"output.dir={tmp_path}/cli",
                                      f"hydra.run.dir={tmp_path}/hydra", "hydra.output_subdir=null"])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code != 0
    cli_err = capsys.readouterr().err

    with pytest.raises(testbed.ConfigError) as api_err:
        testbed.simulate(overrides, output_dir=tmp_path / "api")
    message = str(api_err.value)
    assert words in message
    assert message in cli_err  # the same words, not just the same key
    assert isinstance(api_err.value, ValueError) and not (tmp_path / "api").exists()  # refused before any work


def test_a_bad_value_in_a_sweep_stops_it_before_any_job_runs(tmp_path):
    with pytest.raises(testbed.ConfigError, match=r"(?s)sweep job 1 \(trace.max_requests=60 kv.block_size=0\): .*"
                                                  r"kv.block_size=0: must be >= 1"):
        testbed.sweep({"kv.block_size": [16, 0]}, overrides=["trace.max_requests=60"], output_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_overrides_must_be_a_list_of_strings():
    with pytest.raises(TypeError, match="a list of override strings"):
        testbed.simulate("policy=sarathi")
    with pytest.raises(TypeError, match=r"grid\['policy'\]"):
        testbed.sweep({"policy": "vllm"})


GRID = {"policy": ["vllm", "static"], "trace.rate_scale": [1, 2]}
SHARED = ["trace.max_requests=60"]


@pytest.fixture(scope="module")
def cli_sweep(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cli_sweep")
    run_cli(["-m", *SHARED, "policy=vllm,static", "trace.rate_scale=1,2", f"hydra.sweep.dir={root}/sweep"], cwd=root)
    return root / "sweep"


def _by_job(df: pd.DataFrame, columns) -> pd.DataFrame:
    return df[list(columns)].sort_values("job").reset_index(drop=True)


def test_sweep_has_one_row_per_job_and_the_cli_sweeps_columns(cli_sweep):
    table = testbed.sweep(GRID, overrides=SHARED)
    assert len(table) == 4 and list(table.columns[:2]) == ["policy", "trace.rate_scale"]
    assert list(zip(table.policy, table["trace.rate_scale"])) == [("vllm", 1), ("vllm", 2), ("static", 1), ("static", 2)]
    assert (table.status == "ok").all()
    cli_table = testbed.load(cli_sweep)
    pd.testing.assert_frame_equal(cli_table, pd.read_parquet(cli_sweep / "sweep_summary.parquet"))
    common = [c for c in cli_table.columns if c in table.columns]
    assert len(common) > 30 and "p99_ttft_ms" in common and "job" in common
    pd.testing.assert_frame_equal(_by_job(table, common), _by_job(cli_table, common), check_dtype=False)


def test_a_parallel_sweep_writes_the_table_load_reads(tmp_path):
    grid = {"policy": ["vllm", "static"]}
    table = testbed.sweep(grid, overrides=SHARED, output_dir=tmp_path / "sweep", n_jobs=2)
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == [
        "0_policy=vllm,trace.max_requests=60", "1_policy=static,trace.max_requests=60", "sweep_summary.csv",
        "sweep_summary.parquet"]
    back = testbed.load(tmp_path / "sweep")
    common = [c for c in back.columns if c in table.columns]
    pd.testing.assert_frame_equal(_by_job(table, common), _by_job(back, common), check_dtype=False)
    one = testbed.load(tmp_path / "sweep" / "1_policy=static,trace.max_requests=60")
    assert one.summary["p99_ttft_ms"] == table.set_index("policy").loc["static", "p99_ttft_ms"]


def test_importing_testbed_loads_no_api_until_it_is_used():
    code = ("import sys, testbed\n"
            "heavy = lambda: sorted(m for m in ('hydra', 'pandas', 'testbed.api', 'testbed.app') if m in sys.modules)\n"
            "before = heavy(); testbed.simulate; after = heavy()\n"
            "print(before, after); sys.exit(0 if before == [] and 'testbed.api' in after else 1)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


def test_a_finished_run_is_freed_without_the_cyclic_gc(tmp_path, monkeypatch):
    """What a run built (its request states, their token lists) is freed when its result is returned: a sweep
    or a fit that runs hundreds of simulations in one process must not hold each one until the cyclic GC
    finds it (the loop and its scheduler view refer to each other: `SchedulerView.close`)."""
    import gc

    from testbed.core.request import RequestState

    monkeypatch.chdir(tmp_path)
    gc.collect()
    gc.disable()
    try:
        res = testbed.simulate(SMALL)
        left = sum(type(o) is RequestState for o in gc.get_objects())
    finally:
        gc.enable()
    assert res.summary["num_requests"] == 120
    assert left == 0, f"{left} request states of a finished run still held"
