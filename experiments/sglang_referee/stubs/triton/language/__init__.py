"""Import-only stand-in for `triton.language` (see ../__init__.py)."""


class constexpr:  # used as an annotation and as tl.constexpr(value)
    def __init__(self, value=None):
        self.value = value


class _Dtype:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"tl.{self.name}"


for _n in ("int1 int8 int16 int32 int64 uint8 uint16 uint32 uint64 float16 bfloat16 "
           "float32 float64 float8e4nv float8e5 float8e4b15 float8e4b8 float8e5b16").split():
    globals()[_n] = _Dtype(_n)

dtype = _Dtype
tensor = object


def __getattr__(name):
    def _fn(*a, **k):
        raise RuntimeError(f"triton stub: tl.{name} cannot run on CPU")
    return _fn
