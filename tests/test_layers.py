"""The layers of DESIGN.md hold: the core imports nothing above it, each backend and the
policies import the core only, and no module-level import circle exists anywhere.

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


def _imports(path: Path, top_level_only: bool = False) -> set[str]:
    """Absolute names of the modules a file imports (`from a import b` counts as a.b when a.b is a
    module of ours, else as a)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
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


def test_no_import_cycles():
    graph = {_module_name(p): {i for i in _imports(p, top_level_only=True) if i.startswith("testbed")}
             for p in _sources()}
    # importing a.b.c also runs a and a.b: a package's __init__ is a dependency of its modules
    for mod in list(graph):
        parts = mod.split(".")
        graph[mod] |= {".".join(parts[:k]) for k in range(1, len(parts))} - {mod}
    cycles, state = [], {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if n == m or n not in graph:
                continue
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    # a package importing its own submodules (re-exports) is not a circle of layers; anything else is
    real = [c for c in cycles if not all(x.startswith(c.split(" -> ")[0]) or c.split(" -> ")[0].startswith(x)
                                         for x in c.split(" -> "))]
    assert not real, "import circles:\n" + "\n".join(real)


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
