"""Per-entry compile locks: which directory holds them and which file serializes a key's compile.

Locks never decide correctness (publishing is atomic), only who compiles; but a lock directory that
another user can write lets them stall every compile for the lock timeout, so a lock directory is
used only if it is ours and writable by nobody else, configured (KDAJIT_LOCK_DIR) or not.
"""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from kdajit import cache_files, cache_layout, env
from kdajit.cache_publish import makedirs_private
from kdajit.keys import _KernelKey

SHM_DIR = Path("/dev/shm")  # node-local and fast; per-user subdirectory


def candidates(root: Path | None) -> list[Path]:
    """Lock directories in order of preference."""
    configured = env.lock_dir()
    if configured:
        return [Path(configured).expanduser().absolute()]
    dirs = []
    if SHM_DIR.is_dir():
        dirs.append(SHM_DIR / f"kdajit-{os.getuid()}")
    if root is not None:
        dirs.append(root / cache_layout.LOCKS)
    return dirs


def lock_dir_problem(path: Path) -> str | None:
    """Why `path` cannot hold our locks (not ours, writable by others, not a directory), or None."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"{path}: {e.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    problem = cache_files.unsafe_mode(st, frozenset({os.getuid()}))
    if problem:
        return f"{path} is {problem}"
    if not os.access(path, os.W_OK):
        return f"{path} is not writable"
    return None


def usable_lock_dir(root: Path | None) -> tuple[Path | None, list[str]]:
    """(the first usable lock directory or None, why each one before it was refused)."""
    refused = []
    for d in candidates(root):
        try:
            if root is not None and d == root / cache_layout.LOCKS:
                makedirs_private(root, cache_layout.LOCKS)  # the root first, private
            elif not os.path.lexists(d):
                cache_files.mkdirs_private(d)
        except OSError as e:
            refused.append(f"{d}: {e.strerror or e}")
            continue
        problem = lock_dir_problem(d)
        if problem is None:
            return d, refused
        refused.append(problem)
    return None, refused


def lock_file(lock_dir: Path, root: Path | None, key: _KernelKey, fingerprint: str) -> Path:
    """The lock file in `lock_dir` that serializes compiles of `key` into `root`."""
    ident = f"{os.path.realpath(root) if root is not None else ''}\0{cache_layout.entry_relpath(key, fingerprint)}"
    return lock_dir / f"{hashlib.sha256(ident.encode()).hexdigest()[:32]}.lock"


def gpu_lock_file(lock_dir: Path, device_id: str) -> Path:
    """The lock file in `lock_dir` that serializes tuning runs (candidate timing) on one GPU."""
    return lock_dir / f"tune-{hashlib.sha256(device_id.encode()).hexdigest()[:32]}.lock"
