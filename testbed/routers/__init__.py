"""The bundled routers. Every module in this package is imported here, and the `@register_router`
decorator in each makes its router selectable as `router=<name>`: adding a router is adding a
module (and its `testbed/conf/router/<name>.yaml`). The core never imports this package; the
application does (`testbed.app.assembly.plugins`), with the routers other installed packages declare in
the `testbed.routers` entry point group."""
import importlib
import pkgutil

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")):
    importlib.import_module(f"{__name__}.{_mod}")

from testbed.core.router import make_router, registered_routers  # noqa: E402,F401
