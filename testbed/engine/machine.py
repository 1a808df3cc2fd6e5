"""The machine and software a profile's step times belong to, and whether this run is on the same.

A profile (`testbed-profile`, `engine/profile.py`) holds wall times of one machine: its CPU, the
cores it could use, torch's threads, the torch/transformers/Python builds, the device and dtype.
Used anywhere else its times are another machine's, and nothing in the numbers says so (issue 23:
the shipped CPU profile, measured on another 2-core machine, put the README chain's TPOT 44% too
slow). So a profile's header records them (`describe_machine`), and whoever uses a profile compares
the header with where it runs (`machine_differences`) and warns, naming the fields, with the
command that profiles this machine (`warn_if_other_machine`).

What is compared (`TIMING_FIELDS`) is what moves a step's time: the CPU model and the CPUs this
process may use, torch's intra-op threads, the device (GPU name or cpu), the dtype, and the torch,
transformers and Python (major.minor) builds. The testbed's own version and commit, the date and
the OMP_NUM_THREADS variable are recorded for the reader, not compared (every commit would warn). A
field the run does not know (a simulation has no torch threads or device of its own) is not
compared; a field an older profile does not record is reported as unrecorded (it may come from
anywhere). No torch import here: versions are read from the installed distributions, torch's
threads only if torch is already loaded.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path

# header key -> what the reader is told it is
TIMING_FIELDS = {
    "device": "device",
    "dtype": "dtype",
    "cpu_model": "CPU model",
    "cpu": "CPU architecture",
    "cpus_usable": "CPUs this process may use",
    "torch_threads": "torch threads",
    "torch": "torch version",
    "transformers": "transformers version",
    "python": "Python version",
}
_WARNED: dict[str, set[str]] = {}  # profile path -> fields already warned about (once per process)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpus_usable() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def testbed_commit() -> str:
    """The git commit of the testbed checkout this code runs from (+dirty with uncommitted changes to
    tracked files), or 'unknown' (an installed wheel, no git)."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def describe_machine(device: str | None = None, dtype: str | None = None, threads: int | None = None,
                     commit: bool = False) -> dict:
    """This machine and software as a profile header records them. `device` (the GPU's name, or cpu),
    `dtype` and `threads` (torch's) are the run's own where it knows them; torch's current thread
    count stands in for `threads` when torch is loaded. `commit` adds the testbed's git commit (a
    subprocess: for writing a profile, not for every check)."""
    if threads is None and "torch" in sys.modules:
        threads = sys.modules["torch"].get_num_threads()
    out = {
        "device": device,
        "dtype": dtype,
        "cpu_model": cpu_model(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": cpus_usable(),
        "torch_threads": threads,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "testbed": _version("llm-sched-testbed") or "unknown",
    }
    if commit:
        out["testbed_commit"] = testbed_commit()
    return out


def system_busy_s() -> float | None:
    """CPU seconds every process on this machine has spent busy since boot (all CPUs: user, nice, system,
    irq, softirq, steal; /proc/stat), or None where the OS does not say. Its growth over a measurement,
    less the measuring process's own CPU time, is what other processes ran beside it: on a machine whose
    cores share caches, memory bandwidth or a physical core (SMT), that slows a step even while its thread
    keeps its core (wall = CPU time), which the per-step contention check cannot see."""
    try:
        with open("/proc/stat") as f:
            fields_ = f.readline().split()
    except OSError:
        return None
    if not fields_ or fields_[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields_[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _same(key: str, recorded: str, current) -> bool:
    if key == "python":  # patch releases do not move step times
        return recorded.split(".")[:2] == str(current).split(".")[:2]
    return recorded.strip() == str(current).strip()


def machine_differences(header: dict, current: dict) -> list[tuple[str, str | None, str]]:
    """(field, the profile's value or None when it does not record it, this run's value) for every
    timing field this run knows and the profile does not match."""
    out = []
    for key in TIMING_FIELDS:
        cur = current.get(key)
        if cur is None:
            continue
        rec = header.get(key)
        if rec is None or str(rec).strip() == "":
            out.append((key, None, str(cur)))
        elif not _same(key, str(rec), cur):
            out.append((key, str(rec), str(cur)))
    return out


def profile_command(header: dict, model: str | None = None) -> str:
    """The command that profiles this machine the way the header's profile was made."""
    parts = ["testbed-profile", f"model={model or '<the model preset>'}",
             f"backend.device={header.get('device_type') or 'cpu'}"]
    threads = header.get("torch_threads")
    if (header.get("device_type") or "cpu") == "cpu":
        parts.append(f"profile.threads={threads or 1}")
    if header.get("grid"):
        parts.append(f"profile.grid={header['grid']}")
    parts.append("profile.out=my_profile.csv")
    return " ".join(parts)


def difference_text(diffs: list[tuple[str, str | None, str]]) -> str:
    """The differing fields in words: 'CPU model: AMD EPYC here, Intel Xeon in the profile; ...'."""
    parts = []
    for key, rec, cur in diffs:
        label = TIMING_FIELDS.get(key, key)
        parts.append(f"{label} ({key}): {cur} here, not recorded in the profile" if rec is None
                     else f"{label} ({key}): {cur} here, {rec} in the profile")
    return "; ".join(parts)


def warn_if_other_machine(header: dict, path: str, current: dict, model: str | None = None,
                          then: str = "then cost_model=profile cost_model.profile=my_profile.csv") -> list:
    """Warn (once per profile and field in a process) when the profile's machine or software differs
    from this run's in what moves step times; returns the differences (all of them, warned or not)."""
    diffs = machine_differences(header, current)
    seen = _WARNED.setdefault(str(path), set())
    new = [d for d in diffs if d[0] not in seen]
    if new:
        seen.update(d[0] for d in new)
        warnings.warn(f"profile {path} was measured on another machine or software than this run's, so its step "
                      f"times may not hold here: {difference_text(new)}. Profile this machine first: "
                      f"{profile_command(header, model)}, {then}", UserWarning, stacklevel=3)
    return diffs
