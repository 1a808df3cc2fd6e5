"""The bundled batching policies. Every module in this package is imported here, and the
`@register` decorator in each makes its policy selectable as `policy=<name>`: adding a
policy is adding a module (and its `testbed/conf/policy/<name>.yaml`). The core never imports
this package; the application does (`testbed.app.assembly.plugins`), together with the policies that
other installed packages declare in the `testbed.policies` entry point group."""
import importlib
import pkgutil

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")):
    importlib.import_module(f"{__name__}.{_mod}")

from testbed.core.policy import make_policy, registered  # noqa: E402,F401
