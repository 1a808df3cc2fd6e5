"""Issue 26, first-run polish: user errors end in one message and exit 2 (a bug keeps its traceback),
`--help` says what each command does and offers no schema, `policy=edf_schema` is refused,
`experiment=...` needs no `+` (and `experiment=quick` exists), the SLO check explains itself and
does not fail on requests longer than the context, and the engine caps its own CPU threads."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from hydra import compose, initialize_config_dir

from testbed.app.entry.cli import CONF_DIR
from testbed.app.entry.stop import run_command
from testbed.app.assembly.validate import ConfigError, check_config

FAST = ["trace.max_requests=5", "output.print_table=false", "output.write_steps=false"]


def sim(args, cwd, script="sim"):
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    code = f"import sys; from testbed.app.entry.commands import {script}; sys.exit({script}())"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=300)


def config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("args, words", [
    (["backend.replicas=0"], "backend.replicas=0: must be >= 1"),  # a value the schema's bounds refuse
    (["slo.percentile=abc"], "slo.percentile=abc"),  # a value of the wrong type
    (["trace.path=/nonexistent/t.csv"], "trace file '/nonexistent/t.csv' not found"),  # a missing file
    (["policy=nope"], "Could not find 'policy/nope'"),  # a group option that does not exist
    (["policy=edf_schema"], "policy=edf_schema: a schema"),  # a schema node is no option
])
def test_a_user_error_is_one_message_and_exit_2_without_a_traceback(args, words, tmp_path):
    proc = sim([*args, *FAST, f"hydra.run.dir={tmp_path}/h"], tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "HYDRA_FULL_ERROR" not in proc.stderr
    assert words in proc.stderr and "testbed-sim: error:" in proc.stderr
    assert "_schema\n" not in proc.stderr and "vllm_schema" not in proc.stderr  # the options listed are real ones


def _module(tmp_path, monkeypatch, body: str) -> str:
    (tmp_path / "first_run_probe.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("first_run_probe", None)
    return "first_run_probe"


def test_run_command_tells_a_user_error_from_a_bug(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    mod = _module(tmp_path, monkeypatch, """
        from testbed.app.assembly.validate import ConfigError
        def user(): raise ConfigError("policy.x=1: no such knob")
        def bug(): raise KeyError("an internal slip")
    """)
    assert run_command(mod, "user", "testbed-x") == 2
    assert capsys.readouterr().err == "testbed-x: error: policy.x=1: no such knob\n"
    with pytest.raises(KeyError, match="an internal slip"):  # a bug keeps its traceback
        run_command(mod, "bug", "testbed-x")
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")  # asked for: every error raises, as Hydra would show it
    with pytest.raises(ConfigError):
        run_command(mod, "user", "testbed-x")
    assert os.environ["HYDRA_FULL_ERROR"] == "1" and "TESTBED_HYDRA_FULL_ERROR_ASKED" not in os.environ


@pytest.mark.parametrize("script, words", [("sim", "testbed-sim: Replay a request trace"),
                                           ("capacity", "testbed-capacity: Find the highest load")])
def test_help_says_what_the_command_does_and_offers_no_schema(script, words, tmp_path):
    proc = sim(["--help"], tmp_path, script)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(words)
    assert "powered by Hydra" not in proc.stdout and "_schema" not in proc.stdout
    assert "policy: edf, fastserve," in proc.stdout and "experiment: " in proc.stdout and "quick" in proc.stdout


def test_a_schema_chosen_as_a_group_option_is_refused_by_name():
    from hydra.core.hydra_config import HydraConfig

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["policy=edf_schema"], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    try:
        with pytest.raises(ConfigError, match=r"policy=edf_schema: a schema .* e\.g\. policy=edf"):
            check_config(cfg)
    finally:
        HydraConfig.instance().cfg = None


def test_an_experiment_needs_no_plus_and_none_changes_nothing():
    quick = config("experiment=quick")
    assert quick.trace.max_requests == 300
    assert config("experiment=sarathi_budget").policy.name == "sarathi"
    assert "experiment" not in config()


def test_a_plus_experiment_says_how_to_write_it(tmp_path):
    proc = sim(["+experiment=quick", *FAST], tmp_path)
    assert proc.returncode == 2 and "experiment=quick, without the '+'" in proc.stderr


def _trace_with_one_too_long_row(path):
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [
        f"2023-11-16 18:15:{10 + i:02d}.0000000,{n},20" for i, n in enumerate([300, 200000, 250, 400, 120])]
    path.write_text("\n".join(rows) + "\n")
    return path


def test_the_slo_check_explains_itself_and_leaves_out_a_request_longer_than_the_context(tmp_path):
    from testbed.app.analysis.results import format_table
    from testbed.app.assembly.run import simulate

    cfg = config(f"trace.path={_trace_with_one_too_long_row(tmp_path / 't.csv')}", "output.progress=false")
    s = simulate(cfg).summary
    assert (s["completed"], s["rejected"], s["reject_reasons"]) == (4, 1, {"too-long": 1})
    assert s["slo_checks"]["every_request_completed"] is True and s["slo_pass"] is True
    table = format_table(s)
    assert "p99 check: pass" in table
    check = next(line for line in table.splitlines() if line.startswith("SLO check"))
    assert "p99 TTFT <= 2000 ms and p99 TPOT <= 100 ms over the finished requests" in check
    assert check.endswith("1 request rejected (longer than the context), not counted")
    # a request that could fit but did not finish still fails it: a KV cache too small for the 400-token one
    s = simulate(config(f"trace.path={tmp_path / 't.csv'}", "output.progress=false", "kv.num_blocks=20")).summary
    assert s["reject_reasons"] == {"exceeds-kv": 1, "too-long": 1}
    assert s["slo_checks"]["every_request_completed"] is False and s["slo_pass"] is False
    assert "check: fail (every_request_completed)" in format_table(s)


@pytest.mark.parametrize("value, words", [("0", "backend.threads=0: must be >= 1"), ("-2", "backend.threads=-2")])
def test_backend_threads_is_validated(value, words):
    with pytest.raises(ConfigError, match=words):
        check_config(config("backend=engine", "model=tiny_llama", f"backend.threads={value}"))
    with pytest.raises(Exception, match="backend.threads"):  # not an int: refused as Hydra composes
        config("backend=engine", "backend.threads=many")
    check_config(config("backend=engine", "model=tiny_llama", "backend.threads=3"))
    assert config("backend=engine").backend.threads is None


def test_the_engine_caps_its_cpu_threads_unless_told(monkeypatch):
    import torch

    from testbed.engine.setup import CPU_THREADS_CAP, cpu_threads, set_cpu_threads

    cpu = torch.device("cpu")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads(None, cpu) == min(CPU_THREADS_CAP, len(os.sched_getaffinity(0))) == 1
    assert cpu_threads(3, cpu) == 3 and cpu_threads(3, torch.device("cuda")) == 3  # asked for: anywhere
    assert cpu_threads(None, torch.device("cuda")) is None  # a GPU's kernels do not use them
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpu_threads(None, cpu) is None  # the user's own choice stands
    before = torch.get_num_threads()
    try:
        assert set_cpu_threads(2, cpu) == 2 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_an_engine_replay_on_the_cpu_sets_and_records_its_threads(monkeypatch, tmp_path):
    import torch

    from testbed.app.assembly.run import replay_on_engine

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cfg = config("backend=engine", "backend.device=cpu", "model=tiny_llama", "trace.max_requests=3",
                     "trace.max_prompt_len=32", "trace.max_output_len=4", "trace.rate_scale=100",
                     "kv.num_blocks=64", "output.progress=false", f"output.dir={tmp_path}")
        s = replay_on_engine(cfg).summary
        assert s["completed"] == 3 and s["cpu_threads"] == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
