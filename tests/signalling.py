"""Running a console script and signalling it at an event (never after a fixed delay: the tests must
not depend on how busy the machine is): the first sign of life (its signal handlers in place, seen in
/proc), a line it prints, or a file it writes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def script_command(script: str, args: list[str]) -> list[str]:
    """What the installed console script runs (its module and function from pyproject.toml), with
    this checkout's code whatever is installed."""
    module, function = SCRIPTS[script].split(":")
    return [sys.executable, "-c", f"import sys; sys.argv[0] = {script!r}; from {module} import {function}; "
                                  f"sys.exit({function}())", *args]


def environment(**extra: str) -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1", **extra}


def handlers_installed(pid: int) -> bool:
    """Whether the process catches SIGTERM (Python leaves it at its default: our handlers are in)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(caught & (1 << (signal.SIGTERM - 1)))


class Run:
    """A command started in a session of its own, its stdout and stderr merged into one pipe."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env or environment(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.seen = b""

    def wait_for_output(self, marker: bytes, timeout: float = 300) -> None:
        """Read its output until `marker` shows (a line it prints once under way)."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            assert time.monotonic() < deadline, f"no {marker!r} in {timeout} s: {self.text()[-3000:]}"
            chunk = os.read(fd, 65536)
            assert chunk, f"it ended before {marker!r} showed: {self.text()[-3000:]}"
            self.seen += chunk

    def wait_until(self, event: Callable[[], bool], what: str, timeout: float = 300) -> None:
        """Poll `event` (a file appearing, a process state) while the command runs."""
        deadline = time.monotonic() + timeout
        while not event():
            assert self.proc.poll() is None, f"it ended before {what}: {self.finish()[1][-3000:]}"
            assert time.monotonic() < deadline, f"no {what} in {timeout} s"
            time.sleep(0.01)

    def wait_for_handlers(self) -> None:
        """The first sign of life: its signal handlers are in place (it is importing its modules)."""
        self.wait_until(lambda: handlers_installed(self.proc.pid), "signal handlers")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def finish(self, timeout: float = 300) -> tuple[int, str]:
        """Its exit code and whole output (read to EOF: every process holding the pipe has ended)."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.seen += out or b""
        return self.proc.returncode, self.text()

    def text(self) -> str:
        return self.seen.decode(errors="replace")

    def session_left(self, timeout: float = 60) -> list[int]:
        """The processes of its session still running `timeout` s after it ended ([] as soon as none is):
        a killed process leaves /proc a moment after it closed its output, an orphan not for minutes."""
        deadline = time.monotonic() + timeout
        while (left := self.session_processes()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left

    def session_processes(self) -> list[int]:
        """The processes left in its session (every descendant that did not start one of its own)."""
        left = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == self.proc.pid and fields[0] != "Z":  # field 6 of stat: the session id
                left.append(int(stat.parent.name))
        return left
