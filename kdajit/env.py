"""Every KDAJIT_* environment variable is read here, and only here (read lazily, at each call).

| variable | meaning | default |
|---|---|---|
| KDAJIT_CACHE_DIR | root of the on-disk kernel cache | platformdirs user cache dir / kdajit |
| KDAJIT_CACHE | `rw`, `ro` (load only) or `off` (memory only) | rw |
| KDAJIT_DISABLE_JIT | 1: a cache miss raises, naming the precompile command that fixes it | 0 |
| KDAJIT_FORCE_RECOMPILE | 1: ignore disk hits, compile and republish | 0 |
| KDAJIT_ARCH | SM arch to compile for (sm_80, sm_90a, sm_100a); default: the current GPU, else sm_90a | - |
| KDAJIT_LOCK_DIR | where per-entry lock files live | /dev/shm/kdajit-<uid>, else <cache>/locks |
| KDAJIT_LOCK_TIMEOUT | seconds to wait for another process's compile before compiling in memory | 600 |
| KDAJIT_VALIDATE | `full` (also checks cu_seqlens values: one small device-to-host copy) or `shapes` | full |
| KDAJIT_LOG | log level name for the `kdajit` logger (debug, info, warning) | warning |
"""
from __future__ import annotations

import os

_PREFIX = "KDAJIT_"


def _get(name: str, default: str = "") -> str:
    return os.environ.get(_PREFIX + name, default)


def _flag(name: str) -> bool:
    return _get(name, "0").strip().lower() in ("1", "true", "yes", "on")


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
    return _get("ARCH") or None


def lock_dir() -> str | None:
    return _get("LOCK_DIR") or None


def lock_timeout_s() -> float:
    raw = _get("LOCK_TIMEOUT", "600")
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"KDAJIT_LOCK_TIMEOUT={raw!r} is not a number of seconds") from None


def validate_mode() -> str:
    mode = _get("VALIDATE", "full").strip().lower()
    if mode not in ("full", "shapes"):
        raise ValueError(f"KDAJIT_VALIDATE={mode!r} is not valid; expected 'full' or 'shapes'")
    return mode


def log_level() -> str:
    return _get("LOG", "warning").upper()


def prepare_cute_dsl(default_arch: str) -> None:
    """Pin CuTe DSL's arch before `cutlass` is imported, so compiling works without a GPU.

    CuTe DSL reads CUTE_DSL_ARCH once, at import; without a GPU it would fall back to sm_100a.
    A value the user already set is kept. Each compile still names its arch with --gpu-arch.
    """
    os.environ.setdefault("CUTE_DSL_ARCH", default_arch)


def snapshot() -> dict[str, str]:
    """Every KDAJIT_* variable that is set, for `kdajit env` and bug reports."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(_PREFIX) or k.startswith("CUTE_DSL_") or k == "CUDA_VISIBLE_DEVICES"}
