"""The linked loader (KDAJIT_LOADER=linked, and `auto` where it is available): load a cached kernel object
without importing CuTe DSL.

A kdajit object (`kernel.o`, exported with TVM-FFI) needs only two libraries: the DSL's
libcute_dsl_runtime (CUDA library-load and launch wrappers) and libtvm_ffi. The system C compiler
(`CC`, else `cc`) links it into a shared library beside it, and TVM-FFI loads that, so a process
whose kernels all come from the cache never pays the DSL import (~2.5 s). `-Bsymbolic` binds each
library's calls to its own copies of the names every kdajit object defines
(`__cute_internal_kdajit_kernel_cuda_init`, ...), so two loaded kernels never call into each other.

Any failure (no compiler, an ambiguous runtime, a link or load error) is a `LinkError`; `try_load`
then warns once and returns None for the rest of the process, and the caller uses the DSL's loader.
This module is not hashed into the cache's toolchain fingerprint: it changes how objects are
opened, never their code.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import importlib.util
import os
import shutil
import subprocess
import threading
import warnings
from typing import Callable

from kdajit import env
from kdajit.compiler import SYMBOL

_STATE = {"failed": False}
_LOCK = threading.Lock()


class LinkError(RuntimeError):
    """An object could not be linked into a shared library, or the library not loaded."""


def runtime_libraries() -> tuple[str, str]:
    """(libcute_dsl_runtime.so, libtvm_ffi.so), found without importing the DSL: the single runtime
    CUTE_DSL_LIBS names, else the single one the nvidia-cutlass-dsl package holds; more than one,
    or none, is a LinkError (the DSL's loader then decides)."""
    try:
        found = [p for p in env.cute_dsl_libs() if p.endswith("libcute_dsl_runtime.so")]
        spec = importlib.util.find_spec("nvidia_cutlass_dsl")
        if not found and spec is not None and spec.submodule_search_locations:
            package = next(iter(spec.submodule_search_locations))
            found = sorted(glob.glob(os.path.join(package, "cu*", "lib", "libcute_dsl_runtime.so")))
        import tvm_ffi

        tvm_lib = tvm_ffi.libinfo.find_libtvm_ffi()
    except Exception as e:  # noqa: BLE001 - whatever goes wrong here, the DSL's loader is the answer
        raise LinkError(f"finding the runtime libraries: {type(e).__name__}: {e}") from None
    if len(found) != 1:
        raise LinkError(f"expected one libcute_dsl_runtime.so (CUTE_DSL_LIBS or the nvidia-cutlass-dsl package), "
                        f"found {found or 'none'}")
    return found[0], tvm_lib


def link_shared(obj: str, out: str) -> None:
    """Link the object `obj` into the shared library `out` against the two runtime libraries."""
    dirs = [f for lib in runtime_libraries() for f in (f"-L{os.path.dirname(lib)}",
                                                       f"-Wl,-rpath,{os.path.dirname(lib)}")]
    cmd = [env.c_compiler(), "-shared", "-Wl,-Bsymbolic", "-o", out, obj, *dirs, "-lcute_dsl_runtime", "-ltvm_ffi"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise LinkError(f"{cmd[0]}: {type(e).__name__}: {e}") from None
    if proc.returncode != 0:
        raise LinkError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")


def uses_linked(mode: str) -> bool:
    """Whether loader mode `mode` (env.object_loader()) loads through this module: `linked`, or `auto` where
    `unavailable_reason` finds nothing in the way (checked once per process)."""
    return mode == "linked" or (mode == "auto" and _available())


@functools.lru_cache(maxsize=None)
def _available() -> bool:
    return unavailable_reason() is None


def unavailable_reason() -> str | None:
    """Why the linked loader would fall back here (no C compiler, no single runtime), or None."""
    if shutil.which(env.c_compiler()) is None:
        return f"no C compiler {env.c_compiler()!r} on PATH (set CC)"
    try:
        runtime_libraries()
    except LinkError as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=None)
def _runtime_handles() -> tuple[ctypes.CDLL, ...]:
    """The two runtime libraries, opened once with global symbols (as kdajit.compiler does for the DSL)."""
    return tuple(ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL) for lib in runtime_libraries())


def load(path: str) -> Callable:
    """Link the object at `path` (in a private directory: the library is written beside it as
    `path + ".so"`) and load it with TVM-FFI alone. Raises LinkError on any failure."""
    so = path + ".so"
    link_shared(path, so)
    try:
        import tvm_ffi

        _runtime_handles()
        return tvm_ffi.load_module(so)[SYMBOL]
    except Exception as e:  # noqa: BLE001 - any load failure means: use the DSL's loader
        raise LinkError(f"loading {so}: {type(e).__name__}: {e}") from None


def try_load(path: str) -> Callable | None:
    """`load(path)`, or None once any load of this process has failed (warned at that first failure)."""
    if _STATE["failed"]:
        return None
    try:
        return load(path)
    except LinkError as e:
        with _LOCK:
            first = not _STATE["failed"]
            _STATE["failed"] = True
        if first:
            warnings.warn(f"kdajit: the linked loader could not load a cached kernel ({e}); this process loads "
                          f"cached kernels through CuTe DSL instead (imports the DSL once)", RuntimeWarning,
                          stacklevel=2)
        return None
