"""The one place where kdajit calls `cute.compile`, and the object-file round trip.

A compile takes a kernel key (kdajit.keys) and returns a TVM-FFI function that is called with torch
tensors on the caller's current stream. The key's `arch` is passed as `--gpu-arch`, so any
supported arch compiles on any machine, with or without a GPU.

Objects load through CuTe DSL's loader (which imports the DSL, ~2.5 s once per process) or, with
KDAJIT_LOADER=linked, linked into a shared library by the system C compiler and loaded by TVM-FFI
alone: an object needs only the DSL's libcute_dsl_runtime and libtvm_ffi. `-Bsymbolic` binds each
library's calls to its own copies of the names every kdajit object shares (`__cute_internal_kdajit_
kernel_cuda_init`, ...), so two loaded kernels can never call into each other.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os
import subprocess
import time
import warnings
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


def compile_template(kernel, arch: str):
    """Trace and compile a template instance for `arch` (compile_key's recipe; benchmarks use it
    directly for measurement-only variants that no key describes)."""
    cute = _cute()
    options = f"--enable-tvm-ffi --gpu-arch {arch}"
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
    """Load an object written by `export_object`; raises on any problem with the file.

    With KDAJIT_LOADER=linked the object is linked into `path + ".so"` (so `path` must be in a
    private directory) and loaded without the DSL; where that fails, the DSL loads it (warned once).
    """
    if env.object_loader() == "linked":
        try:
            return load_linked(path)
        except LinkError as e:
            _warn_link_failure(str(e))
    cute = _cute()
    return cute.runtime.load_module(path, enable_tvm_ffi=True)[SYMBOL]


class LinkError(RuntimeError):
    """An object could not be linked into a shared library, or the library not loaded."""


_LINK_WARNED: list[str] = []


def _warn_link_failure(reason: str) -> None:
    """Warn at the first failed link of the process only (later reasons name other temporary paths)."""
    if not _LINK_WARNED:
        _LINK_WARNED.append(reason)
        warnings.warn(f"kdajit: KDAJIT_LOADER=linked could not link a cached kernel ({reason}); loading cached "
                      f"kernels through CuTe DSL instead (imports the DSL once)", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=None)
def runtime_libraries() -> tuple[str, str]:
    """(libcute_dsl_runtime.so, libtvm_ffi.so), found without importing the DSL: CUTE_DSL_LIBS's
    runtime if set, as the DSL picks it, else the one runtime flavour the installed package holds."""
    found = [p for p in env.cute_dsl_libs() if p.endswith("libcute_dsl_runtime.so")]
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    if not found and spec is not None:
        package = next(iter(spec.submodule_search_locations))
        found = sorted(glob.glob(os.path.join(package, "cu*", "lib", "libcute_dsl_runtime.so")))
    if len(found) != 1:
        raise LinkError(f"expected one libcute_dsl_runtime.so (CUTE_DSL_LIBS or the nvidia-cutlass-dsl package), "
                        f"found {found or 'none'}")
    import tvm_ffi

    return found[0], tvm_ffi.libinfo.find_libtvm_ffi()


def link_shared(obj: str, out: str) -> None:
    """Link the object `obj` into the shared library `out` against the two runtime libraries."""
    libs = runtime_libraries()
    dirs = [f for lib in libs for f in (f"-L{os.path.dirname(lib)}", f"-Wl,-rpath,{os.path.dirname(lib)}")]
    cmd = [env.c_compiler(), "-shared", "-Wl,-Bsymbolic", "-o", out, obj, *dirs, "-lcute_dsl_runtime", "-ltvm_ffi"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LinkError(f"{cmd[0]}: {type(e).__name__}: {e}") from None
    if proc.returncode != 0:
        raise LinkError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")


@functools.lru_cache(maxsize=None)
def _load_runtime_libraries() -> tuple[ctypes.CDLL, ...]:
    """The two runtime libraries, loaded once with global symbols (as the DSL's own loader does)."""
    return tuple(ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL) for lib in runtime_libraries())


def load_linked(path: str) -> Callable:
    """Link the object at `path` (in a private directory) and load it with TVM-FFI alone."""
    so = path + ".so"
    link_shared(path, so)
    import tvm_ffi

    try:
        _load_runtime_libraries()
        return tvm_ffi.load_module(so)[SYMBOL]
    except Exception as e:  # noqa: BLE001 - any load failure means: use the DSL's loader
        raise LinkError(f"loading {so}: {type(e).__name__}: {e}") from None
