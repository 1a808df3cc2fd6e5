"""The layers of DESIGN.md hold: the core imports nothing above it, each backend and the
policies import the core only, and no two files import each other, even inside a function.

Read from the source (every import, also those inside functions) and checked at run time
(what importing the core actually loads)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "testbed"

# layer -> the layers its modules may import (itself included)
ALLOWED = {
    "core": {"core"},
    "sim": {"core", "sim"},
    "traces": {"core", "traces"},
    "policies": {"core", "policies"},
    "routers": {"core", "routers"},
    "engine": {"core", "engine"},
    "vllm_backend": {"core", "vllm_backend"},
    "app": {"core", "sim", "traces", "policies", "routers", "engine", "vllm_backend", "app"},
}
CORE_FORBIDDEN_THIRD_PARTY = {"hydra", "omegaconf", "simpy", "torch", "transformers", "pandas", "wandb"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the modules a file imports (`from a import b` counts as a.b when a.b is a
    module of ours, else as a)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                as_path = PKG.parent / Path(*sub.split("."))
                out.add(sub if as_path.with_suffix(".py").exists() or (as_path / "__init__.py").exists()
                        else node.module)
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "testbed" and len(parts) > 1 and parts[1] in ALLOWED else None


def _sources() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_each_layer_imports_only_what_is_below_it():
    wrong = []
    for path in _sources():
        mod = _module_name(path)
        here = _layer(mod)
        for imp in _imports(path):
            if here is None:  # testbed/__init__.py re-exports the core (and the API, lazily); __main__ runs the app
                if mod == "testbed" and imp.startswith("testbed.") and _layer(imp) != "core" and imp != "testbed.api":
                    wrong.append(f"{mod} -> {imp}")
                continue
            there = _layer(imp)
            if imp == "testbed" or (imp.startswith("testbed.") and there is None):
                wrong.append(f"{mod} -> {imp} (the package root)")
            elif there is not None and there not in ALLOWED[here]:
                wrong.append(f"{mod} -> {imp} ({here} may import only {sorted(ALLOWED[here])})")
            elif here == "core" and imp.split(".")[0] in CORE_FORBIDDEN_THIRD_PARTY:
                wrong.append(f"{mod} -> {imp} (the core needs no {imp.split('.')[0]})")
    assert not wrong, "layering broken:\n" + "\n".join(wrong)


def _import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports anywhere (inside functions and under `if TYPE_CHECKING:`
    too). A module's own packages are left out: importing a.b.c runs a/__init__ first, but that is the
    package's face, not a design dependency."""
    graph = {}
    for p in _sources():
        mod = _module_name(p)
        graph[mod] = {i for i in _imports(p)
                      if i.startswith("testbed") and i != mod and not mod.startswith(i + ".")}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in graph:
                continue
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    """Every import counts, also one inside a function or under `if TYPE_CHECKING:`: those hide a circle
    from Python's loader, not from a reader, who still cannot read either file without the other."""
    circles = _circles(_import_graph())
    assert not circles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_the_circle_check_sees_function_level_imports(tmp_path):
    """The check itself: imports inside a function and under TYPE_CHECKING count, and a circle of
    them is found."""
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from testbed.core.view import SchedulerView\n"
                   "def f():\n    from testbed.core.loop import StepLoop\n")
    assert _imports(src) == {"typing", "testbed.core.view", "testbed.core.loop"}
    graph = {"testbed.a": {"testbed.b"}, "testbed.b": {"testbed.c"}, "testbed.c": {"testbed.a"}, "testbed.d": set()}
    assert _circles(graph) == [["testbed.a", "testbed.b", "testbed.c"]]


def test_importing_the_core_loads_nothing_above_it():
    code = ("import sys, testbed, testbed.core.loop, testbed.core.kv, testbed.core.view, testbed.core.plan, "
            "testbed.core.policy, testbed.core.request, testbed.core.cost, testbed.core.specs\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('hydra', 'omegaconf', 'simpy', 'torch', "
            "'transformers', 'pandas') or m.startswith(('testbed.app', 'testbed.sim', 'testbed.policies', "
            "'testbed.traces', 'testbed.engine', 'testbed.vllm_backend')))\n"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent)
    assert r.returncode == 0, f"importing the core loaded: {r.stdout} {r.stderr[-1000:]}"


def test_the_policy_authors_names_come_from_the_package_root():
    import testbed

    for name in ("BasePolicy", "Plan", "PolicyKnobs", "register", "RequestState", "SchedulerView", "RECOMPUTE"):
        assert hasattr(testbed, name), name
