"""The one place where kdajit calls `cute.compile`, and the object-file round trip.

A compile takes a kernel key (kdajit.keys) and returns a TVM-FFI function that is called with torch
tensors on the caller's current stream. The key's `arch` is passed as `--gpu-arch`, so any
supported arch compiles on any machine, with or without a GPU.
"""
from __future__ import annotations

import ctypes
import functools
import time
from typing import Callable

from kdajit import env
from kdajit.keys import AkkInverseKey, FusedForwardKey, IntraKey, RecomputeWUKey, _KernelKey

SYMBOL = "kdajit_kernel"
# Which template class builds each key type (imported lazily: importing cutlass costs ~0.6 s).
_TEMPLATES = {
    IntraKey: ("kdajit.templates.intra", "KdaIntra"),
    AkkInverseKey: ("kdajit.templates.akk_inverse", "AkkInverse"),
    RecomputeWUKey: ("kdajit.templates.recompute_wu", "RecomputeWU"),
    FusedForwardKey: ("kdajit.templates.fused_forward", "FusedForward"),
}
# Bumped when the compile recipe below changes in a way the kernel sources do not show.
RECIPE_VERSION = 1


def arch_of_capability(major: int, minor: int) -> str:
    """kdajit's compile arch for a CUDA compute capability."""
    by_major = {8: "sm_80", 9: "sm_90a", 10: "sm_100a"}
    if major not in by_major:
        raise RuntimeError(f"GPU compute capability {major}.{minor} has no kdajit kernels; supported majors are "
                           f"8 (sm_80), 9 (sm_90a), 10 (sm_100a). Set KDAJIT_ARCH to override.")
    return by_major[major]


def current_arch(device_index: int | None = None) -> str:
    """The arch to compile for: KDAJIT_ARCH, else the CUDA device's (current one by default), else sm_90a."""
    pinned = env.arch()
    if pinned:
        return pinned
    import torch

    if not torch.cuda.is_available():
        return "sm_90a"
    return arch_of_capability(*torch.cuda.get_device_capability(device_index))


@functools.lru_cache(maxsize=None)
def _cute():
    """Import CuTe DSL once, with the arch pinned and the runtime symbols global (for cross-compiles)."""
    env.prepare_cute_dsl(current_arch())
    import cutlass.cute as cute

    for lib in cute.runtime.find_runtime_libraries(enable_tvm_ffi=True):
        ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    return cute


def template_class(key: _KernelKey):
    """The template class that implements `key`."""
    import importlib

    module, name = _TEMPLATES[type(key)]
    return getattr(importlib.import_module(module), name)


def template_files() -> list[str]:
    """Source files whose content defines the generated code (hashed into the cache fingerprint)."""
    import os

    import kdajit.templates as templates_pkg

    root = os.path.dirname(templates_pkg.__file__)
    files = [os.path.join(root, f) for f in sorted(os.listdir(root)) if f.endswith(".py")]
    here = os.path.dirname(__file__)
    files += [os.path.join(here, f) for f in ("keys.py", "compiler.py")]
    return files


def compile_key(key: _KernelKey):
    """Trace and compile one kernel; returns the CuTe DSL compiled function (TVM-FFI)."""
    cls = template_class(key)
    if not cls.can_implement(key):
        raise ValueError(f"{cls.__name__} cannot implement {key}")
    return compile_template(cls(key), key.arch)


def compile_template(kernel, arch: str, ptx_dir: str | None = None):
    """Trace and compile a template instance for `arch` (compile_key's recipe; benchmarks use it
    directly for measurement-only variants that no key describes). `ptx_dir`: an existing directory that receives
    the kernel's PTX (tests that check which instructions a configuration emits)."""
    cute = _cute()
    options = f"--enable-tvm-ffi --gpu-arch {arch}" + (f" --keep-ptx --dump-dir={ptx_dir}" if ptx_dir else "")
    t0 = time.perf_counter()
    compiled = cute.compile(kernel, *kernel.fake_args(), options=options)
    compiled.kdajit_compile_s = time.perf_counter() - t0
    return compiled


def callable_of(compiled) -> Callable:
    """The raw TVM-FFI function of a compiled kernel (the lowest-overhead way to call it)."""
    return compiled.__tvm_ffi_object__()


def export_object(compiled, path: str) -> None:
    """Write a compiled kernel as a relocatable object file."""
    compiled.export_to_c(path, function_name=SYMBOL)


def load_object(path: str) -> Callable:
    """Load an object written by `export_object`; raises on any problem with the file."""
    cute = _cute()
    return cute.runtime.load_module(path, enable_tvm_ffi=True)[SYMBOL]
