"""Bad config input is refused at start, naming the key and the rule: keys no schema declares
(also those added with `+`), in every entry point."""
from __future__ import annotations

import sys

import pytest
from hydra import compose, initialize_config_dir

from testbed.app import cli, fidelity, profile
from testbed.app.cli import CONF_DIR
from testbed.app.validate import ConfigError, check_config


def config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def entry_point(fn, args, tmp_path, monkeypatch, capsys) -> tuple[int, str]:
    """Run a Hydra entry point in this process as the console script would; (exit code, stderr)."""
    monkeypatch.setattr(sys, "argv", ["testbed", *args, f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"])
    with pytest.raises(SystemExit) as e:
        fn()
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("overrides, words", [
    (["+scheduler.max_num_seq=10"], "scheduler.max_num_seq: unknown key (did you mean scheduler.max_num_seqs?)"),
    (["+kv.numblocks=5"], "kv.numblocks: unknown key (did you mean kv.num_blocks?)"),
    (["+trace.rate_scal=2"], "trace.rate_scal: unknown key (did you mean trace.rate_scale?)"),
    (["policy=orca", "+policy.max_batch_sise=3"], "policy.max_batch_sise: unknown key (did you mean policy.max_batch_size?)"),
    (["+profile.thread=1"], "profile.thread: unknown key (did you mean profile.threads?)"),
    (["+zzz=1"], "zzz: unknown key (the keys here: trace, policy,"),
])
def test_a_key_added_with_plus_that_no_schema_declares_is_refused(overrides, words):
    with pytest.raises(ConfigError) as e:
        check_config(config(*overrides))
    assert words in str(e.value)


def test_every_problem_is_listed_at_once():
    with pytest.raises(ConfigError, match=r"2 problem") as e:
        check_config(config("+scheduler.max_num_seq=10", "+kv.numblocks=5"))
    assert "scheduler.max_num_seq" in str(e.value) and "kv.numblocks" in str(e.value)


@pytest.mark.parametrize("overrides", [
    ["+trace.columns.arrival=ts"],  # an open map
    ["+experiment=max_rate"],  # a config group
    ["++profile.threads=1", "++profile.grid=full"],  # the profile section is in the schema
])
def test_legitimate_plus_overrides_pass(overrides):
    check_config(config(*overrides))


@pytest.mark.parametrize("fn", [cli.main, cli.capacity, profile.main, fidelity.main],
                         ids=["testbed-sim", "testbed-capacity", "testbed-profile", "testbed-fidelity"])
def test_every_entry_point_refuses_an_unknown_key(fn, tmp_path, monkeypatch, capsys):
    code, err = entry_point(fn, ["+kv.numblocks=5", "trace.max_requests=5"], tmp_path, monkeypatch, capsys)
    assert code == 1 and "kv.numblocks: unknown key (did you mean kv.num_blocks?)" in err
    assert not list(tmp_path.glob("*.json")) and not list(tmp_path.glob("*.csv"))  # refused before any work
