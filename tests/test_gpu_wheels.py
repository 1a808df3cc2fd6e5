"""The GPU run's wheel check (experiments/gpu/check_wheels.py) on wheels made here: wheels.txt with
the image covers the project's dependencies, and each problem that would break the offline install
on the device is named. (The CPU dry run in CI installs the real wheels.)"""
from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("check_wheels", ROOT / "experiments" / "gpu" / "check_wheels.py")
check_wheels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_wheels)


def wheel(folder: Path, name: str, version: str, tag: str = "py3-none-any", requires: tuple[str, ...] = ()) -> Path:
    """A wheel holding only its METADATA (all the check reads)."""
    dist = name.replace("-", "_")
    path = folder / f"{dist}-{version}-{tag}.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}-{version}.dist-info/METADATA", meta)
    return path


@pytest.fixture
def carried(tmp_path):
    """A wheel for every line of wheels.txt, hydra-core needing antlr4 as the real one does."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    for line in check_wheels.names_in(check_wheels.HERE / "wheels.txt"):
        name, version = line.split("==")
        wheel(folder, name, version, requires=("antlr4-python3-runtime==4.9.*",) if name == "hydra-core" else ())
    return folder


def test_wheels_txt_and_the_image_cover_the_project(carried):
    assert check_wheels.check(carried) == []


def test_each_problem_is_named(carried):
    next(carried.glob("antlr4*")).unlink()
    wheel(carried, "pyyaml", "6.0.3")  # in the image already
    wheel(carried, "simpy", "4.1.1")  # a second version
    wheel(carried, "fastcore", "1.0", tag="cp311-cp311-manylinux_2_17_x86_64")  # not for the device's 3.12
    problems = "\n".join(check_wheels.check(carried))
    assert "hydra_core-1.3.8-py3-none-any.whl needs antlr4-python3-runtime==4.9.*: neither in the image" in problems
    assert "pyyaml is in the image already" in problems
    assert "a second version of simpy" in problems
    assert "fastcore-1.0-cp311-cp311-manylinux_2_17_x86_64.whl: does not install on the device's CPython 3.12" in problems
