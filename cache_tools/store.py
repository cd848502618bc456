"""Walking a cache root: entries, toolchain directories, sizes, and safe removal.

Nothing here imports CuTe DSL. The layout is described in `kdajit.cache`.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from kdajit import cache

_TC = re.compile(r"^tc-([0-9a-f]{16})$")
_LAYOUT = re.compile(r"^v(\d+)$")


@dataclass
class Entry:
    """One entry directory as found on disk (not verified: see `cache.check_entry`)."""

    root: Path
    relpath: str
    arch: str
    toolchain: str
    spec: str
    config: str
    meta: dict | None
    size: int
    last_used: float  # mtime of meta.json (touched on each process's first load)
    current: bool = field(default=False)

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


def subdirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_dir() and not p.is_symlink())
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def toolchain_dirs(root: Path) -> Iterator[tuple[str, str, Path]]:
    """(arch, fingerprint, directory) of every toolchain directory of the current layout."""
    for arch_dir in subdirs(root / cache.LAYOUT):
        for tc_dir in subdirs(arch_dir):
            m = _TC.match(tc_dir.name)
            if m:
                yield arch_dir.name, m.group(1), tc_dir


def other_layouts(root: Path) -> list[Path]:
    """Layout directories of older schemas (v0, ...); newer ones belong to a newer kdajit."""
    out = []
    for d in subdirs(root):
        m = _LAYOUT.match(d.name)
        if m and int(m.group(1)) < cache.SCHEMA:
            out.append(d)
    return out


def _read_meta(path: Path) -> dict | None:
    try:
        meta = json.loads(path.read_bytes())
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


def iter_entries(root: Path, current_fp: str | None = None) -> Iterator[Entry]:
    current_fp = current_fp or cache.toolchain_fingerprint()
    for arch, fp, tc_dir in toolchain_dirs(root):
        for spec_dir in subdirs(tc_dir / "kernels"):
            for entry_dir in subdirs(spec_dir):
                size = 0
                for f in ("kernel.o", cache.META):
                    try:
                        size += os.lstat(entry_dir / f).st_size
                    except OSError:
                        pass
                try:
                    last_used = os.lstat(entry_dir / cache.META).st_mtime
                except OSError:
                    last_used = 0.0
                relpath = entry_dir.relative_to(root).as_posix()
                yield Entry(root, relpath, arch, fp, spec_dir.name, entry_dir.name,
                            _read_meta(entry_dir / cache.META), size, last_used, fp == current_fp)


def read_toolchain(tc_dir: Path) -> dict | None:
    """The components recorded in `tc_dir/toolchain.json`, if readable."""
    doc = _read_meta(tc_dir / cache.TOOLCHAIN_FILE)
    if doc and isinstance(doc.get("components"), dict):
        return doc["components"]
    return None


def tree_size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def remove_tree(root: Path, path: Path) -> None:
    """Delete `path`: first renamed out of the lookup path (so it vanishes atomically), then removed."""
    try:
        trash_parent = cache.makedirs_private(root, cache.STAGING)
        trash = trash_parent / f"trash.{os.getpid()}.{secrets.token_hex(4)}"
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def remove_empty_parents(root: Path, path: Path) -> None:
    """rmdir the now-empty spec / kernels / tc / arch directories above a removed entry."""
    stop = root / cache.LAYOUT
    parent = path.parent
    while parent != stop and stop in parent.parents:
        try:
            parent.rmdir()
        except OSError:
            return
        parent = parent.parent


def iso(ts: float | None) -> str | None:
    if not ts:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def short_time(text_or_ts) -> str:
    if text_or_ts is None or text_or_ts == 0:
        return "-"
    if isinstance(text_or_ts, (int, float)):
        return datetime.fromtimestamp(text_or_ts, timezone.utc).strftime("%Y-%m-%d %H:%M")
    return str(text_or_ts).replace("T", " ")[:16]


def human_size(n: int) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"


_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_TIME_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """'5G', '500M', '64K', '1000' (bytes); binary units."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"size {text!r} is not like 5G, 500M, 64K or 1000")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def parse_duration(text: str) -> float:
    """'30d', '12h', '90m', '45s', '2w' (seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not m:
        raise ValueError(f"duration {text!r} is not like 30d, 12h, 90m, 45s or 2w")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def now() -> float:
    return time.time()
