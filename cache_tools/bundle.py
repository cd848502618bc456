"""`kdajit cache export | import`: relocatable, hash-checked bundles of cache entries.

A bundle is a tar (gzip when the name ends in .gz/.tgz) holding `kdajit-bundle.json` first, then
`entries/<relpath>/{kernel.o,meta.json}` for each entry, relpaths relative to the cache root (no
absolute paths, owners or modes travel). The manifest records each file's size and sha256 and the
full toolchain components of each fingerprint. Import re-checks everything (manifest hashes, the
meta's own object hash, that each meta describes its relpath, that each toolchain record hashes to
its fingerprint), builds each entry in staging/ and publishes it with one rename, like a compile.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import socket
import tarfile
import time
from pathlib import Path

from kdajit.cache_tools import store
from kdajit.cache_tools.inspection import select_entries

from kdajit import cache

FORMAT = "kdajit-cache-bundle"
MANIFEST = "kdajit-bundle.json"
_FILES = (cache.ARTIFACT, cache.META)
_MAX_FILE_BYTES = 512 << 20
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
_RELPATH = re.compile(rf"^{cache.LAYOUT}/{_NAME}/tc-[0-9a-f]{{16}}/kernels/{_NAME}/{_NAME}$")


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def export_bundle(root: Path, out: Path, *, archs: list[str] | None, spec: str | None, all_toolchains: bool,
                  as_json: bool) -> int:
    fp = cache.toolchain_fingerprint()
    chosen = select_entries(root, archs, spec, "all" if all_toolchains else "current")
    manifest = {"format": FORMAT, "schema": cache.SCHEMA, "created_at": cache._utc_now(),
                "created_by": {"host": socket.gethostname(), "kdajit": cache.toolchain_components()["kdajit"]},
                "toolchains": {}, "entries": []}
    payload: list[tuple[str, bytes]] = []
    skipped = []
    for e in chosen:
        check = cache.check_entry(root, e.relpath, expect_fp=e.toolchain)
        if not check.ok:
            skipped.append({"relpath": e.relpath, "status": check.status, "reason": check.reason})
            continue
        files = {}
        for name in _FILES:
            data = (e.path / name).read_bytes()
            files[name] = {"bytes": len(data), "sha256": _sha(data)}
            payload.append((f"entries/{e.relpath}/{name}", data))
        manifest["entries"].append({"relpath": e.relpath, "files": files})
        if e.toolchain not in manifest["toolchains"]:
            components = store.read_toolchain(root / cache.LAYOUT / e.arch / f"tc-{e.toolchain}")
            if components is None and e.toolchain == fp:
                components = cache.toolchain_components()
            manifest["toolchains"][e.toolchain] = components
    result = {"bundle": str(out), "root": str(root), "exported": len(manifest["entries"]), "skipped": skipped,
              "toolchains": sorted(manifest["toolchains"])}
    if manifest["entries"]:
        out = out.absolute()
        tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(3)}.tmp")
        mode = "w:gz" if out.name.endswith((".gz", ".tgz")) else "w"
        try:
            with tarfile.open(tmp, mode, format=tarfile.PAX_FORMAT) as tar:
                for name, data in [(MANIFEST, json.dumps(manifest, indent=1).encode())] + payload:
                    info = tarfile.TarInfo(name)
                    info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
                    tar.addfile(info, io.BytesIO(data))
            os.replace(tmp, out)
        finally:
            if tmp.exists():
                tmp.unlink()
        result["bytes"] = out.stat().st_size
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        for s in skipped:
            print(f"skipped {s['relpath']}: {s['status']} ({s['reason']})")
        if manifest["entries"]:
            print(f"export: {result['exported']} entries ({store.human_size(result['bytes'])}) -> {out}")
        else:
            print(f"export: nothing to export from {root} (filters: arch={archs}, spec={spec}, "
                  f"{'all toolchains' if all_toolchains else 'current toolchain tc-' + fp})")
    return 0 if manifest["entries"] and not skipped else 1


def _read_member(tar: tarfile.TarFile, members: dict, name: str) -> bytes:
    m = members.get(name)
    if m is None or not m.isfile():
        raise ValueError(f"{name} is missing from the bundle (or not a regular file)")
    if m.size > _MAX_FILE_BYTES:
        raise ValueError(f"{name} is {m.size} bytes, over the {_MAX_FILE_BYTES} limit")
    f = tar.extractfile(m)
    return f.read() if f else b""


def _publish_imported(root: Path, relpath: str, blobs: dict[str, bytes], file_mode: int, dir_mode: int) -> str:
    final = root / relpath
    existing = cache.check_entry(root, relpath)
    if existing.ok:
        return "present"
    if existing.bad:
        cache.quarantine_entry(root, relpath, f"replaced by import: {existing.status}: {existing.reason}")
    cache.makedirs_private(root, str(Path(relpath).parent))
    staging = cache.makedirs_private(root, f"{cache.STAGING}/{socket.gethostname()[:40]}.{os.getpid()}."
                                           f"{secrets.token_hex(4)}")
    try:
        stage = staging / final.name
        os.mkdir(stage, 0o700)
        for name in (cache.ARTIFACT, cache.META):  # meta.json last, as in a compile
            cache.write_file_atomic(stage / name, blobs[name], mode=file_mode)
        os.chmod(stage, dir_mode)
        try:
            os.rename(stage, final)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):  # another import or a compile won
                return "present"
            raise
        return "imported"
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _open_up(root: Path, relpath: str) -> None:
    """--world-readable: let other users traverse the directories we own from the root down."""
    path = root
    for part in [""] + relpath.split("/"):
        path = path / part if part else path
        try:
            st = os.lstat(path)
            if st.st_uid == os.getuid():
                os.chmod(path, 0o755)
        except OSError:
            pass


def import_bundle(root: Path, src: Path, *, world_readable: bool, as_json: bool) -> int:
    results = []
    fp = cache.toolchain_fingerprint()
    file_mode, dir_mode = (0o644, 0o755) if world_readable else (0o600, 0o700)
    try:
        tar = tarfile.open(src, "r:*")
    except tarfile.TarError as e:
        raise ValueError(f"{src} is not a readable tar bundle ({e})") from None
    with tar:
        members = {m.name: m for m in tar.getmembers()}
        manifest = json.loads(_read_member(tar, members, MANIFEST))
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("schema") != cache.SCHEMA:
            raise ValueError(f"{src} is not a kdajit cache bundle of schema {cache.SCHEMA}")
        toolchains = manifest.get("toolchains") or {}
        for item in manifest.get("entries") or []:
            relpath = item.get("relpath", "") if isinstance(item, dict) else ""
            r = {"relpath": relpath, "status": "failed", "error": None}
            results.append(r)
            try:
                if not _RELPATH.match(relpath) or ".." in relpath.split("/"):
                    raise ValueError("not a cache entry path")
                blobs = {}
                for name in _FILES:
                    data = _read_member(tar, members, f"entries/{relpath}/{name}")
                    want = item["files"][name]
                    if len(data) != want["bytes"] or _sha(data) != want["sha256"]:
                        raise ValueError(f"{name} does not match the bundle's sha256")
                    blobs[name] = data
                entry_fp = relpath.split("/")[2][3:]
                check = cache.check_content(blobs[cache.META], blobs[cache.ARTIFACT], relpath, expect_fp=entry_fp)
                if not check.ok:
                    raise ValueError(f"{check.status}: {check.reason}")
                components = toolchains.get(entry_fp)
                if components is not None and cache.fingerprint_of(components) != entry_fp:
                    raise ValueError(f"the bundle's toolchain record does not hash to tc-{entry_fp}")
                tc_dir = cache.makedirs_private(root, "/".join(relpath.split("/")[:3]))
                if components is not None and not (tc_dir / cache.TOOLCHAIN_FILE).exists():
                    cache.write_file_atomic(tc_dir / cache.TOOLCHAIN_FILE, json.dumps(
                        {"fingerprint": entry_fp, "components": components}, indent=1, sort_keys=True).encode(),
                        mode=file_mode)
                r["status"] = _publish_imported(root, relpath, blobs, file_mode, dir_mode)
                if world_readable:
                    _open_up(root, relpath)
                r["current"] = entry_fp == fp
            except (ValueError, KeyError, TypeError, OSError, tarfile.TarError) as e:
                r["error"] = f"{type(e).__name__}: {e}"
    counts = {s: sum(r["status"] == s for r in results) for s in ("imported", "present", "failed")}
    current = sum(bool(r.get("current")) for r in results)
    if as_json:
        print(json.dumps({"bundle": str(src), "root": str(root), **counts, "current_toolchain": current,
                          "entries": results}, indent=1))
    else:
        for r in results:
            if r["status"] == "failed":
                print(f"FAILED {r['relpath'] or '?'}: {r['error']}")
        print(f"import: {counts['imported']} imported, {counts['present']} already present, {counts['failed']} failed "
              f"into {root}; {current} of {len(results)} match this installation's toolchain tc-{fp}")
        if results and not current:
            print("warning: no imported entry matches this installation (different kdajit or nvidia-cutlass-dsl); "
                  "`kdajit cache why` shows the difference")
    return 1 if counts["failed"] or not results else 0
