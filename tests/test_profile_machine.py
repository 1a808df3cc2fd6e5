"""A profile records the machine and software it was measured on, and whoever uses it on another
machine is told so, with the fields that differ and the command that profiles this one (issue 23:
the shipped CPU profile came from another machine and put the README chain's TPOT 44% too slow,
and nothing said so)."""
from __future__ import annotations

import warnings

import pytest
from hydra import compose, initialize_config_dir

from testbed.app.entry.cli import CONF_DIR
from testbed.engine import machine
from testbed.engine.machine import describe_machine, machine_differences, profile_command, warn_if_other_machine
from testbed.engine.profile import write_profile
from testbed.sim.fitted_cost import ProfileCostModel, read_profile

SHIPPED = CONF_DIR.parent / "profiles" / "cpu_tiny_llama.csv"
TINY = ["model=tiny_llama", "backend.device=cpu", "trace.max_requests=5", "trace.max_prompt_len=64",
        "trace.max_output_len=4"]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(machine, "_WARNED", {})  # each test sees its own first warning


def config(*overrides):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def profile_with(tmp_path, name: str, **header_changes):
    """The shipped profile's rows under a header of this machine, changed as asked (None drops a key)."""
    header, df = read_profile(SHIPPED)
    here = describe_machine(device="cpu", dtype="float32", threads=1)
    header.update({k: v for k, v in here.items() if v is not None})
    for k, v in header_changes.items():
        if v is None:
            header.pop(k, None)
        else:
            header[k] = v
    return write_profile(tmp_path / name, header, df.to_dict("records"))


def test_describe_machine_names_cpu_cores_threads_and_versions():
    m = describe_machine(device="cpu", dtype="float32", threads=3, commit=True)
    assert m["device"] == "cpu" and m["dtype"] == "float32" and m["torch_threads"] == 3
    assert m["cpu_model"] and 1 <= m["cpus_usable"] <= m["cpu_count"]
    for key in ("torch", "transformers", "python", "testbed", "testbed_commit", "omp_num_threads"):
        assert m[key], key


def test_differences_name_the_fields_that_move_step_times():
    here = describe_machine(device="cpu", dtype="float32", threads=1)
    header = {k: str(v) for k, v in here.items() if v is not None}
    assert machine_differences(header, here) == []
    # a patch release of Python does not count, its minor version does; the commit and date are not compared
    major, minor, _ = here["python"].split(".")
    assert machine_differences({**header, "python": f"{major}.{minor}.999", "testbed_commit": "x"}, here) == []
    assert machine_differences({**header, "python": f"{major}.{int(minor) + 1}.0"}, here)[0][0] == "python"
    other = {**header, "cpu_model": "Some Other CPU", "torch_threads": "4"}
    assert machine_differences(other, here) == [("cpu_model", "Some Other CPU", here["cpu_model"]),
                                                ("torch_threads", "4", "1")]
    # a field the run does not know (a simulation: no device, no threads) is not compared
    assert machine_differences(other, {**here, "torch_threads": None, "device": None}) == [
        ("cpu_model", "Some Other CPU", here["cpu_model"])]
    # a field an older profile does not record is reported as unrecorded
    old = {k: v for k, v in header.items() if k not in ("cpu_model", "cpus_usable")}
    assert [(k, r) for k, r, _ in machine_differences(old, here)] == [("cpu_model", None), ("cpus_usable", None)]


def test_warning_names_fields_and_the_profile_command_once():
    here = describe_machine(device="cpu", dtype="float32", threads=1)
    header = {k: str(v) for k, v in here.items() if v is not None}
    header.update(cpu_model="Another CPU", device_type="cpu", grid="quick")
    with pytest.warns(UserWarning, match=r"CPU model \(cpu_model\): .* here, Another CPU in the profile") as w:
        warn_if_other_machine(header, "p.csv", here, "tiny_llama")
    assert "testbed-profile model=tiny_llama backend.device=cpu profile.threads=1 profile.grid=quick" in str(w[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(warn_if_other_machine(header, "p.csv", here)) == 1  # said once per profile and field


def test_simulation_with_another_machines_cpu_profile_warns(tmp_path):
    from testbed.app.assembly.run import simulate

    path = profile_with(tmp_path, "other.csv", cpu_model="Intel(R) Xeon(R) Something", torch_threads="8")
    with pytest.warns(UserWarning, match=r"cpu_model.*Intel\(R\) Xeon\(R\) Something in the profile.*testbed-profile"):
        r = simulate(config(*TINY, "cost_model=profile", f"cost_model.profile={path}", "+profile.threads=1"))
    assert r.summary["completed"] == 5
    # without profile.threads the simulation has no torch threads of its own: only the CPU is named
    machine._WARNED.clear()
    with pytest.warns(UserWarning) as w:
        simulate(config(*TINY, "cost_model=profile", f"cost_model.profile={path}"))
    msgs = [str(x.message) for x in w if "another machine" in str(x.message)]
    assert len(msgs) == 1 and "cpu_model" in msgs[0] and "torch_threads" not in msgs[0]


def test_same_machine_profile_is_silent_and_gpu_profile_is_not_compared_in_a_simulation(tmp_path):
    from testbed.app.assembly.run import simulate

    same = profile_with(tmp_path, "same.csv")
    gpu = profile_with(tmp_path, "gpu.csv", device="NVIDIA H100 80GB HBM3", device_type="cuda",
                       cpu_model="Intel(R) Xeon(R) Platinum")
    for path in (same, gpu):
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)
            simulate(config(*TINY, "cost_model=profile", f"cost_model.profile={path}", "+profile.threads=1"))


def test_old_profile_without_machine_fields_still_reads_and_fits(tmp_path):
    """A profile written before the machine fields (only cpu arch, torch threads, versions) is read and
    fitted as before; what it does not record is named as unrecorded."""
    path = profile_with(tmp_path, "old.csv", cpu_model=None, cpus_usable=None, cpu_count=None, testbed=None,
                        omp_num_threads=None, os=None)
    header, df = read_profile(path)
    assert "cpu_model" not in header and len(df) > 100
    m = ProfileCostModel.from_file(path)
    assert m.holdout["median_ape"] < 0.5
    here = describe_machine(device="cpu", dtype="float32", threads=1)
    assert {k for k, rec, _ in machine_differences(header, here) if rec is None} == {"cpu_model", "cpus_usable"}


def test_profile_command_for_a_gpu_profile_has_no_threads():
    cmd = profile_command({"device_type": "cuda", "grid": "full"}, "llama3_8b")
    assert cmd == "testbed-profile model=llama3_8b backend.device=cuda profile.grid=full profile.out=my_profile.csv"
