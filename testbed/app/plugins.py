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

from importlib.metadata import entry_points

from testbed.core.policy import Policy, make_policy as _make_policy, registered
from testbed.core.router import Router, make_router as _make_router, registered_routers

GROUP = "testbed.policies"
ROUTER_GROUP = "testbed.routers"
_loaded = False
_routers_loaded = False


def load_policies() -> dict[str, type]:
    """Register the bundled policies and every installed plugin's (once); return the registry."""
    global _loaded
    if not _loaded:
        import testbed.policies  # noqa: F401  (importing the package registers the bundled policies)

        for ep in entry_points(group=GROUP):
            try:
                ep.load()
            except Exception as e:  # a broken plugin must say which one it is
                raise ImportError(f"policy plugin {ep.name!r} ({ep.value}, entry point group {GROUP!r}) "
                                  f"failed to load: {e}") from e
        _loaded = True
    return registered()


def make_policy(name: str, **knobs) -> Policy:
    """`testbed.core.policy.make_policy` after every policy has been loaded."""
    load_policies()
    return _make_policy(name, **knobs)


def load_routers() -> dict[str, type]:
    """Register the bundled routers and every installed plugin's (entry point group
    `testbed.routers`, as for policies); return the registry."""
    global _routers_loaded
    if not _routers_loaded:
        import testbed.routers  # noqa: F401  (importing the package registers the bundled routers)

        for ep in entry_points(group=ROUTER_GROUP):
            try:
                ep.load()
            except Exception as e:
                raise ImportError(f"router plugin {ep.name!r} ({ep.value}, entry point group {ROUTER_GROUP!r}) "
                                  f"failed to load: {e}") from e
        _routers_loaded = True
    return registered_routers()


def make_router(name: str, **knobs) -> Router:
    """`testbed.core.router.make_router` after every router has been loaded."""
    load_routers()
    return _make_router(name, **knobs)
