"""Import-only stand-in for `triton.language.extra.libdevice`."""


def __getattr__(name):
    def _fn(*a, **k):
        raise RuntimeError(f"triton stub: libdevice.{name} cannot run on CPU")
    return _fn
