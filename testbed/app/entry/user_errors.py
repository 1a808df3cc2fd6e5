"""Which exceptions are the user's to fix, and the one message each prints instead of a traceback.

A bad key or value, a bad trace row, a missing file or a config that cannot run is the user's mistake:
a traceback above its message only hides the message, and exit 1 reads like a crash. So every console
script (`app/entry/commands.py`, through `stop.run_command`) ends such an error with its message alone and
exit 2 (as argparse does for a bad argument), and lets every other exception, a bug, raise with its
whole traceback. The line is drawn by exception type, named here by qualified name so that this module
imports nothing: it runs before the commands' imports, and a type whose module was never imported
cannot have been raised. `RunNotComplete` (a sweep job that stalled or was stopped) is neither: a
result, said in one line, exit 1 as before.
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import Iterator

USAGE_EXIT = 2  # a user error: argparse's exit status for a bad argument
NOT_COMPLETE_EXIT = 1

USER_ERRORS = frozenset({
    "testbed.app.assembly.validate.ConfigError",  # a key or value the schemas refuse
    "testbed.traces.errors.TraceError",  # a trace row or file that cannot be read
    "testbed.app.assembly.memory_budget.MemoryBudgetError",  # a run that would not fit in this machine's memory
    "testbed.engine.setup.DoesNotFit",  # a model or KV cache that does not fit on the device
    "testbed.sim.kernel_db.KernelDBError",  # kernel tables that cannot price the config
    "testbed.app.analysis.real_runs.RealRunError",  # a real run's folder that cannot be scored
    "testbed.vllm_backend.VLLMUnavailable",  # backend=vllm where vLLM is not installed
    "hydra.errors.ConfigCompositionException",  # an override Hydra cannot apply
    "hydra.errors.MissingConfigException",  # a group option that does not exist
    "hydra.errors.OverrideParseException",  # an override that does not parse
    "builtins.FileNotFoundError", "builtins.IsADirectoryError", "builtins.NotADirectoryError",
    "builtins.PermissionError",  # a path given on the command line
})
NOT_COMPLETE = frozenset({"testbed.app.analysis.results.RunNotComplete"})


def _names(e: BaseException) -> set[str]:
    return {f"{t.__module__}.{t.__qualname__}" for t in type(e).__mro__}


def is_user_error(e: BaseException) -> bool:
    return bool(_names(e) & USER_ERRORS)


def is_not_complete(e: BaseException) -> bool:
    return bool(_names(e) & NOT_COMPLETE)


def message(e: BaseException) -> str:
    """The error's own words, with an OmegaConf cause's first line (Hydra wraps the real reason in it),
    and without the `*_schema` entries Hydra lists among a group's options: they cannot be chosen."""
    text = str(e).strip() or type(e).__name__
    cause = e.__cause__
    if cause is not None and type(cause).__module__.startswith("omegaconf") and str(cause).strip():
        first = str(cause).strip().splitlines()[0]
        if first not in text:
            text += f"\n{first}"
    if m := re.search(r"Multiple values for (\S+)\. To override a value use 'override \1: (\S+)'", text):
        text += f"\non the command line: {m[1]}={m[2]}, without the '+' ({m[1]} is in the defaults list)"
    text = text.split("\nConfig search path:")[0]  # Hydra's own search path: nothing the user set
    lines: list[str] = []
    for ln in text.splitlines():
        if (ln.startswith("\t") and ln.strip().endswith("_schema")) or not ln.strip():
            continue
        if ln.startswith("\t") and lines and lines[-1].endswith((":", ",")):  # a group's options: one line
            lines[-1] += f" {ln.strip()},"
        else:
            lines.append(ln)
    return "\n".join(ln.rstrip(",") for ln in lines)


_ASKED = "TESTBED_HYDRA_FULL_ERROR_ASKED"  # the user's HYDRA_FULL_ERROR, for the commands this one starts


@contextlib.contextmanager
def errors_raised() -> Iterator[bool]:
    """Within the block Hydra raises a command's exceptions (HYDRA_FULL_ERROR=1) instead of printing them
    with a trimmed traceback and exiting 1, so that the command can tell a user error from a bug. Yields
    whether the user asked for full tracebacks (HYDRA_FULL_ERROR=1 of their own: then every error keeps
    its traceback), remembered for the commands this one starts, which inherit its environment."""
    before = {k: os.environ.get(k) for k in ("HYDRA_FULL_ERROR", _ASKED)}
    asked = before[_ASKED] if before[_ASKED] is not None else (before["HYDRA_FULL_ERROR"] or "")
    os.environ[_ASKED], os.environ["HYDRA_FULL_ERROR"] = asked, "1"
    try:
        yield asked == "1"
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
