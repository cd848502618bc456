"""Every KDAJIT_* environment variable is read here, and only here (read lazily, at each call).

| variable | meaning | default |
|---|---|---|
| KDAJIT_CACHE_DIR | root of the on-disk kernel cache | platformdirs user cache dir / kdajit |
| KDAJIT_CACHE | `rw`, `ro` (load only) or `off` (memory only) | rw |
| KDAJIT_DISABLE_JIT | 1: a cache miss raises, naming the precompile command that fixes it | 0 |
| KDAJIT_FORCE_RECOMPILE | 1: ignore disk hits, compile and republish | 0 |
| KDAJIT_ARCH | SM arch to compile for (sm_80, sm_90a, sm_100a); default: the current GPU, else sm_90a | - |
| KDAJIT_LOCK_DIR | where per-entry lock files live (must be yours and private) | /dev/shm/kdajit-<uid>, else <cache>/locks |
| KDAJIT_TRUST_ROOT_OWNED | 1: load cache entries owned by root (an admin-installed shared cache): their native code runs in your process | 0 |
| KDAJIT_LOCK_TIMEOUT | seconds to wait for another process's compile before compiling in memory | 600 |
| KDAJIT_VALIDATE | `full` (also checks cu_seqlens values: one small device-to-host copy when the tensor or its version counter changes; inference tensors every call), `strict` (cu_seqlens values on every call, also after writes the version counter misses) or `shapes` | full |
| KDAJIT_COMPILE_WORKERS | default number of `kdajit precompile` worker processes (`-j`) | min(2, CPUs) |
| KDAJIT_FLA_BACKEND | 1: `import kdajit` registers and enables kdajit as FLA's "kda" backend | 0 |
| KDAJIT_FORWARD_ROUTE | `auto` (the fused kernel where the arch has one, at K = V <= 128; the standalone kernels at 256, where they are faster) or `standalone` (intra + inverse + recompute; same bits) | auto |
| KDAJIT_AUTOTUNE | `off` (reference configuration), `cached` (a stored tuning record, else the reference), `on` (tune a workload bucket without a record on first use), `force` (re-time every candidate on first use) | cached |
| KDAJIT_STRICT_BITWISE | 1: a tuning candidate whose outputs differ from the reference configuration's raises instead of being excluded with a warning | 0 |
| KDAJIT_CACHE_RO_DIRS | read-only cache layers searched after the writable root for kernels and tuning records (`os.pathsep`-separated; listing one trusts its native code) | - |
| KDAJIT_LOADER | how cached objects load: `linked` (linked into a shared library with the system C compiler, `CC` or `cc`, and loaded by TVM-FFI alone; the DSL is imported only to compile; at the first failed link the process warns once and uses `dsl`), `dsl` (CuTe DSL's loader: imports the DSL, ~2.5 s once per process) or `auto` (`linked` where a C compiler and the runtime libraries are found, else `dsl`, silently) | auto |

CuTe DSL variables that change generated code (`codegen_env`) are part of the cache's toolchain
fingerprint, so a kernel built with, say, CUTE_DSL_LINEINFO=1 is never served to a process without it.
"""
from __future__ import annotations

import os

from kdajit.keys import ARCHS

_PREFIX = "KDAJIT_"


def _get(name: str, default: str = "") -> str:
    return os.environ.get(_PREFIX + name, default)


def _flag(name: str) -> bool:
    return _get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    """KDAJIT_<name>, stripped and lowercased (unset or empty: `default`), one of `allowed`; else ValueError."""
    value = _get(name).strip().lower() or default
    if value not in allowed:
        raise ValueError(f"KDAJIT_{name}={value!r} is not valid; expected one of {allowed}")
    return value


def cache_dir() -> str | None:
    return _get("CACHE_DIR") or None


def cache_mode() -> str:
    mode = _get("CACHE", "rw").strip().lower()
    if mode not in ("rw", "ro", "off"):
        raise ValueError(f"KDAJIT_CACHE={mode!r} is not valid; expected one of 'rw', 'ro', 'off'")
    return mode


def disable_jit() -> bool:
    return _flag("DISABLE_JIT")


def force_recompile() -> bool:
    return _flag("FORCE_RECOMPILE")


def arch() -> str | None:
    value = _get("ARCH") or None
    if value is not None and value not in ARCHS:
        raise ValueError(f"KDAJIT_ARCH={value!r} is not valid; expected one of {', '.join(ARCHS)}")
    return value


def lock_dir() -> str | None:
    return _get("LOCK_DIR") or None


def trust_root_owned() -> bool:
    return _flag("TRUST_ROOT_OWNED")


def lock_timeout_s() -> float:
    raw = _get("LOCK_TIMEOUT", "600")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"KDAJIT_LOCK_TIMEOUT={raw!r} is not a number of seconds") from None


def validate_mode() -> str:
    mode = _get("VALIDATE", "full").strip().lower()
    if mode not in ("full", "strict", "shapes"):
        raise ValueError(f"KDAJIT_VALIDATE={mode!r} is not valid; expected 'full', 'strict' or 'shapes'")
    return mode


def compile_workers() -> int | None:
    raw = _get("COMPILE_WORKERS")
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"KDAJIT_COMPILE_WORKERS={raw!r} is not an integer") from None
    if n < 1:
        raise ValueError(f"KDAJIT_COMPILE_WORKERS={raw!r} must be at least 1")
    return n


def fla_backend() -> bool:
    return _flag("FLA_BACKEND")


FORWARD_ROUTES = ("auto", "standalone")


def forward_route() -> str:
    route = _get("FORWARD_ROUTE", "auto") or "auto"
    if route not in FORWARD_ROUTES:
        raise ValueError(f"KDAJIT_FORWARD_ROUTE={route!r} is not valid; expected one of {FORWARD_ROUTES}")
    return route


AUTOTUNE_MODES = ("off", "cached", "on", "force")


def autotune_mode() -> str:
    return _choice("AUTOTUNE", "cached", AUTOTUNE_MODES)


def strict_bitwise() -> bool:
    return _flag("STRICT_BITWISE")


LOADERS = ("auto", "dsl", "linked")


def object_loader() -> str:
    return _choice("LOADER", "auto", LOADERS)


def c_compiler() -> str:
    """The C compiler that links cached objects for the linked loader (CC, else cc)."""
    return os.environ.get("CC", "").strip() or "cc"


def cute_dsl_libs() -> list[str]:
    """CUTE_DSL_LIBS, the CuTe DSL runtime libraries a user pinned (os.pathsep-separated), if set."""
    return [p for p in os.environ.get("CUTE_DSL_LIBS", "").split(os.pathsep) if p]


def cache_ro_dirs() -> list[str]:
    """The read-only cache layers, in search order (empty entries dropped)."""
    return [d for d in _get("CACHE_RO_DIRS").split(os.pathsep) if d.strip()]


# CuTe DSL settings marked `affects_compile` in cutlass/base_dsl/env_manager.py that change the object
# code. Left out on purpose: CUTE_DSL_ARCH and ENABLE_TVM_FFI (kdajit passes --gpu-arch and
# --enable-tvm-ffi to every compile), LIBS (an absolute path), WARNINGS_AS_ERRORS (pass/fail only).
_CODEGEN_VARS = ("CUTE_DSL_DEBUG", "CUTE_DSL_LINEINFO", "CUTE_DSL_COMPILER_OPT", "CUTE_DSL_COMPILER_BACKEND",
                 "CUTE_DSL_ENABLE_ASSERTIONS", "CUTE_DSL_ENABLE_PYIR", "CUTE_DSL_AUTO_M2S",
                 "CUTE_DSL_TOLERATE_M2M", "CUTE_DSL_LOC_TRACEBACKS", "CUTE_DSL_DRYRUN")


def codegen_env() -> dict[str, str]:
    """The set CuTe DSL variables that change generated code (for the cache's toolchain fingerprint)."""
    return {k: os.environ[k] for k in _CODEGEN_VARS if os.environ.get(k)}


def pin_compile_worker(arch: str) -> None:
    """Make this (fresh, spawned) process a GPU-blind compile worker for `arch`.

    Called first thing in a `kdajit precompile` worker, before cutlass or torch is imported: the
    worker compiles natively for `arch` and never creates a CUDA context.
    """
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ[_PREFIX + "ARCH"] = arch
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def use_cache_dir(path: str) -> None:
    """Make `path` this process's cache root (KDAJIT_CACHE_DIR), for a CLI verb's --cache-dir."""
    os.environ[_PREFIX + "CACHE_DIR"] = path


def prepare_cute_dsl(default_arch: str) -> None:
    """Pin CuTe DSL's arch before `cutlass` is imported, so compiling works without a GPU.

    CuTe DSL reads CUTE_DSL_ARCH once, at import; without a GPU it would fall back to sm_100a.
    A value the user already set is kept. Each compile still names its arch with --gpu-arch.
    """
    os.environ.setdefault("CUTE_DSL_ARCH", default_arch)


def snapshot() -> dict[str, str]:
    """Every KDAJIT_* variable that is set, for `kdajit env` and bug reports."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(_PREFIX) or k.startswith("CUTE_DSL_") or k in ("CUDA_VISIBLE_DEVICES", "CC")}
