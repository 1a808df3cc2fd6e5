"""The optional compiled build (setup.py, TESTBED_COMPILE=mypyc) is whole and current.

Skipped unless some testbed module is imported from a compiled extension. A compiled module shadows
its .py source, so an extension built before the source was edited would silently run the old code:
every extension must be newer than its source. That the compiled build gives bit-identical results
is tests/test_bit_identity.py, which runs on whatever modules are importable.
"""
from __future__ import annotations

import importlib
import importlib.machinery
from pathlib import Path

import pytest

import testbed

PACKAGE = Path(testbed.__file__).resolve().parent
EXTENSIONS = sorted(p for suffix in importlib.machinery.EXTENSION_SUFFIXES for p in PACKAGE.rglob(f"*{suffix}"))
# the module each extension stands in for (the mypyc runtime library, testbed/_compiled__mypyc, has no source)
COMPILED = {p: p.with_name(p.name.split(".")[0] + ".py") for p in EXTENSIONS if "__mypyc" not in p.name}

pytestmark = pytest.mark.skipif(not COMPILED, reason="no compiled modules (the default, pure-Python build)")


def module_name(source: Path) -> str:
    return ".".join(source.relative_to(PACKAGE.parent).with_suffix("").parts)


@pytest.mark.parametrize("extension", list(COMPILED), ids=lambda p: p.name.split(".")[0])
def test_compiled_module_is_the_one_imported_and_newer_than_its_source(extension):
    source = COMPILED[extension]
    assert source.exists(), f"{extension.name}: no {source.name} beside it"
    assert extension.stat().st_mtime >= source.stat().st_mtime, (
        f"{extension} is older than {source.name}: rebuild (python setup.py build_ext --inplace) or delete it")
    module = importlib.import_module(module_name(source))
    assert Path(module.__file__).resolve() == extension.resolve()
