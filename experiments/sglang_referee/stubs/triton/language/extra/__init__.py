"""Import-only stand-in for `triton.language.extra` (see triton/__init__.py)."""
from . import libdevice  # noqa: F401
