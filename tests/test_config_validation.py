"""Bad config input is refused at start, naming the key and the rule: keys no schema declares
(also those added with `+`), in every entry point."""
from __future__ import annotations

import sys

import pytest
from hydra import compose, initialize_config_dir

from testbed.app.entry import cli

from testbed.app.analysis import fidelity

from testbed.app.profiling import profile
from testbed.app.entry.cli import CONF_DIR
from testbed.app.assembly.validate import ConfigError, check_config


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
    ["experiment=max_rate"],  # a config group
    ["++profile.threads=1", "++profile.grid=full"],  # the profile section is in the schema
])
def test_legitimate_plus_overrides_pass(overrides):
    check_config(config(*overrides))


@pytest.mark.parametrize("fn", [cli.main, cli.capacity, profile.main, fidelity.main],
                         ids=["testbed-sim", "testbed-capacity", "testbed-profile", "testbed-fidelity"])
def test_every_entry_point_refuses_an_unknown_key(fn, tmp_path, monkeypatch, capsys):
    code, err = entry_point(fn, ["+kv.numblocks=5", "trace.max_requests=5"], tmp_path, monkeypatch, capsys)
    assert code == 1 and "kv.numblocks: unknown key (did you mean kv.num_blocks?)" in err
    made = {p.name for p in tmp_path.iterdir()} - {"failed.json", "cli.log", "profile.log", "fidelity.log"}
    assert not made, made  # refused before any work (failed.json records why, so a rerun redoes it)


# --- ranges -------------------------------------------------------------------------------------
def numeric_keys() -> list[tuple[str, str, object]]:
    """(policy config to compose with, dotted key, a value outside the key's declared range) for
    every numeric key of every schema, each policy's knobs included. A key that declares no
    range gets the value None, and its test fails: every numeric key must declare one."""
    import dataclasses
    import typing

    from testbed.app.assembly.config import TestbedConfig
    from testbed.app.assembly.plugins import load_policies, load_routers
    from testbed.app.assembly.validate import field_types
    from testbed.core.bounds import bounds_of

    def walk(schema, prefix, policy):
        for f in dataclasses.fields(schema):
            t = field_types(schema)[f.name]
            if dataclasses.is_dataclass(t):
                yield from walk(t, f"{prefix}{f.name}.", policy)
            elif t is typing.Any and f.name in ("policy", "router"):  # every registered one's knobs
                for name, cls in sorted((load_routers() if f.name == "router" else load_policies()).items()):
                    yield from walk(cls.Knobs, f"{prefix}{f.name}.", f"{f.name}={name}")
            else:
                item = typing.get_args(t)[0] if typing.get_origin(t) is list else t  # Any: a path or a list
                if item in (int, float):
                    iv = bounds_of(f)
                    bad = None if iv is None else next(
                        v for v in (None if iv.ge is None else iv.ge - 1, iv.gt, None if iv.le is None else iv.le + 1,
                                    iv.lt) if v is not None)
                    yield policy, f"{prefix}{f.name}", [bad] if item is not t and bad is not None else bad

    return list(walk(TestbedConfig, "", "policy=vllm"))


_composed: dict[str, object] = {}


@pytest.mark.parametrize("group, key, bad", numeric_keys(), ids=lambda x: x if isinstance(x, str) else None)
def test_every_numeric_key_is_range_checked_naming_it(group, key, bad):
    from omegaconf import OmegaConf

    assert bad is not None, f"{key} declares no range: give its field bounded(default, ge=..., ...)"
    if group not in _composed:
        _composed[group] = config(group)
    cfg = _composed[group].copy()
    OmegaConf.update(cfg, key, bad)
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert f"{key}=" in str(e.value) and "must be" in str(e.value)


@pytest.mark.parametrize("override, words", [
    ("policy.max_batch_size=-1", "policy.max_batch_size=-1: must be >= 0"),
    ("scheduler.max_model_len=0", "scheduler.max_model_len=0: must be >= 1 (or null)"),
    ("kv.activation_reserve_gb=-100", "kv.activation_reserve_gb=-100.0: must be >= 0"),
    ("kv.swap_space_gb=-1", "kv.swap_space_gb=-1.0: must be >= 0"),
    ("seed=-1", "seed=-1: must be >= 0"),
    ("model.num_layers=0", "model.num_layers=0: must be >= 1"),
    ("model.hidden_size=-64", "model.hidden_size=-64: must be >= 1"),
])
def test_the_reported_nonsense_values_are_refused_at_start(override, words, tmp_path, monkeypatch, capsys):
    code, err = entry_point(cli.main, ["policy=orca", override, "trace.max_requests=5"], tmp_path, monkeypatch, capsys)
    assert code == 1 and words in err


def test_null_stays_allowed_where_it_means_auto():
    check_config(config("scheduler.max_model_len=null", "kv.num_blocks=null", "trace.max_requests=null",
                        "slo.ttft_ms=null", "policy=edf", "policy.ttft_ms=null"))


def test_every_shipped_config_passes():
    """The bounds refuse nothing the shipped config groups hold."""
    options = {group: sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
               for group in ("policy", "model", "hardware", "slo", "trace", "backend", "cost_model", "experiment")}
    for i in range(max(map(len, options.values()))):  # every option of every group, several groups at a time
        picks = {g: o[i % len(o)] for g, o in options.items()}
        if picks["policy"] == "vllm_native":  # vLLM's own scheduler in the simulator: refused elsewhere
            picks["backend"] = "sim"
        if picks["backend"] != "sim":  # experiments are simulator studies (disagg_70b: 4 GPUs a replica)
            del picks["experiment"]
        check_config(config(*(f"{g}={o}" for g, o in picks.items())))
    for o in options["experiment"]:  # each at least once, whatever the pairing above gave it
        check_config(config(f"experiment={o}"))


def test_a_policy_built_in_code_checks_its_knobs_too():
    from testbed.policies import make_policy

    with pytest.raises(ValueError, match=r"policy.max_batch_size=-1: must be >= 0"):
        make_policy("orca", max_batch_size=-1)


# --- keys the engine would ignore ---------------------------------------------------------------
def sim_only_settings() -> list[tuple[str, object]]:
    """(key, a value other than its default) for every backend key marked simulator-only."""
    import dataclasses

    from testbed.app.assembly.config import BackendConfig

    other = {int: 4, bool: False}
    def unset(f):  # a value for a key whose default is null
        return 8.0 if "float" in str(f.type) else True

    return [(f"backend.{f.name}", unset(f) if f.default is None else True if f.default is False
             else other[type(f.default)])
            for f in dataclasses.fields(BackendConfig) if "sim_only" in f.metadata]


def test_the_simulator_only_keys_are_the_known_four():
    assert [k for k, _ in sim_only_settings()] == ["backend.replicas", "backend.fast_forward",
                                                   "backend.memory_budget_gb", "backend.async_scheduling"]


def test_a_router_other_than_the_default_is_refused_on_the_engine():
    check_config(config("router=least_outstanding", "backend.replicas=2"))
    with pytest.raises(ConfigError, match=r"router=least_outstanding: the simulator's only .*backend=engine"):
        check_config(config("backend=engine", "model=tiny_llama", "router=least_outstanding"))


def test_an_unknown_router_or_router_knob_is_named():
    from omegaconf import OmegaConf

    cfg = config("router=least_outstanding")
    OmegaConf.update(cfg, "router.name", "nearest", force_add=True)
    with pytest.raises(ConfigError, match=r"router.name='nearest': no such router; registered: .*round_robin"):
        check_config(cfg)


@pytest.mark.parametrize("key, value", sim_only_settings())
def test_a_simulator_only_key_is_refused_on_the_engine_only(key, value):
    from omegaconf import OmegaConf

    check_config(config(f"{key}={value}"))  # the simulator reads it
    cfg = config("backend=engine", "model=tiny_llama")
    OmegaConf.update(cfg, key, value)
    with pytest.raises(ConfigError, match=rf"{key}=.*: the simulator's only .* backend=engine would ignore it"):
        check_config(cfg)


@pytest.mark.parametrize("fn, args", [
    (cli.main, ["backend=engine", "model=tiny_llama", "backend.device=cpu"]),
    (profile.main, ["model=tiny_llama", "backend.device=cpu"]),  # they run the engine whatever backend.name says
    (fidelity.main, ["model=tiny_llama", "backend.device=cpu"]),
], ids=["testbed-sim", "testbed-profile", "testbed-fidelity"])
def test_backend_replicas_is_refused_by_every_engine_entry_point(fn, args, tmp_path, monkeypatch, capsys):
    code, err = entry_point(fn, [*args, "backend.replicas=4", "trace.max_requests=5"], tmp_path, monkeypatch, capsys)
    assert code == 1 and "backend.replicas=4: the simulator's only (the engine serves one replica)" in err
