"""Turning verified object bytes, or a fresh compile, into a callable kernel.

A cache entry is loaded from the bytes its check hashed, copied into a private temporary directory,
never by reopening the entry's path: whatever happens to the cache after the check cannot change
what runs.
"""
from __future__ import annotations

import os
import tempfile
from typing import Callable

from kdajit import cache_files, compiler, linked_loader
from kdajit.cache_layout import ARTIFACT


def load_verified(artifact: bytes, linked: bool = False) -> Callable:
    """Load the object `artifact` (bytes already verified); raises on a bad object.

    `linked` (`linked_loader.uses_linked`): through kdajit.linked_loader, without the DSL, unless that fails.
    """
    with tempfile.TemporaryDirectory(prefix="kdajit-load-") as tmp:  # 0700, ours
        path = os.path.join(tmp, ARTIFACT)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            cache_files.write_all(fd, artifact)
        finally:
            os.close(fd)
        fn = linked_loader.try_load(path) if linked else None
        return fn if fn is not None else compiler.load_object(path)


def export_bytes(compiled) -> bytes:
    """The relocatable object of a compiled kernel."""
    with tempfile.TemporaryDirectory(prefix="kdajit-export-") as tmp:
        path = os.path.join(tmp, ARTIFACT)
        compiler.export_object(compiled, path)
        with open(path, "rb") as f:
            return f.read()


def callable_of(compiled, artifact: bytes | None = None) -> Callable:
    """The function of a fresh compile; one compiled for an arch other than CUTE_DSL_ARCH has no JIT
    engine, so its object (`artifact`, else a fresh export) is loaded instead."""
    fn = compiler.callable_of(compiled)
    if fn is not None:
        return fn
    return load_verified(artifact if artifact is not None else export_bytes(compiled))
