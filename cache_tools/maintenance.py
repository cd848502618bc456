"""`kdajit cache prune | clear`: explicit deletion (nothing is evicted automatically on the hot path).

Entries are renamed out of the lookup path before being deleted, so a concurrent reader sees an
entry or no entry, never half of one; a process that already loaded an object keeps running.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

from kdajit.cache_tools import store
from kdajit.cache_tools.inspection import select_entries

from kdajit import cache

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
    host = socket.gethostname()[:40]
    for d in store.subdirs(root / cache.STAGING):
        if d.name.startswith("trash."):
            out.append(d)
            continue
        parts = d.name.rsplit(".", 2)
        try:
            age = now - os.lstat(d).st_mtime
        except OSError:
            continue
        if len(parts) == 3 and parts[0] == host and parts[1].isdigit():
            if not _pid_alive(int(parts[1])):
                out.append(d)
        elif age > STAGING_MAX_AGE_S:
            out.append(d)
    return out


def prune(root: Path, *, stale: bool, older_than: float | None, max_size: int | None, staging: bool,
          quarantine: bool, dry_run: bool, as_json: bool) -> int:
    now = store.now()
    fp = cache.toolchain_fingerprint()
    removed: list[dict] = []

    def remove(path: Path, why: str, size: int | None = None, entry: bool = False) -> None:
        size = store.tree_size(path) if size is None else size
        removed.append({"path": str(path), "reason": why, "bytes": size})
        if not dry_run:
            store.remove_tree(root, path)
            if entry:
                store.remove_empty_parents(root, path)

    if stale:
        for arch, tc, tc_dir in list(store.toolchain_dirs(root)):
            if tc != fp:
                remove(tc_dir, f"stale toolchain tc-{tc} ({arch})")
        for layout in store.other_layouts(root):
            remove(layout, f"old cache layout {layout.name}")
    entries = [e for e in store.iter_entries(root, fp) if not any(
        r["path"] == str(e.path) or e.path.as_posix().startswith(r["path"] + "/") for r in removed)]
    if older_than is not None:
        keep = []
        for e in entries:
            if now - e.last_used > older_than:
                remove(e.path, f"last used {store.short_time(e.last_used)}", e.size, entry=True)
            else:
                keep.append(e)
        entries = keep
    if max_size is not None:
        total = sum(e.size for e in entries)
        for e in sorted(entries, key=lambda e: (e.last_used, e.relpath)):
            if total <= max_size:
                break
            remove(e.path, f"over --max-size (least recently used, {store.short_time(e.last_used)})", e.size,
                   entry=True)
            total -= e.size
    if staging:
        for d in _orphan_staging(root, now):
            remove(d, "orphaned staging directory")
    if quarantine:
        for d in store.subdirs(root / cache.QUARANTINE):
            remove(d, "quarantined entry")
        for d in sorted(root.glob(f"{cache.LAYOUT}/*/tc-*/kernels/*/.quarantined.*")):
            remove(d, "quarantined entry (moved aside in place)")
    freed = sum(r["bytes"] for r in removed)
    if as_json:
        print(json.dumps({"root": str(root), "dry_run": dry_run, "removed": removed, "freed_bytes": freed}, indent=1))
    else:
        verb = "would remove" if dry_run else "removed"
        for r in removed:
            print(f"{verb} {r['path']} ({store.human_size(r['bytes'])}): {r['reason']}")
        print(f"prune: {verb} {len(removed)} item(s), {store.human_size(freed)}")
    return 0


def clear(root: Path, *, archs: list[str] | None, spec: str | None, as_json: bool) -> int:
    """Delete entries (all, or those matching --arch/--spec, of every toolchain)."""
    removed = []
    if not archs and not spec:
        for path in [root / cache.LAYOUT, *store.other_layouts(root), root / cache.QUARANTINE, root / "locks"]:
            if path.exists():
                removed.append({"path": str(path), "bytes": store.tree_size(path)})
                store.remove_tree(root, path)
        if (root / cache.STAGING).exists():  # in-flight builds there fail their publish and keep going in memory
            removed.append({"path": str(root / cache.STAGING), "bytes": store.tree_size(root / cache.STAGING)})
            shutil.rmtree(root / cache.STAGING, ignore_errors=True)
    else:
        for e in select_entries(root, archs, spec):
            removed.append({"path": str(e.path), "bytes": e.size})
            store.remove_tree(root, e.path)
            store.remove_empty_parents(root, e.path)
    freed = sum(r["bytes"] for r in removed)
    if as_json:
        print(json.dumps({"root": str(root), "removed": removed, "freed_bytes": freed}, indent=1))
    else:
        print(f"clear: removed {len(removed)} item(s), {store.human_size(freed)} under {root}")
    return 0
