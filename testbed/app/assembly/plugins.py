"""Loading the policies the application can select: the bundled ones and those of other packages.

The registry lives in the core (`testbed.core.policy.register`), but the core must not import
the policies that fill it, so loading them is the application's job. A package that ships its
own policy declares it in the `testbed.policies` entry point group, e.g. in its pyproject.toml:

    [project.entry-points."testbed.policies"]
    shortest_prompt = "my_package.shortest_prompt"

and `policy=shortest_prompt` then selects it (its config goes on Hydra's search path, see
policies/README.md).
"""
from __future__ import annotations

from importlib import import_module
from importlib.metadata import entry_points

from testbed.core.policy import Policy, make_policy as _make_policy, registered
from testbed.core.router import Router, make_router as _make_router, registered_routers

GROUP = "testbed.policies"
ROUTER_GROUP = "testbed.routers"
_loaded: set[str] = set()  # entry point groups loaded


def _load_group(group: str, kind: str) -> None:
    """Import the bundled package of `group` (its modules register themselves) and every installed
    plugin declared in that entry point group, once."""
    if group in _loaded:
        return
    import_module(group)
    for ep in entry_points(group=group):
        try:
            ep.load()
        except Exception as e:  # a broken plugin must say which one it is
            raise ImportError(f"{kind} plugin {ep.name!r} ({ep.value}, entry point group {group!r}) "
                              f"failed to load: {e}") from e
    _loaded.add(group)


def load_policies() -> dict[str, type]:
    """Register the bundled policies and every installed plugin's (once); return the registry."""
    _load_group(GROUP, "policy")
    return registered()


def make_policy(name: str, **knobs) -> Policy:
    """`testbed.core.policy.make_policy` after every policy has been loaded."""
    load_policies()
    return _make_policy(name, **knobs)


def load_routers() -> dict[str, type]:
    """Register the bundled routers and every installed plugin's (entry point group
    `testbed.routers`, as for policies); return the registry."""
    _load_group(ROUTER_GROUP, "router")
    return registered_routers()


def make_router(name: str, **knobs) -> Router:
    """`testbed.core.router.make_router` after every router has been loaded."""
    load_routers()
    return _make_router(name, **knobs)
