"""A sweep (`testbed-sim -m ...`) stopped by SIGINT or SIGTERM, across its processes.

A sweep on the joblib launcher is three layers: the command's process (Hydra's sweeper and
launcher), loky's worker processes, and each job's work in a child of its worker
(`app/entry/isolated.py`). Left to the defaults, a SIGTERM to the command ended it alone: the workers
went on, orphaned, finishing their jobs and holding the command's stdout open (a `| tee`, a CI step
or a `subprocess.run(capture_output=True)` hung for minutes), and no `sweep_summary.csv` was
written (SIGTERM skips atexit). A Ctrl-C reached every worker as a KeyboardInterrupt and broke the
pool, and a `kill -9` left the running job's child to write its results after the sweep was gone.

Here the command's process decides, and its jobs follow:
- during the launch the command's first signal only raises its flag (`stop_on_signals`); it writes
  the marker `.interrupted` in the sweep folder and passes the signal to each worker ready for it
  (`_forward`); the worker passes it to its job's child, which stops between steps and writes its
  finished requests, marked interrupted. A job that starts after the marker exists does not run
  (`job_in_sweep`), so the launch drains at once. The jobs return normally (a stopped sweep is not
  their failure), Hydra ends the multirun, `sweep_summary.csv` lists every job, the interrupted and
  the not-started ones marked, and the command exits 130 or 143 (`stop.run_command`);
- a second signal kills the workers at once (their jobs' children die with them);
- a worker joins the sweep at its first job (`_join`): it leaves the command's process group, so a
  terminal's Ctrl-C reaches the command only (which forwards it once: a job sees one signal, not
  two, and a second one means "at once"), ignores the signals between jobs, and dies with the
  command (`die_with_parent`): a `kill -9` of the sweep leaves nothing running.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Iterator

from testbed.app.entry.stop import SIGNALS, StopRequest, die_with_parent, signal_name, stop_on_signals, when_stopped

MARKER = ".interrupted"  # in the sweep folder: the signal that stopped the sweep
SWEEP_PID = "TESTBED_SWEEP_PID"  # the command's process, for its workers (they inherit the environment)


def stopped(sweep_dir: str | Path) -> int | None:
    """The signal that stopped the sweep in `sweep_dir`, or None while it runs (or ran to its end)."""
    try:
        return int(signal.Signals[(Path(sweep_dir) / MARKER).read_text().strip()])
    except (OSError, KeyError, ValueError):
        return None


@contextlib.contextmanager
def sweeping(sweep_dir: str | Path) -> Iterator[StopRequest]:
    """The command's side, around the launch of a sweep's jobs (entered by the sweep callback)."""
    sweep = Path(sweep_dir)
    (sweep / MARKER).unlink(missing_ok=True)  # an earlier, stopped run of this sweep
    os.environ[SWEEP_PID] = str(os.getpid())
    seen: list[int] = []

    def react(signum: int) -> None:
        seen.append(signum)
        if len(seen) == 1:
            sweep.mkdir(parents=True, exist_ok=True)
            (sweep / MARKER).write_text(signal_name(signum) + "\n")  # before the signal: see _join
            _forward(signum)
        else:  # asked twice: stop now
            _kill_workers()

    with stop_on_signals() as stop, _workers_born_deaf():
        remove = when_stopped(react)
        try:
            yield stop
        finally:
            remove()
            if stop():  # the workers idle now: end them with the sweep, not minutes later
                _kill_workers()


@contextlib.contextmanager
def _workers_born_deaf() -> Iterator[None]:
    """loky's workers start with SIGINT and SIGTERM blocked, until they join the sweep (`_join`).

    A terminal's Ctrl-C goes to the whole foreground process group, and a worker still booting (its
    Python starting, the first job's modules loading, seconds) would take it as a KeyboardInterrupt
    there: the pool broke, and the command printed the worker's traceback. A blocked signal stays
    pending, a signal mask is inherited through fork and exec (signal(7)), and `_join` ignores both
    signals before it unblocks them, so what came while the worker booted is dropped: the command
    forwards the stop to workers that joined, and a job reads the marker. loky spawns with its
    `backend.fork_exec.fork_exec` (imported at each spawn, popen_loky_posix.py `_launch`), wrapped here
    for the sweep's time; the mask is blocked in the spawning thread only, for the fork's moment.
    Without that function (another loky), nothing changes."""
    try:
        from joblib.externals.loky.backend import fork_exec as module
    except ImportError:
        yield
        return
    original = module.fork_exec

    def fork_exec(*args, **kwargs):
        old = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            return original(*args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    module.fork_exec = fork_exec
    try:
        yield
    finally:
        module.fork_exec = original


@contextlib.contextmanager
def job_in_sweep(sweep_dir: str | Path) -> Iterator[StopRequest]:
    """A job's side: its stop (raised already when the sweep was stopped before it started)."""
    _join()
    with stop_on_signals() as stop:  # (before the marker is read: see _join)
        signum = stopped(sweep_dir)
        if signum is not None and stop.signum is None:
            stop.signum = signum
        yield stop


def job_stop():
    """The stop of a command's work: a sweep job's (`job_in_sweep`) in a multirun, else its own
    `stop_on_signals()` block."""
    from hydra.core.hydra_config import HydraConfig

    from testbed.app.assembly.run_setup import in_multirun

    return job_in_sweep(HydraConfig.get().sweep.dir) if in_multirun() else stop_on_signals()


_joined = [False]


def _join() -> None:
    """Once per worker process the command started (loky's): its own process group, signals ignored
    between jobs, death with the command. The command forwards a signal only to workers that catch or ignore SIGTERM, after it
    wrote the marker; a job reads the marker after its handlers are in place: no signal is lost."""
    main = os.environ.get(SWEEP_PID)
    if _joined[0] or main is None or int(main) == os.getpid():
        return
    _joined[0] = True
    if os.getppid() != int(main):
        try:
            os.kill(int(main), 0)
        except ProcessLookupError:  # the sweep died before this job began: it must not run unseen
            os.kill(os.getpid(), signal.SIGKILL)
        except PermissionError:
            pass
        return  # not a worker the command started (submitit's or Ray's launchers: their own process trees)
    die_with_parent(int(main))
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)  # (born blocked: _workers_born_deaf)


def _workers() -> list[int]:
    """The pids of loky's workers in this process (joblib's reusable executor), if it has any."""
    module = sys.modules.get("joblib.externals.loky.reusable_executor")
    executor = getattr(module, "_executor", None)
    return list(getattr(executor, "_processes", None) or {})


def _ready(pid: int) -> bool:
    """Whether the process catches or ignores SIGTERM (a worker that joined the sweep). Where /proc
    cannot tell, yes."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return not Path("/proc/self/status").exists()
    masks = {k: int(v, 16) for k, v in (line.split(":\t") for line in status.splitlines()
                                         if line.startswith(("SigCgt:", "SigIgn:")))}
    return bool((masks.get("SigCgt", 0) | masks.get("SigIgn", 0)) & (1 << (signal.SIGTERM - 1)))


def _forward(signum: int) -> None:
    for pid in _workers():
        if _ready(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


def _kill_workers() -> None:
    """End loky's workers now (their jobs' children die with them)."""
    module = sys.modules.get("joblib.externals.loky.reusable_executor")
    executor = getattr(module, "_executor", None)
    pids = _workers()
    if executor is not None:  # loky's own way (joblib's abort does the same), then any left
        with contextlib.suppress(Exception):
            executor.shutdown(wait=False, kill_workers=True)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10  # gone before the command exits (a killed process takes a moment to end)
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie has ended: only its exit status is left)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
