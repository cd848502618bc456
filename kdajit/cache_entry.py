"""Checking one cache entry without loading it: trust, bounded reads, meta.json, the object's hash.

`check_entry` never raises for what it finds on disk and returns the exact object bytes it verified
(`EntryCheck.artifact`), so a loader never reopens the file by path after the check.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from kdajit import cache_files, compiler
from kdajit.cache_layout import ARTIFACT, META, SCHEMA, entry_relpath
from kdajit.keys import _KernelKey, key_from_json

MAX_META_BYTES = 64 << 10
MAX_OBJECT_BYTES = 256 << 20


@dataclass
class EntryCheck:
    """Outcome of checking one entry.

    status: "ok"; "missing" (no entry, or it vanished while being read: a prune); "unreadable" (no
    permission: a miss, left alone); "untrusted" (the path to the cache root could be changed by
    others: nothing under it is used, or moved); "corrupt" (incomplete, truncated, oversized, bad hash,
    bad meta); "foreign" (the meta describes another key or toolchain); "unsafe" (another user could
    have written it, a symlink, not a regular file). The last three are `bad`: never loaded, moved
    aside by the runtime and by `kdajit cache verify --fix`. `artifact`: the verified object bytes.
    """

    status: str
    reason: str = ""
    meta: dict | None = None
    artifact: bytes | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def bad(self) -> bool:
        return self.status in ("corrupt", "foreign", "unsafe")


def parse_json(data: bytes):
    """json.loads that raises only ValueError (deep nesting raises RecursionError otherwise)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def read_json_file(path: Path, limit: int = MAX_META_BYTES) -> dict | None:
    """A small JSON object file (meta.json, toolchain.json) for listings; None if it is anything else."""
    try:
        doc = parse_json(cache_files.read_regular(path, limit, check_owner=False))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def check_entry(root: Path, relpath: str, *, expect_key: _KernelKey | None = None,
                expect_fp: str | None = None) -> EntryCheck:
    """Verify the entry at `root/relpath` without loading it. Never raises for file problems."""
    root = cache_files.real_root(root)
    entry = root / relpath
    try:
        before = os.lstat(entry)
    except (FileNotFoundError, NotADirectoryError):
        return EntryCheck("missing")
    except PermissionError as e:
        return EntryCheck("unreadable", str(e))
    try:
        problem = cache_files.root_problem(root)
        if problem:
            return EntryCheck("untrusted", problem)
        unsafe = cache_files.unsafe_dirs(root, relpath)
        if unsafe:
            return EntryCheck("unsafe", unsafe)
        try:
            meta_bytes = cache_files.read_regular(entry / META, MAX_META_BYTES)
        except FileNotFoundError:
            return _vanished(entry, before) or EntryCheck("corrupt", "meta.json is missing (incomplete entry)")
        try:
            data = cache_files.read_regular(entry / ARTIFACT, MAX_OBJECT_BYTES)
        except FileNotFoundError:
            data = None
        check = check_content(meta_bytes, data, relpath, expect_key=expect_key, expect_fp=expect_fp)
        if data is None:
            return _vanished(entry, before) or check
        return check
    except cache_files.UnsafeFile as e:
        return EntryCheck("unsafe", cache_files.describe_error(e))
    except cache_files.OversizedFile as e:
        return EntryCheck("corrupt", cache_files.describe_error(e))
    except PermissionError as e:
        return EntryCheck("unreadable", str(e))
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return _vanished(entry, before) or EntryCheck("corrupt", f"{type(e).__name__}: {e}")
        return EntryCheck("corrupt", f"{type(e).__name__}: {e}")


def _vanished(entry: Path, before: os.stat_result) -> EntryCheck | None:
    """"missing" when the entry directory was renamed away (pruned) while it was being read."""
    try:
        now = os.lstat(entry)
    except OSError:
        return EntryCheck("missing", "removed while being read (a concurrent prune or clear)")
    if (now.st_ino, now.st_dev) != (before.st_ino, before.st_dev):
        return EntryCheck("missing", "replaced while being read (a concurrent publish)")
    return None


def check_content(meta_bytes: bytes, artifact: bytes | None, relpath: str, *,
                  expect_key: _KernelKey | None = None, expect_fp: str | None = None) -> EntryCheck:
    """Verify an entry's content: meta.json parses, describes the entry at `relpath` (and the
    expected key and toolchain), and records the object's exact size and sha256."""
    try:
        meta = parse_json(meta_bytes)
    except ValueError as e:
        return EntryCheck("corrupt", f"meta.json is not valid JSON ({e})")
    problem = _meta_problem(meta)
    if problem:
        return EntryCheck("corrupt", f"meta.json: {problem}", meta if isinstance(meta, dict) else None)
    try:
        meta_key = key_from_json(meta["key"])
        described = entry_relpath(meta_key, meta["toolchain_fp"])
    except (ValueError, TypeError, AttributeError, RecursionError) as e:
        return EntryCheck("corrupt", f"meta.json: unknown key ({type(e).__name__}: {e})", meta)
    if expect_key is not None and meta_key != expect_key:
        return EntryCheck("foreign", f"meta.json describes {meta_key}, not {expect_key}", meta)
    if expect_fp is not None and meta["toolchain_fp"] != expect_fp:
        return EntryCheck("foreign", f"built by toolchain tc-{meta['toolchain_fp']}, not tc-{expect_fp}", meta)
    if described != relpath:
        return EntryCheck("foreign", f"meta.json describes the entry {described}, not this one", meta)
    art = meta["artifact"]
    if artifact is None:
        return EntryCheck("corrupt", f"{art['file']} is missing", meta)
    if len(artifact) != art["bytes"]:
        return EntryCheck("corrupt", f"{art['file']} has {len(artifact)} bytes, meta.json says {art['bytes']} "
                                     f"(truncated or overwritten)", meta)
    if hashlib.sha256(artifact).hexdigest() != art["sha256"]:
        return EntryCheck("corrupt", f"{art['file']} sha256 does not match meta.json", meta)
    return EntryCheck("ok", meta=meta, artifact=artifact)


def _meta_problem(meta) -> str | None:
    if not isinstance(meta, dict):
        return "not an object"
    if meta.get("schema") != SCHEMA or meta.get("kind") != "kernel":
        return f"schema/kind {meta.get('schema')!r}/{meta.get('kind')!r}, expected {SCHEMA}/'kernel'"
    fp = meta.get("toolchain_fp")
    if not isinstance(meta.get("key"), dict) or not isinstance(fp, str) or len(fp) != 16 \
            or not all(c in "0123456789abcdef" for c in fp):
        return "key or toolchain_fp missing or malformed"
    art = meta.get("artifact")
    if not isinstance(art, dict) or art.get("file") != ARTIFACT or type(art.get("bytes")) is not int \
            or not isinstance(art.get("sha256"), str):
        return "artifact record missing or malformed"
    if meta.get("symbol") != compiler.SYMBOL:
        return f"symbol {meta.get('symbol')!r}, expected {compiler.SYMBOL!r}"
    return None


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_meta(key: _KernelKey, fingerprint: str, artifact: bytes, compile_s: float, kdajit_version: str) -> bytes:
    """The meta.json of a freshly compiled entry."""
    meta = {
        "schema": SCHEMA, "kind": "kernel", "template": key.TEMPLATE, "arch": key.arch,
        "key": key.to_json(), "toolchain_fp": fingerprint, "symbol": compiler.SYMBOL,
        "artifact": {"file": ARTIFACT, "bytes": len(artifact), "sha256": hashlib.sha256(artifact).hexdigest()},
        "compile_s": round(compile_s, 3), "created_at": utc_now(),
        "created_by": {"host": socket.gethostname(), "pid": os.getpid(), "python": sys.version.split()[0],
                       "kdajit": kdajit_version},
    }
    return json.dumps(meta, indent=1, sort_keys=True).encode()
