"""Make SGLang 0.5.23's scheduling modules importable on a CPU-only, AVX2 machine.

Import this before anything from `sglang`.  What it does, and why each piece is
irrelevant to scheduling decisions:

1. SGLANG_USE_CPU_ENGINE=1 -> SGLang's own CpuSRTPlatform
   (sglang/srt/platforms/__init__.py `_is_cpu_available`; platforms/cpu.py),
   whose capabilities.supports_triton is False (platforms/interface.py:69), so
   the paged allocator uses its torch-native paths (alloc_extend_naive /
   alloc_decode_naive, mem_cache/allocator/paged.py:41,117,245,303).
2. torch is told "no triton" (torch.utils._triton.has_triton_package is
   functools.cache'd; we evaluate it before the stub is on sys.path), so
   torch._inductor/_dynamo never try to use the stub.
3. stubs/triton: import-only stand-in for the GPU kernel compiler; SGLang
   modules decorate kernels at import time; none is launched (see 1).
4. Import-only stand-ins for GPU/multimodal packages reached only through
   model-config and multimodal imports (`_PERMISSIVE`): torchvision (image
   transforms for VLM configs) and any other name listed there.  Any attribute
   access on them yields a dummy; calling a dummy raises.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import types

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch.utils._triton as _tt  # noqa: E402

_tt.has_triton_package()  # cache False before the stub becomes importable
# torch modules that probe `import triton` at module level: import them now,
# while triton is absent, so they settle on their no-triton branches.
import torch._dynamo  # noqa: E402,F401
import torch._inductor.runtime.triton_compat  # noqa: E402,F401
import torch._inductor.runtime.hints  # noqa: E402,F401

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "stubs"))

# top-level packages replaced by permissive import-only modules
_PERMISSIVE = {"torchvision", "sgl_kernel"}


class _Dummy:
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        raise RuntimeError("import-only stub called")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Dummy()

    def __mro_entries__(self, bases):
        return (object,)


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (), {})


class _PermissiveModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Meta(name, (), {})


def _importer():
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if not (fn.startswith("<frozen") or "importlib" in fn or fn == __file__):
            return f.f_globals.get("__name__", "")
        f = f.f_back
    return ""


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        # Serve the stand-in only to an `import` written in an sglang module, so
        # that transformers' availability probes still see the package absent.
        if fullname.split(".")[0] in _PERMISSIVE and _importer().startswith("sglang"):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _PermissiveModule(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
