"""A command that is its process's only work: no cyclic GC, and no heap torn down at its end.

A simulation leaves hundreds of MB of objects behind it (every request's state, the KV bookkeeping,
the tables). With the cyclic GC on, building the results after the run makes its collections walk
all of them (0.1-0.3 s of the main command), and an ordinary interpreter exit collects and frees them
one by one (0.4-0.5 s), memory the OS takes back at once anyway. `run_once` runs the command and ends
the process with `os._exit` once its exit handlers have run and its output is flushed: every file is
complete by then (each is written and closed by the command; W&B's and logging's hooks run as at any
exit). Where a thread other than a daemon is still alive, or the command raised (a traceback, an
incomplete run's sys.exit), the process ends the ordinary way.

The GC goes off (`gc_off_for_good`) where the command knows it is a single run: a sweep's process
composes and runs job after job, and its garbage must still be collected.
"""
from __future__ import annotations

import atexit
import gc
import os
import sys
import threading
from typing import Callable


_one_shot = [False]  # whether run_once runs this process's command


def run_once(command: Callable[[], int | None]) -> int | None:
    """`command()`, then the process's end with its exit code; returns only where the process must
    end the ordinary way (the caller then exits with the value returned)."""
    _one_shot[0] = True
    code = command()
    end_now(code or 0)
    return code


def end_now(code: int) -> None:
    """Exit with `code` at once, as an ordinary exit would but for freeing the heap; returns (doing
    nothing) while a non-daemon thread is alive, which an ordinary exit waits for."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()  # noqa: SLF001 - what Py_Finalize runs first (logging's flush, W&B's, multiprocessing's)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: an ordinary exit would not write it either
            pass
    os._exit(code)


def gc_off_for_good() -> None:
    """The cyclic GC off for the rest of the process, where `run_once` runs it: nothing the command
    allocates outlives the process (elsewhere, a test or a notebook calling the command, nothing)."""
    if _one_shot[0]:
        gc.disable()
