"""`kdajit cache prune | clear`: explicit deletion (nothing is evicted automatically on the hot path).

Entries are renamed out of the lookup path before being deleted, so a concurrent reader sees an
entry or no entry, never half of one; a process that already loaded an object keeps running.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from kdajit import cache_layout
from kdajit.cache_publish import makedirs_private
from kdajit.cache_toolchain import toolchain_fingerprint
from kdajit.cache_tools.entries import existing_root, iter_entries, select_entries
from kdajit.cache_tools.units import human_size, short_time

STAGING_MAX_AGE_S = 3600.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _orphan_staging(root: Path, now: float) -> list[Path]:
    """Staging directories (`<host>.<pid>.<rand>`) of dead builds on this host or, from other hosts,
    untouched for an hour; and trash left by an interrupted removal."""
    out = []
    for d in cache_layout.subdirs(root / cache_layout.STAGING):
        if cache_layout.is_trash(d.name):
            out.append(d)
            continue
        owner = cache_layout.parse_staging_name(d.name)
        try:
            age = now - os.lstat(d).st_mtime
        except OSError:
            continue
        if owner is not None and cache_layout.is_this_host(owner[0]):
            if not _pid_alive(owner[1]):
                out.append(d)
        elif age > STAGING_MAX_AGE_S:
            out.append(d)
    return out


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
        trash = makedirs_private(root, cache_layout.STAGING) / cache_layout.trash_name()
        os.rename(path, trash)
    except FileNotFoundError:
        return
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def remove_empty_parents(root: Path, path: Path) -> None:
    """rmdir the now-empty spec / kernels / tc / arch directories above a removed entry."""
    stop = root / cache_layout.LAYOUT
    parent = path.parent
    while parent != stop and stop in parent.parents:
        try:
            parent.rmdir()
        except OSError:
            return
        parent = parent.parent


def prune(root: Path, *, stale: bool, older_than: float | None, max_size: int | None, staging: bool,
          quarantine: bool, dry_run: bool, as_json: bool) -> int:
    existing_root(root, "prune")
    now = time.time()
    fp = toolchain_fingerprint()
    removed: list[dict] = []

    def remove(path: Path, why: str, size: int | None = None, entry: bool = False) -> None:
        size = tree_size(path) if size is None else size
        removed.append({"path": str(path), "reason": why, "bytes": size})
        if not dry_run:
            remove_tree(root, path)
            if entry:
                remove_empty_parents(root, path)

    if stale:
        for arch, tc, tc_dir in list(cache_layout.toolchain_dirs(root)):
            if tc != fp:
                remove(tc_dir, f"stale toolchain tc-{tc} ({arch})")
        for layout in cache_layout.older_layouts(root):
            remove(layout, f"old cache layout {layout.name}")
    entries = [e for e in iter_entries(root, fp) if not any(
        r["path"] == str(e.path) or e.path.as_posix().startswith(r["path"] + "/") for r in removed)]
    if older_than is not None:
        keep = []
        for e in entries:
            if now - e.last_used > older_than:
                remove(e.path, f"last used {short_time(e.last_used)}", e.size, entry=True)
            else:
                keep.append(e)
        entries = keep
    if max_size is not None:
        total = sum(e.size for e in entries)
        for e in sorted(entries, key=lambda e: (e.last_used, e.relpath)):
            if total <= max_size:
                break
            remove(e.path, f"over --max-size (least recently used, {short_time(e.last_used)})", e.size,
                   entry=True)
            total -= e.size
    if staging:
        for d in _orphan_staging(root, now):
            remove(d, "orphaned staging directory")
    if quarantine:
        for d in cache_layout.subdirs(root / cache_layout.QUARANTINE):
            remove(d, "quarantined entry")
        for d in cache_layout.quarantined_in_place(root):
            remove(d, "quarantined entry (moved aside in place)")
    freed = sum(r["bytes"] for r in removed)
    if as_json:
        print(json.dumps({"root": str(root), "dry_run": dry_run, "removed": removed, "freed_bytes": freed}, indent=1))
    else:
        verb = "would remove" if dry_run else "removed"
        for r in removed:
            print(f"{verb} {r['path']} ({human_size(r['bytes'])}): {r['reason']}")
        print(f"prune: {verb} {len(removed)} item(s), {human_size(freed)}")
    return 0


def clear(root: Path, *, archs: list[str] | None, spec: str | None, as_json: bool) -> int:
    """Delete entries (all, or those matching --arch/--spec, of every toolchain)."""
    existing_root(root, "clear")
    removed = []
    if not archs and not spec:
        for path in [root / cache_layout.LAYOUT, *cache_layout.older_layouts(root), root / cache_layout.QUARANTINE,
                     root / cache_layout.LOCKS]:
            if path.exists():
                removed.append({"path": str(path), "bytes": tree_size(path)})
                remove_tree(root, path)
        staging = root / cache_layout.STAGING
        if staging.exists():  # in-flight builds there fail their publish and keep going in memory
            removed.append({"path": str(staging), "bytes": tree_size(staging)})
            shutil.rmtree(staging, ignore_errors=True)
    else:
        for e in select_entries(root, archs, spec):
            removed.append({"path": str(e.path), "bytes": e.size})
            remove_tree(root, e.path)
            remove_empty_parents(root, e.path)
    freed = sum(r["bytes"] for r in removed)
    if as_json:
        print(json.dumps({"root": str(root), "removed": removed, "freed_bytes": freed}, indent=1))
    else:
        print(f"clear: removed {len(removed)} item(s), {human_size(freed)} under {root}")
    return 0
