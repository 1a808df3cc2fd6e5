"""An opt-in compiled build of the simulator's hot modules; the default build stays pure Python.

`pip install .` reads everything from pyproject.toml and builds a pure-Python wheel: no compiler,
no mypy. `TESTBED_COMPILE=mypyc pip install .` also compiles HOT_MODULES with mypyc into extension
modules that sit next to their .py sources; Python imports an extension before a source of the same
name, so the compiled modules replace the interpreted ones and nothing else changes. Results are
bit-identical either way (tests/test_compiled.py runs the bit-identity check on a compiled build).
`TESTBED_COMPILE=cython` is the same with Cython, for comparison: it gains little
(experiments/compile/README.md).
"""
from __future__ import annotations

import os
import sys

from setuptools import setup

# the step loop and what it calls on every plan and every engine step (cProfile of the main command).
# Not compiled: plan.py (PlanError subclasses RuntimeError, which mypyc cannot compile as a native
# class), view.py (tests patch SchedulerView's methods) and the policies (their knobs are dataclasses
# subclassing policy.py's PolicyKnobs).
HOT_MODULES = [
    "testbed/core/loop.py",
    "testbed/core/kv.py",
    "testbed/core/kv_offload.py",  # subclasses kv.py's classes: compiled with them
    "testbed/core/cost.py",
    "testbed/core/request.py",
    "testbed/policies/_passes.py",
    "testbed/sim/roofline.py",
    "testbed/sim/simulation.py",
]
HERE = os.path.dirname(os.path.abspath(__file__))

# Cython compiles plain Python with Python semantics: annotations stay annotations (a `float`
# annotation would otherwise make a C double), integer division and modulo keep Python's rules
CYTHON_DIRECTIVES = {"language_level": 3, "annotation_typing": False, "binding": True, "cdivision": False}


def compiled_extensions(tool: str) -> list:
    modules = os.environ.get("TESTBED_COMPILE_MODULES", "").split() or HOT_MODULES
    try:
        if tool == "mypyc":
            from mypyc.build import mypycify

            # the sources are not written to pass mypy: mypyc.ini compiles them with their type errors
            # ignored, and their annotations must hold at run time (tests/test_compiled.py checks a build)
            return mypycify(["--config-file", os.path.join(HERE, "experiments", "compile", "mypyc.ini"), *modules],
                            opt_level="3", group_name="testbed._compiled")
        from Cython.Build import cythonize

        return cythonize(modules, compiler_directives=CYTHON_DIRECTIVES, quiet=True)
    except ImportError:
        if "egg_info" in sys.argv:  # pip asking for the build's requirements: setup_requires brings the tool
            return []
        raise


TOOL = os.environ.get("TESTBED_COMPILE", "").strip().lower()
BUILD_REQUIRES = {"": [], "mypyc": ["mypy>=1.10"], "cython": ["Cython>=3.0"]}
if TOOL not in BUILD_REQUIRES:
    raise SystemExit(f"TESTBED_COMPILE={TOOL!r}: expected mypyc or cython (or unset: pure Python)")
# setup_requires: what setuptools' build backend asks pip to install into an isolated build env
setup(ext_modules=compiled_extensions(TOOL) if TOOL else [], setup_requires=BUILD_REQUIRES[TOOL])
