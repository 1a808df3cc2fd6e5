"""A sweep job's work in a child process of its own, so that an OS kill ends that job only.

Hydra's joblib launcher runs a sweep's jobs in a pool of loky worker processes. When the OS
kills a worker (out of memory, SIGKILL), loky marks the whole pool broken: it kills the other
workers (the job beside it dies), fails every queued job with TerminatedWorkerError, and the
multirun ends before its summary is written. With the work forked into a child, the worker
survives: a killed child is one failed job (`JobKilled`, naming the signal), and the pool and
the other jobs go on. The OOM killer picks the process holding the memory, which is the child.

The child is forked (cheap: the worker has imported everything already, and has not touched a
GPU), in a process group of its own, and receives the signals its parent receives, once each,
so SIGINT or SIGTERM stops it cleanly as it stops a single run (a signal that comes while it is
being forked reaches it as soon as it exists). It dies with its parent (`stop.die_with_parent`):
a job whose worker was killed must not go on, unseen, and write its results after the sweep
ended. Its result or its exception comes back through a pipe. Where fork does not exist, the
work runs in the calling process.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback
from typing import Any, Callable

from testbed.app.entry.stop import after_fork, die_with_parent, on_signals, signal_name, stop_on_signals


_forks = [0]  # forks made by this process so far (a signal's handler tells before the fork from after it)
os.register_at_fork(after_in_parent=lambda: _forks.__setitem__(0, _forks[0] + 1))


class JobKilled(RuntimeError):
    """The job's process ended without handing back a result: a signal (an OS kill) ended it."""


class ChildTraceback(Exception):
    """The traceback of an exception raised in the child, shown as the cause of its copy."""

    def __str__(self) -> str:
        return self.args[0]


def run_isolated(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a forked child: its return value, or its exception raised here, or
    JobKilled when the child died without a word."""
    if "fork" not in mp.get_all_start_methods():
        return fn(*args)
    ctx = mp.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, os.getpid(), fn, args), name="testbed-job")
    pending: list[int] = []  # signals that came after the fork, before the child's pid was known
    forks = _forks[0]

    def forward(signum: int) -> None:
        if child.pid is None:
            if _forks[0] != forks:  # (before the fork, the child inherits the stop it raised)
                pending.append(signum)
            return
        try:
            os.kill(child.pid, signum)
        except ProcessLookupError:
            pass

    with on_signals(forward):
        child.start()
        for signum in pending:
            forward(signum)
        send.close()
        try:
            kind, value = receive.recv()
        except EOFError:  # the child died before sending anything
            kind, value = "killed", None
        child.join()
    if kind == "ok":
        return value
    if kind == "error":
        exc, tb = value
        raise exc from ChildTraceback(tb)
    code = child.exitcode
    raise JobKilled(f"killed by {signal_name(-code)}" if code is not None and code < 0
                    else f"its process exited with code {code} without a result")


def _child(send, parent: int, fn: Callable[..., Any], args: tuple) -> None:
    after_fork()  # its own flag (a stop its parent had seen is kept), not its parent's forwarding
    die_with_parent(parent)
    os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the parent, which forwards it: one signal, not two
    try:
        with stop_on_signals():
            message = ("ok", fn(*args))
    except BaseException as e:  # noqa: B902 - SystemExit and KeyboardInterrupt travel back as well
        message = ("error", (_picklable(e), traceback.format_exc()))
    send.send(message)
    send.close()


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
