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

GROUP = "testbed.policies"
_loaded = False


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
