"""Stopping a command cleanly on SIGINT (Ctrl-C) or SIGTERM (a scheduler's, a CI runner's or a user's kill).

The default reactions lose work or leave it half-done: SIGTERM ends the process on the spot (no
atexit hook, no results, children orphaned), and the KeyboardInterrupt of SIGINT lands wherever the
interpreter happens to be, possibly halfway through a step's bookkeeping or a file, and prints a
traceback. Every console script therefore runs under `run_command`, which installs the handlers
below before it imports anything heavy, and ends the process with 128 + the signal's number (130
for SIGINT, 143 for SIGTERM), as a shell reports a process a signal ended, and no traceback.

Two modes, chosen by the code the signal lands in:
- inside a `stop_on_signals()` block (work with safe stopping points: the backends' replays between
  steps, a search between evaluations, the writing of results), the first signal only raises a flag
  (`StopRequest`); the work ends at its next stopping point and keeps what it has, marked
  interrupted;
- elsewhere (imports, config composition, a quick report), the signal stops the command where it
  stands (`Interrupted`, a KeyboardInterrupt that no `except Exception` swallows).
A second signal always stops at once. Once raised, the flag stays up for the rest of the command,
so a signal that arrived during setup also stops the run at its first step.

`on_signals(forward)` hands every signal to `forward` instead (a process that waits on a child
doing the work: `app/entry/isolated.py`), and `when_stopped(hook)` lets a sweep pass the first signal on
to its jobs (`app/entry/sweep_signals.py`). `die_with_parent()` ties a child process's life to its parent's.
This module imports only the standard library (and app/entry/user_errors.py, which imports nothing else): the
console scripts import it first.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator

from testbed.app.entry import user_errors

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Raised by a signal; a backend calls it between steps: true once a stop was asked for."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self) -> bool:
        return self.signum is not None


class Interrupted(KeyboardInterrupt):
    """A signal stopped the command where it stood (outside a stop_on_signals block, or a second signal)."""

    def __init__(self, signum: int, at_once: bool = False) -> None:
        super().__init__(signal_name(signum))
        self.signum, self.at_once = signum, at_once


def exit_code(signum: int | None) -> int:
    """A shell's exit status for a process a signal ended: 128 + its number (SIGINT if unknown)."""
    return 128 + (signum or signal.SIGINT)


def signal_name(signum: int | None) -> str:
    return signal.Signals(signum or signal.SIGINT).name


class _Handlers:
    """This process's reaction to SIGINT and SIGTERM while any block of this module is open."""

    def __init__(self) -> None:
        self.stop = StopRequest()
        self.deferring = 0  # open stop_on_signals blocks: a first signal only raises the flag
        self.forwards: list[Callable[[int], None]] = []  # on_signals: every signal goes there, none raises here
        self.hooks: list[Callable[[int], None]] = []  # when_stopped: told of every signal
        self.old: dict[int, object] = {}

    def __call__(self, signum: int, frame=None) -> None:
        first = self.stop.signum is None
        if first:
            self.stop.signum = signum
        for hook in [*self.hooks, *self.forwards]:
            try:
                hook(signum)
            except Exception as e:  # a hook's failure must not turn a clean stop into a traceback
                print(f"while stopping on {signal_name(signum)}: {type(e).__name__}: {e}", file=sys.stderr)
        if self.forwards or (self.deferring and first):
            return
        raise Interrupted(signum, at_once=not first)


_active: _Handlers | None = None


@contextlib.contextmanager
def _handlers() -> Iterator[_Handlers]:
    """The process's handlers: the open ones, or new ones for the block (restored after). Off the main
    thread, where Python cannot install handlers, a detached set that no signal reaches."""
    global _active
    if _active is not None:
        yield _active
        return
    handlers = _Handlers()
    if threading.current_thread() is not threading.main_thread():
        yield handlers
        return
    handlers.old = {s: signal.signal(s, handlers) for s in SIGNALS}
    _active = handlers
    try:
        yield handlers
    finally:
        _active = None
        for s, h in handlers.old.items():
            signal.signal(s, h)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """Within the block, a first SIGINT or SIGTERM raises the StopRequest yielded (the command's,
    if one is running: a signal before the block has already raised it); a second stops at once."""
    with _handlers() as h:
        h.deferring += 1
        try:
            yield h.stop
        finally:
            h.deferring -= 1


@contextlib.contextmanager
def on_signals(forward: Callable[[int], None]) -> Iterator[StopRequest]:
    """Within the block, every SIGINT and SIGTERM is handed to `forward(signum)` (and raises the flag
    yielded); none interrupts this process, which waits for the one it forwards them to."""
    with _handlers() as h:
        h.forwards.append(forward)
        try:
            yield h.stop
        finally:
            h.forwards.remove(forward)


def when_stopped(hook: Callable[[int], None]) -> Callable[[], None]:
    """Call `hook(signum)` on every signal to this command from now on (at once if one came already);
    returns the function that removes it. Nothing happens outside a command or signal block."""
    h = _active
    if h is None:
        return lambda: None
    h.hooks.append(hook)
    if h.stop.signum is not None:
        hook(h.stop.signum)
    return lambda: h.hooks.remove(hook) if hook in h.hooks else None


def after_fork() -> StopRequest:
    """In a forked child: the parent's handlers without its forwards and hooks (they act for the
    parent), in flag mode for the child's whole life; a stop the parent had seen is kept."""
    global _active
    inherited = _active.stop.signum if _active is not None else None
    _active = _Handlers()
    _active.stop.signum = inherited
    _active.deferring = 1
    for s in SIGNALS:
        signal.signal(s, _active)
    return _active.stop


def die_with_parent(parent: int, signum: int = signal.SIGKILL) -> None:
    """End this process with `signum` when `parent` (the process that started it, alive now) dies:
    Linux's PR_SET_PDEATHSIG, then a check that the parent did not die before it was set. Elsewhere,
    nothing. (The kernel sends it when the parent's *thread* that forked this process exits: call it
    in a process forked by a thread that lives as long as its process, or by the main thread.)"""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before: no death signal will come
        os.kill(os.getpid(), signum)


_command: str | None = None  # the console script running in this process (its --help names it)


def command_name() -> str | None:
    return _command


def run_command(module: str, function: str, name: str) -> int | None:
    """The console script `name`: `module.function()` under the signal handlers, imports included. A
    signal ends it with 128 + its number, no traceback, whatever the command had written kept; a user
    error (app/user_errors.py) with its message and exit 2."""
    global _command
    _command = name
    with _handlers() as h, user_errors.errors_raised() as full_error:
        try:
            result = getattr(importlib.import_module(module), function)()
        except Exception as e:  # a user error says so in its own words, exit 2; a bug keeps its traceback
            if full_error or not (user_errors.is_user_error(e) or user_errors.is_not_complete(e)):
                raise
            print(f"{name}: {'error: ' if user_errors.is_user_error(e) else ''}{user_errors.message(e)}",
                  file=sys.stderr)
            return user_errors.USAGE_EXIT if user_errors.is_user_error(e) else user_errors.NOT_COMPLETE_EXIT
        except KeyboardInterrupt as e:  # the signal stopped it where it stood (or a second one: at once)
            signum = getattr(e, "signum", None) or h.stop.signum or signal.SIGINT
            how = "at once, on a second signal" if getattr(e, "at_once", False) else "where it stood"
            print(f"{name}: interrupted by {signal_name(signum)} ({how}); what it had written is kept",
                  file=sys.stderr)
            return exit_code(signum)
        except SystemExit as e:
            if h.stop.signum is None or e.code == exit_code(h.stop.signum):
                raise
            print(f"{name}: interrupted by {signal_name(h.stop.signum)}", file=sys.stderr)
            return exit_code(h.stop.signum)
        if h.stop.signum is not None:  # the work stopped at a safe point, and wrote what it had
            print(f"{name}: interrupted by {signal_name(h.stop.signum)}; the results so far are written, "
                  "marked interrupted", file=sys.stderr)
            return exit_code(h.stop.signum)
        return result if isinstance(result, int) and not isinstance(result, bool) else None
