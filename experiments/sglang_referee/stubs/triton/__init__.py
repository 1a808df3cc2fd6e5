"""Import-only stand-in for `triton` (a GPU kernel compiler).

SGLang's utils/allocator/memory-pool modules decorate Triton kernels at import
time.  With SGLANG_USE_CPU_ENGINE=1 SGLang's CpuSRTPlatform reports
``capabilities.supports_triton = False`` (sglang/srt/platforms/interface.py:69),
so the allocator takes its torch-native paths (alloc_extend_naive /
alloc_decode_naive, sglang/srt/mem_cache/allocator/paged.py:245-320) and no
Triton kernel is ever launched.  This stub only makes the decorators and
`tl.constexpr` annotations importable; calling a "kernel" raises.
"""

from . import language  # noqa: F401  (before anything can shadow it)

__version__ = "3.4.0"  # satisfies version gates; nothing here compiles anything


class _Kernel:
    def __init__(self, fn=None, **kw):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "stub_kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, grid):
        def launch(*a, **k):
            raise RuntimeError(f"triton stub: kernel {self.__name__} cannot run on CPU")
        return launch

    def __call__(self, *a, **k):
        if self.fn is None and len(a) == 1 and callable(a[0]) and not k:
            return _Kernel(a[0])
        raise RuntimeError(f"triton stub: kernel {self.__name__} cannot run on CPU")


def jit(fn=None, **kw):
    if fn is None:
        return lambda f: _Kernel(f)
    return _Kernel(fn)


def autotune(*a, **k):
    return lambda f: f if isinstance(f, _Kernel) else _Kernel(f)


def heuristics(*a, **k):
    return lambda f: f if isinstance(f, _Kernel) else _Kernel(f)


class Config:
    def __init__(self, *a, **k):
        self.args, self.kwargs = a, k


def cdiv(a, b):
    return -(-a // b)


def next_power_of_2(n):
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


