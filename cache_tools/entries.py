"""The entries found under a cache root (unverified listings for `ls`, `prune`, `export`, ...).

Paths are found and parsed by `kdajit.cache_layout`; files are read bounded and non-blocking by
`kdajit.cache_entry.read_json_file`, so a damaged entry lists as "no valid meta.json", never hangs
or crashes a listing. Nothing here imports CuTe DSL.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kdajit import cache_layout
from kdajit.cache_entry import read_json_file
from kdajit.cache_toolchain import toolchain_fingerprint
from kdajit.cache_tools.units import iso


@dataclass
class Entry:
    """One entry directory as found on disk (not verified: see `cache_entry.check_entry`)."""

    root: Path
    relpath: str
    arch: str
    toolchain: str
    spec: str
    config: str
    meta: dict | None
    size: int
    last_used: float  # mtime of meta.json (touched on each process's first load)
    current: bool

    @property
    def path(self) -> Path:
        return self.root / self.relpath

    @property
    def created(self) -> str | None:
        return self.meta.get("created_at") if isinstance(self.meta, dict) else None

    def as_json(self) -> dict:
        return {"path": str(self.path), "relpath": self.relpath, "arch": self.arch, "toolchain": self.toolchain,
                "toolchain_current": self.current, "spec": self.spec, "config": self.config, "bytes": self.size,
                "created": self.created, "last_used": iso(self.last_used),
                "key": self.meta.get("key") if isinstance(self.meta, dict) else None}


def iter_entries(root: Path, current_fp: str | None = None) -> Iterator[Entry]:
    current_fp = current_fp or toolchain_fingerprint()
    for where in cache_layout.entry_paths(root):
        entry_dir = root / where.relpath
        size = 0
        for name in cache_layout.ENTRY_FILES:
            try:
                size += os.lstat(entry_dir / name).st_size
            except OSError:
                pass
        try:
            last_used = os.lstat(entry_dir / cache_layout.META).st_mtime
        except OSError:
            last_used = 0.0
        yield Entry(root, where.relpath, where.arch, where.toolchain, where.spec, where.config,
                    read_json_file(entry_dir / cache_layout.META), size, last_used, where.toolchain == current_fp)


def select_entries(root: Path, archs: list[str] | None = None, spec: str | None = None,
                   toolchain: str = "all") -> list[Entry]:
    """Entries filtered by arch, spec substring and toolchain ("all", "current" or "stale")."""
    out = []
    for e in iter_entries(root):
        if archs and e.arch not in archs:
            continue
        if spec and spec not in e.spec and spec not in e.relpath:
            continue
        if toolchain == "current" and not e.current or toolchain == "stale" and e.current:
            continue
        out.append(e)
    return out


def read_toolchain(root: Path, arch: str, fingerprint: str) -> dict | None:
    """The components recorded in a toolchain directory's toolchain.json, if readable."""
    doc = read_json_file(root / cache_layout.toolchain_relpath(arch, fingerprint) / cache_layout.TOOLCHAIN_FILE)
    if doc and isinstance(doc.get("components"), dict):
        return doc["components"]
    return None


def existing_root(root: Path, verb: str) -> Path:
    """`root`, or ValueError when it does not exist (listing a mistyped path must not say '0 entries')."""
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise ValueError(f"`kdajit cache {verb}`: the cache root {root} {what}")
    return root
