"""The wheel built from the repository carries everything a non-editable install needs: every
config group, every shipped profile, the shipped kernel tables, the bundled traces and the policy guide. (`.ci/run`
also installs that wheel into a fresh environment and runs the main command from a
temporary directory.)"""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_ships_config_groups_profiles_and_traces(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next(tmp_path.glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = [p for p in (ROOT / "testbed" / "conf").rglob("*.yaml")]
    needed += list((ROOT / "testbed" / "profiles").glob("*.csv"))
    needed += [p for p in (ROOT / "testbed" / "traces" / "data").rglob("*") if p.is_file()]
    needed += [ROOT / "testbed" / "policies" / "README.md"]
    # every module, the application's rooms (testbed/app/<room>/) included: a sub-package the build misses
    # would import in an editable install and fail in a user's
    needed += [p for p in (ROOT / "testbed").rglob("*.py") if "__pycache__" not in p.parts]
    kernel_data = [p for p in (ROOT / "testbed" / "sim" / "kernel_data").rglob("*") if p.is_file()]
    assert len(kernel_data) > 30  # the default cost model's tables, their manifest, NOTICE and licence
    needed += kernel_data
    groups = {p.parent.name for p in (ROOT / "testbed" / "conf").rglob("*.yaml")}
    assert {"policy", "trace", "model", "hardware", "slo", "backend", "cost_model", "logger", "experiment", "frontend"} <= groups
    assert len(needed) > 40
    missing = [str(p.relative_to(ROOT)) for p in needed if p.relative_to(ROOT).as_posix() not in names]
    assert not missing, f"not in {wheel.name}: {missing}"
    # and no stray top-level package that a user's own folder could shadow or be shadowed by; Hydra's plugin
    # namespace holds our Ray launcher only, with no __init__.py of its own (which would hide every other plugin)
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"testbed", "hydra_plugins"}, tops
    plugins = {n.split("/")[1] for n in names if n.startswith("hydra_plugins/")}
    assert plugins == {"testbed_ray_launcher"}, plugins
    assert "hydra_plugins/testbed_ray_launcher/ray_launcher.py" in names
