"""`mypyc_attr`: how the optional mypyc build (setup.py, TESTBED_COMPILE=mypyc) compiles a class.

A no-op decorator for the pure-Python default, so that mypy_extensions is no dependency; mypyc
reads the decorator from the source. `allow_interpreted_subclasses=True` marks a compiled class
that interpreted code subclasses (StepLoop: the tests' instrumented loops).
"""
from __future__ import annotations

try:
    from mypy_extensions import mypyc_attr
except ImportError:  # not installed: nothing reads the decorator then
    def mypyc_attr(*_args, **_attrs):
        return lambda cls: cls

__all__ = ["mypyc_attr"]
