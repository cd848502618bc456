"""`kdajit cache export | import`: relocatable, hash-checked bundles of cache entries.

A bundle is a tar (gzip when the name ends in .gz/.tgz) holding `kdajit-bundle.json` first, then
`entries/<relpath>/{kernel.o,meta.json}` for each entry and `records/<relpath>` for each tuning
record of the exported toolchains, relpaths relative to the cache root (no absolute paths, owners
or modes travel). The manifest records each file's size and sha256 and the
full toolchain components of each fingerprint.

A bundle's objects are native code that will run in every process using the cache, and its hashes
only prove it is self-consistent, not who made it. So importing is a deliberate act of trust in one
file: `export` prints the bundle's sha256, and `import` requires it (`--sha256`), unless
`--trust-unpinned-bundle` says the bundle is trusted as is. Import then re-checks everything
(manifest hashes, the meta's own object hash, that each meta describes its relpath, that each
toolchain record hashes to its fingerprint) and publishes each entry exactly as a compile does.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import socket
import tarfile
import time
from pathlib import Path

from kdajit import cache_layout, tune_records
from kdajit.cache_entry import MAX_OBJECT_BYTES, check_content, check_entry, parse_json, utc_now
from kdajit.cache_publish import makedirs_private, publish_entry, quarantine_entry, write_toolchain_record
from kdajit.cache_toolchain import fingerprint_of, toolchain_components, toolchain_fingerprint
from kdajit.cache_tools.entries import read_toolchain, select_entries
from kdajit.cache_tools.units import human_size

FORMAT = "kdajit-cache-bundle"
MANIFEST = "kdajit-bundle.json"
_MAX_MANIFEST_BYTES = 16 << 20


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file's content, read in blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def export_bundle(root: Path, out: Path, *, archs: list[str] | None, spec: str | None, all_toolchains: bool,
                  as_json: bool) -> int:
    out = out.absolute()
    if not out.parent.is_dir():
        raise ValueError(f"cannot write the bundle {out}: the folder {out.parent} does not exist")
    fp = toolchain_fingerprint()
    chosen = select_entries(root, archs, spec, "all" if all_toolchains else "current")
    manifest = {"format": FORMAT, "schema": cache_layout.SCHEMA, "created_at": utc_now(),
                "created_by": {"host": socket.gethostname(), "kdajit": toolchain_components()["kdajit"]},
                "toolchains": {}, "entries": []}
    payload: list[tuple[str, bytes]] = []
    skipped = []
    for e in chosen:
        check = check_entry(root, e.relpath, expect_fp=e.toolchain)
        if not check.ok:
            skipped.append({"relpath": e.relpath, "status": check.status, "reason": check.reason})
            continue
        blobs = {cache_layout.ARTIFACT: check.artifact,
                 cache_layout.META: json.dumps(check.meta, indent=1, sort_keys=True).encode()}
        manifest["entries"].append({"relpath": e.relpath, "files": {
            name: {"bytes": len(data), "sha256": _sha(data)} for name, data in blobs.items()}})
        payload += [(f"entries/{e.relpath}/{name}", data) for name, data in blobs.items()]
        if e.toolchain not in manifest["toolchains"]:
            components = read_toolchain(root, e.arch, e.toolchain)
            if components is None and e.toolchain == fp:
                components = toolchain_components()
            manifest["toolchains"][e.toolchain] = components
    manifest["records"] = []
    for where in cache_layout.record_paths(root):
        if (not all_toolchains and where.toolchain != fp or archs and where.arch not in archs
                or spec and spec not in where.spec):
            continue
        try:
            record = tune_records.load_record_file(root, where.relpath)
        except (OSError, ValueError) as e:
            skipped.append({"relpath": where.relpath, "status": "bad record", "reason": str(e)})
            continue
        data = tune_records.record_bytes(record)
        manifest["records"].append({"relpath": where.relpath, "bytes": len(data), "sha256": _sha(data)})
        payload.append((f"records/{where.relpath}", data))
    result = {"bundle": str(out), "root": str(root), "exported": len(manifest["entries"]),
              "records": len(manifest["records"]), "skipped": skipped, "toolchains": sorted(manifest["toolchains"])}
    exported = manifest["entries"] or manifest["records"]
    if exported:
        tmp = out.with_name(f".{out.name}.{os.getpid()}.{secrets.token_hex(3)}.tmp")
        mode = "w:gz" if out.name.endswith((".gz", ".tgz")) else "w"
        try:
            with tarfile.open(tmp, mode, format=tarfile.PAX_FORMAT) as tar:
                for name, data in [(MANIFEST, json.dumps(manifest, indent=1).encode())] + payload:
                    info = tarfile.TarInfo(name)
                    info.size, info.mode, info.mtime = len(data), 0o644, int(time.time())
                    tar.addfile(info, io.BytesIO(data))
            os.replace(tmp, out)
        except OSError as e:
            raise OSError(e.errno, f"cannot write the bundle {out}: {e.strerror}") from None
        finally:
            if tmp.exists():
                tmp.unlink()
        result["bytes"] = out.stat().st_size
        result["sha256"] = file_sha256(out)
    if as_json:
        print(json.dumps(result, indent=1))
    else:
        for s in skipped:
            print(f"skipped {s['relpath']}: {s['status']} ({s['reason']})")
        if exported:
            print(f"export: {result['exported']} entries, {result['records']} tuning records "
                  f"({human_size(result['bytes'])}) -> {out}")
            print(f"sha256: {result['sha256']}")
            print(f"import it with: kdajit cache import {out.name} --sha256 {result['sha256']}")
        else:
            print(f"export: nothing to export from {root} (filters: arch={archs}, spec={spec}, "
                  f"{'all toolchains' if all_toolchains else 'current toolchain tc-' + fp})")
    return 0 if exported and not skipped else 1


def _read_member(tar: tarfile.TarFile, members: dict, name: str, limit: int = MAX_OBJECT_BYTES) -> bytes:
    m = members.get(name)
    if m is None or not m.isfile():
        raise ValueError(f"{name} is missing from the bundle (or not a regular file)")
    if m.size > limit:
        raise ValueError(f"{name} is {m.size} bytes, over the {limit}-byte limit")
    f = tar.extractfile(m)
    return f.read() if f else b""


def _typed(value, kind, what: str):
    if not isinstance(value, kind) or kind is int and isinstance(value, bool):
        raise ValueError(f"bundle manifest: {what} must be {kind.__name__ if kind is not dict else 'an object'}, "
                         f"got {type(value).__name__}")
    return value


def parse_manifest(data: bytes, src: Path) -> tuple[dict, list[dict], list[dict]]:
    """(toolchains, entries, tuning records) of a bundle manifest, every field's JSON type checked;
    ValueError otherwise."""
    try:
        manifest = parse_json(data)
    except ValueError as e:
        raise ValueError(f"{src}: {MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or manifest.get("schema") != cache_layout.SCHEMA:
        raise ValueError(f"{src} is not a kdajit cache bundle of schema {cache_layout.SCHEMA}")
    toolchains = _typed(manifest.get("toolchains", {}), dict, "'toolchains'")
    for fp, components in toolchains.items():
        if components is not None:
            _typed(components, dict, f"toolchains[{fp!r}]")
    entries = _typed(manifest.get("entries", []), list, "'entries'")
    for i, item in enumerate(entries):
        _typed(item, dict, f"entries[{i}]")
        _typed(item.get("relpath"), str, f"entries[{i}].relpath")
        files = _typed(item.get("files"), dict, f"entries[{i}].files")
        for name in cache_layout.ENTRY_FILES:
            record = _typed(files.get(name), dict, f"entries[{i}].files[{name!r}]")
            _typed(record.get("bytes"), int, f"entries[{i}].files[{name!r}].bytes")
            _typed(record.get("sha256"), str, f"entries[{i}].files[{name!r}].sha256")
    records = _typed(manifest.get("records", []), list, "'records'")
    for i, item in enumerate(records):
        _typed(item, dict, f"records[{i}]")
        _typed(item.get("relpath"), str, f"records[{i}].relpath")
        _typed(item.get("bytes"), int, f"records[{i}].bytes")
        _typed(item.get("sha256"), str, f"records[{i}].sha256")
    return toolchains, entries, records


def _import_record(tar, members: dict, item: dict, root: Path) -> str:
    """Verify one tuning record of the bundle (hash, schema, that it describes its path) and store it."""
    where = cache_layout.parse_record_relpath(item["relpath"])
    data = _read_member(tar, members, f"records/{where.relpath}", tune_records.MAX_RECORD_BYTES)
    if len(data) != item["bytes"] or _sha(data) != item["sha256"]:
        raise ValueError("the record does not match the bundle's sha256")
    record = tune_records.TuningRecord.from_json(parse_json(data))
    if tune_records.record_relpath(record.key, record.toolchain) != where.relpath:
        raise ValueError("the record describes another path")
    tune_records.write_record(root, record)
    return "imported"


def _import_entry(tar, members: dict, item: dict, toolchains: dict, root: Path, modes: tuple[int, int]) -> str:
    """Verify one manifest entry and publish it: "imported" or "present"; ValueError when it is bad."""
    where = cache_layout.parse_entry_relpath(item["relpath"])
    blobs = {}
    for name in cache_layout.ENTRY_FILES:
        data = _read_member(tar, members, f"entries/{where.relpath}/{name}")
        want = item["files"][name]
        if len(data) != want["bytes"] or _sha(data) != want["sha256"]:
            raise ValueError(f"{name} does not match the bundle's sha256")
        blobs[name] = data
    check = check_content(blobs[cache_layout.META], blobs[cache_layout.ARTIFACT], where.relpath,
                          expect_fp=where.toolchain)
    if not check.ok:
        raise ValueError(f"{check.status}: {check.reason}")
    components = toolchains.get(where.toolchain)
    if components is not None and fingerprint_of(components) != where.toolchain:
        raise ValueError(f"the bundle's toolchain record does not hash to tc-{where.toolchain}")
    file_mode, dir_mode = modes
    if components is not None:
        write_toolchain_record(root, where.arch, where.toolchain, components, mode=file_mode)
    existing = check_entry(root, where.relpath)
    if existing.ok:
        return "present"
    if existing.bad:
        quarantine_entry(root, where.relpath, f"replaced by import: {existing.status}: {existing.reason}")
    ours = publish_entry(root, where.relpath, blobs, file_mode=file_mode, dir_mode=dir_mode)
    return "imported" if ours else "present"


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


def _writable_root(root: Path) -> None:
    """Create the root (private) and prove it takes files, or raise one OSError that says so."""
    try:
        makedirs_private(root, cache_layout.STAGING)
        probe = root / cache_layout.STAGING / f".probe.{os.getpid()}.{secrets.token_hex(3)}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OSError(e.errno, f"cannot import into {root}: {e.strerror} ({e.filename}); pick a writable "
                               f"--cache-dir") from None


def import_bundle(root: Path, src: Path, *, sha256: str | None, trust_unpinned: bool, world_readable: bool,
                  as_json: bool) -> int:
    if not src.is_file():
        raise ValueError(f"bundle {src} does not exist or is not a file")
    actual = file_sha256(src)
    if sha256 is None and not trust_unpinned:
        raise ValueError(f"importing {src} would run its native code in every process using {root}; pass the "
                         f"sha256 that `kdajit cache export` printed for it (--sha256 <hex>), or "
                         f"--trust-unpinned-bundle if you trust this file as it is (its sha256 is {actual})")
    if sha256 is not None and sha256.strip().lower() != actual:
        raise ValueError(f"bundle {src} has sha256 {actual}, not the pinned {sha256}: refusing to import it")
    fp = toolchain_fingerprint()
    modes = (0o644, 0o755) if world_readable else (0o600, 0o700)
    try:
        tar = tarfile.open(src, "r:*")
    except tarfile.TarError as e:
        raise ValueError(f"{src} is not a readable tar bundle ({e})") from None
    results = []
    with tar:
        try:
            members = {m.name: m for m in tar.getmembers()}
            manifest = _read_member(tar, members, MANIFEST, _MAX_MANIFEST_BYTES)
            toolchains, items, record_items = parse_manifest(manifest, src)
        except tarfile.TarError as e:
            raise ValueError(f"{src} is not a readable tar bundle ({e})") from None
        _writable_root(root)
        for item in items:
            r = {"relpath": item["relpath"], "status": "failed", "error": None}
            results.append(r)
            try:
                r["status"] = _import_entry(tar, members, item, toolchains, root, modes)
                if world_readable:
                    _open_up(root, item["relpath"])
                r["current"] = cache_layout.parse_entry_relpath(item["relpath"]).toolchain == fp
            except (ValueError, OSError, tarfile.TarError) as e:
                r["error"] = f"{type(e).__name__}: {e}"
        for item in record_items:
            r = {"relpath": item["relpath"], "status": "failed", "error": None, "record": True}
            results.append(r)
            try:
                r["status"] = _import_record(tar, members, item, root)
                if world_readable:
                    _open_up(root, item["relpath"].rsplit("/", 1)[0])
                    os.chmod(root / item["relpath"], 0o644)
                r["current"] = cache_layout.parse_record_relpath(item["relpath"]).toolchain == fp
            except (ValueError, OSError, tarfile.TarError) as e:
                r["error"] = f"{type(e).__name__}: {e}"
    counts = {s: sum(r["status"] == s for r in results) for s in ("imported", "present", "failed")}
    current = sum(bool(r.get("current")) for r in results)
    if as_json:
        print(json.dumps({"bundle": str(src), "sha256": actual, "root": str(root), **counts,
                          "current_toolchain": current, "entries": results}, indent=1))
    else:
        for r in results:
            if r["status"] == "failed":
                print(f"FAILED {r['relpath'] or '?'}: {r['error']}")
        print(f"import: {counts['imported']} imported, {counts['present']} already present, {counts['failed']} failed "
              f"into {root}; {current} of {len(results)} match this installation's toolchain tc-{fp}")
        if results and not current and not counts["failed"]:
            print("warning: no imported entry matches this installation (different kdajit or nvidia-cutlass-dsl); "
                  "`kdajit cache why` shows the difference")
    return 1 if counts["failed"] or not results else 0
