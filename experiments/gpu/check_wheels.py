"""Check the wheels that travel to the device machine before a device call is spent on them.

    python experiments/gpu/check_wheels.py .wheels

The device machine reaches no package registry: whatever the testbed imports and the image
(image_packages.txt) lacks must be among the carried wheels, and pip installs them there with
--no-index --no-deps, so nothing checks their requirements at install time. This does, here:

- every wheel installs on the device's Python (3.12, CPython, manylinux x86_64) or is pure Python;
- one version of each distribution (two stop the whole install);
- none is already in the image (a second copy would shadow the image's own version);
- every requirement of the project (pyproject.toml's dependencies) and of every wheel, evaluated for
  the device's Python, is in the image or among the wheels (a wheel's version must satisfy it),
  except the ones wheels.txt says are not carried and why;
- the wheels are few megabytes (the working tree that travels, wheels included, is at most 64 MiB).

Prints one line per wheel and the total; exits 1 naming every problem.
"""
from __future__ import annotations

import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEVICE_PYTHON = (3, 12)
# not carried: only logger=wandb imports it (testbed/app/reports/wandb_log.py), and the device reaches no W&B server
NOT_CARRIED = {"wandb"}
MAX_BYTES = 16 << 20


def names_in(path: Path) -> list[str]:
    """Non-comment lines of a list file, each line's first word (a name or a name==version)."""
    return [line.split("#")[0].strip() for line in path.read_text().splitlines()
            if line.split("#")[0].strip()]


def device_environment() -> dict:
    env = default_environment()
    v = DEVICE_PYTHON
    env.update(python_version=f"{v[0]}.{v[1]}", python_full_version=f"{v[0]}.{v[1]}.3", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", implementation_name="cpython",
               platform_python_implementation="CPython", os_name="posix", extra="")
    return env


def installs_on_device(tags) -> bool:
    for t in tags:
        py_ok = t.interpreter in ("py3", f"py{DEVICE_PYTHON[0]}") or (
            t.interpreter.startswith("cp3") and int(t.interpreter[3:]) <= DEVICE_PYTHON[1]
            and t.abi in ("abi3", "none")) or t.interpreter == f"cp{DEVICE_PYTHON[0]}{DEVICE_PYTHON[1]}"
        plat_ok = t.platform == "any" or (t.platform.startswith("manylinux") and t.platform.endswith("x86_64"))
        if py_ok and plat_ok:
            return True
    return False


def metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        return Parser().parsestr(z.read(name).decode())


def check(wheel_dir: Path) -> list[str]:
    problems: list[str] = []
    image = {canonicalize_name(n) for n in names_in(HERE / "image_packages.txt")}
    wheels = sorted(wheel_dir.glob("*.whl"))
    others = sorted(p.name for p in wheel_dir.iterdir() if p.suffix != ".whl") if wheel_dir.is_dir() else []
    if not wheels:
        return [f"{wheel_dir}: no wheels (run `bash experiments/gpu/run.sh prepare` where PyPI is reachable)"]
    if others:
        problems.append(f"{wheel_dir}: not wheels, pip --no-index would not install them: {others}")
    have: dict[str, tuple] = {}
    for w in wheels:
        name, version, _, tags = parse_wheel_filename(w.name)
        if name in have:
            problems.append(f"{w.name}: a second version of {name} ({have[name][0]} too): keep one")
        have[name] = (version, w)
        if not installs_on_device(tags):
            problems.append(f"{w.name}: does not install on the device's CPython "
                            f"{DEVICE_PYTHON[0]}.{DEVICE_PYTHON[1]} manylinux x86_64")
        if name in image:
            problems.append(f"{w.name}: {name} is in the image already (image_packages.txt): carrying it "
                            f"would shadow the image's own version")
    env = device_environment()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needs = [("pyproject.toml", Requirement(r)) for r in pyproject["project"]["dependencies"]]
    for name, (_, w) in have.items():
        needs += [(w.name, Requirement(r)) for r in metadata(w).get_all("Requires-Dist") or []]
    for who, req in needs:
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if name in have:
            if req.specifier and not req.specifier.contains(have[name][0], prereleases=True):
                problems.append(f"{who} needs {req}, the carried wheel is {have[name][1].name}")
        elif name not in image and not (who == "pyproject.toml" and name in NOT_CARRIED):
            problems.append(f"{who} needs {req}: neither in the image (image_packages.txt) nor carried "
                            f"(add it to experiments/gpu/wheels.txt)")
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"  {w.name}  {w.stat().st_size / 1024:,.0f} kB")
    print(f"{len(wheels)} wheels, {total / 2**20:.2f} MiB")
    if total > MAX_BYTES:
        problems.append(f"{wheel_dir}: {total / 2**20:.1f} MiB of wheels, more than {MAX_BYTES >> 20} MiB "
                        f"(the working tree that travels is at most 64 MiB)")
    return problems


def main() -> int:
    wheel_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / ".wheels")
    problems = check(wheel_dir)
    for p in problems:
        print(f"check_wheels: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
