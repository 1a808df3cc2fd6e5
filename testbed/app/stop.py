"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (a scheduler's or a user's kill).

The default reactions lose a run: SIGTERM ends the process on the spot, and the
KeyboardInterrupt of SIGINT lands wherever the interpreter happens to be, possibly halfway
through a step's bookkeeping. Instead, while a run is under `stop_on_signals()`, the first
signal only raises a flag; both backends look at it between steps (a consistent state),
end the replay there, and the run writes the results of the requests that finished, the
others marked unfinished, with `interrupted` set in the summary. The process then exits
with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a shell does. A second
signal stops at once (KeyboardInterrupt), for a run that does not reach a step's end.
"""
from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Raised by a signal; a backend calls it between steps: true once a stop was asked for."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self) -> bool:
        return self.signum is not None


def exit_code(signum: int | None) -> int:
    """A shell's exit status for a process a signal ended: 128 + its number (SIGINT if unknown)."""
    return 128 + (signum or signal.SIGINT)


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum or signal.SIGINT).name


@contextlib.contextmanager
def stop_on_signals():
    """A StopRequest raised by SIGINT or SIGTERM within the block (the handlers are restored
    after). Off the main thread, where Python cannot install handlers, nothing changes."""

    def raise_flag(stop: StopRequest, signum: int) -> None:
        if stop.signum is not None:
            raise KeyboardInterrupt  # asked twice: stop now
        stop.signum = signum

    with on_signals(raise_flag) as stop:
        yield stop


@contextlib.contextmanager
def on_signals(react):
    """Within the block, SIGINT and SIGTERM call `react(stop, signum)` (main thread only)."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    old = {s: signal.signal(s, lambda signum, frame: react(stop, signum)) for s in SIGNALS}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)
