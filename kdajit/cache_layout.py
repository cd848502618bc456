"""The on-disk layout of the kernel cache: the one module that writes and parses its paths.

    CACHEDIR.TAG                          tells backup tools to skip the directory
    v1/<arch>/tc-<toolchain fp>/          layout schema / SM arch / toolchain fingerprint (16 hex)
        toolchain.json                    the fingerprint's components (read by `kdajit cache why`)
        kernels/<spec slug>/<config slug>-<key hash>/
            kernel.o                      export_to_c object (TVM-FFI, symbol `compiler.SYMBOL`)
            meta.json                     the key, the object's size and sha256; written last
            (.quarantined.<name>          an entry moved aside in place, when quarantine/ is unusable)
        tuning/<spec slug>/<device>.<bucket>.json   one tuning record (kdajit.tune_records), written atomically
    staging/<host>.<pid>.<rand>/          entries are built here, then renamed into v1/ (same fs)
    staging/trash.<pid>.<rand>/           a removal in progress
    quarantine/<utc>.<pid>.<rand>.<entry>/  entries that failed verification, with reason.json
    locks/                                lock files, only when no node-local lock dir is usable

The key hash is sha256 of the key's canonical JSON (arch and config included). Relative paths are
POSIX strings; `parse_entry_relpath` is the inverse of `entry_relpath` for every path this module
writes, and rejects anything else (a bundle's relpaths go through it).
"""
from __future__ import annotations

import hashlib
import os
import re
import secrets
import socket
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from kdajit import env
from kdajit.keys import _KernelKey

SCHEMA = 1
LAYOUT = f"v{SCHEMA}"
ARTIFACT = "kernel.o"
META = "meta.json"
ENTRY_FILES = (ARTIFACT, META)  # in publishing order: meta.json last
TOOLCHAIN_FILE = "toolchain.json"
KERNELS = "kernels"
TUNING = "tuning"
RECORD_SUFFIX = ".json"
STAGING = "staging"
QUARANTINE = "quarantine"
LOCKS = "locks"
CACHEDIR_TAG = "CACHEDIR.TAG"
QUARANTINED_IN_PLACE = ".quarantined."

_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
_FP = r"[0-9a-f]{16}"
_ENTRY = re.compile(rf"^v(?P<schema>\d+)/(?P<arch>{_NAME})/tc-(?P<fp>{_FP})/{KERNELS}/(?P<spec>{_NAME})/"
                    rf"(?P<config>{_NAME})$")
_RECORD = re.compile(rf"^v(?P<schema>\d+)/(?P<arch>{_NAME})/tc-(?P<fp>{_FP})/{TUNING}/(?P<spec>{_NAME})/"
                     rf"(?P<name>{_NAME})\{RECORD_SUFFIX}$")
_TOOLCHAIN_DIR = re.compile(rf"^tc-({_FP})$")
_LAYOUT_DIR = re.compile(r"^v(\d+)$")


def cache_root() -> Path | None:
    """The cache root (absolute; it may not exist yet), or None when KDAJIT_CACHE=off."""
    if env.cache_mode() == "off":
        return None
    configured = env.cache_dir()
    if configured:
        return Path(configured).expanduser().absolute()
    import platformdirs

    return Path(platformdirs.user_cache_dir("kdajit", appauthor=False)).absolute()


def layer_roots() -> list[tuple[Path, str]]:
    """(root, mode) of every cache layer in search order: the root in KDAJIT_CACHE's mode, then each
    KDAJIT_CACHE_RO_DIRS layer in "ro" mode (absolute, unresolved); none when KDAJIT_CACHE=off."""
    root = cache_root()
    if root is None:
        return []
    return [(root, env.cache_mode())] + [(Path(d).expanduser().absolute(), "ro") for d in env.cache_ro_dirs()]


def _safe_name(part: str, what: str) -> str:
    if not part or part.startswith(".") or not all(c.isascii() and (c.isalnum() or c in "_.-") for c in part):
        raise ValueError(f"{what} {part!r} cannot be used in a cache path")
    return part


def key_hash(key: _KernelKey) -> str:
    return hashlib.sha256(key.canonical().encode()).hexdigest()[:8]


def toolchain_relpath(arch: str, fingerprint: str) -> str:
    """`v1/<arch>/tc-<fp>`: the directory of one toolchain's entries (and its toolchain.json)."""
    return f"{LAYOUT}/{_safe_name(arch, 'arch')}/tc-{fingerprint}"


def entry_relpath(key: _KernelKey, fingerprint: str) -> str:
    """`v1/<arch>/tc-<fp>/kernels/<spec slug>/<config slug>-<key hash>` (POSIX, relative)."""
    spec = _safe_name(key.spec_slug(), "spec")
    cfg = _safe_name(f"{key.config.slug()}-{key_hash(key)}", "config")
    return f"{toolchain_relpath(key.arch, fingerprint)}/{KERNELS}/{spec}/{cfg}"


def record_relpath(spec_slug: str, name: str, arch: str, fingerprint: str) -> str:
    """`v1/<arch>/tc-<fp>/tuning/<spec slug>/<name>.json`: one tuning record (POSIX, relative)."""
    spec = _safe_name(spec_slug, "spec")
    return f"{toolchain_relpath(arch, fingerprint)}/{TUNING}/{spec}/{_safe_name(name, 'record name')}{RECORD_SUFFIX}"


@dataclass(frozen=True)
class RecordPath:
    """The parts of a tuning record's relative path."""

    relpath: str
    arch: str
    toolchain: str
    spec: str
    name: str

    @property
    def parent_relpath(self) -> str:
        return self.relpath.rsplit("/", 1)[0]


def _match(pattern: re.Pattern, relpath: object, what: str) -> re.Match:
    """`pattern`'s match of a relative path of the current schema; ValueError naming `what` it should be."""
    m = pattern.match(relpath) if isinstance(relpath, str) else None
    if m is None or int(m.group("schema")) != SCHEMA or ".." in relpath.split("/"):
        raise ValueError(f"{relpath!r} is not {what}")
    return m


def parse_record_relpath(relpath: object) -> RecordPath:
    """The parts of a tuning record path of the current layout; ValueError for anything else."""
    m = _match(_RECORD, relpath, f"a tuning record path (v{SCHEMA}/<arch>/tc-<16 hex>/{TUNING}/<spec>/<name>"
                                 f"{RECORD_SUFFIX})")
    return RecordPath(relpath, m.group("arch"), m.group("fp"), m.group("spec"), m.group("name"))


def record_paths(root: Path) -> Iterator[RecordPath]:
    """Every tuning record file of the current layout under `root` (not verified)."""
    for _, _, tc_dir in toolchain_dirs(root):
        for spec_dir in subdirs(tc_dir / TUNING):
            try:
                names = sorted(os.listdir(spec_dir))
            except OSError:
                continue
            for name in names:
                try:
                    yield parse_record_relpath((spec_dir / name).relative_to(root).as_posix())
                except ValueError:
                    continue  # a temporary file of an atomic write, or a name this layout never writes


@dataclass(frozen=True)
class EntryPath:
    """The parts of an entry's relative path."""

    relpath: str
    arch: str
    toolchain: str
    spec: str
    config: str

    @property
    def toolchain_relpath(self) -> str:
        return toolchain_relpath(self.arch, self.toolchain)

    @property
    def parent_relpath(self) -> str:
        return self.relpath.rsplit("/", 1)[0]


def parse_entry_relpath(relpath: object) -> EntryPath:
    """The parts of an entry path of the current layout; ValueError for anything else."""
    m = _match(_ENTRY, relpath, f"a cache entry path (v{SCHEMA}/<arch>/tc-<16 hex>/{KERNELS}/<spec>/<config>)")
    return EntryPath(relpath, m.group("arch"), m.group("fp"), m.group("spec"), m.group("config"))


def subdirs(path: Path) -> list[Path]:
    """Real (not symlinked, not dot-named) subdirectories, sorted; [] when `path` is not a directory."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    out = []
    for name in names:
        if name.startswith("."):
            continue
        p = path / name
        if p.is_dir() and not p.is_symlink():
            out.append(p)
    return out


def toolchain_dirs(root: Path) -> Iterator[tuple[str, str, Path]]:
    """(arch, fingerprint, directory) of every toolchain directory of the current layout."""
    for arch_dir in subdirs(root / LAYOUT):
        for tc_dir in subdirs(arch_dir):
            m = _TOOLCHAIN_DIR.match(tc_dir.name)
            if m:
                yield arch_dir.name, m.group(1), tc_dir


def entry_paths(root: Path) -> Iterator[EntryPath]:
    """Every entry directory of the current layout under `root` (not verified)."""
    for _, _, tc_dir in toolchain_dirs(root):
        for spec_dir in subdirs(tc_dir / KERNELS):
            for entry_dir in subdirs(spec_dir):
                try:
                    yield parse_entry_relpath(entry_dir.relative_to(root).as_posix())
                except ValueError:
                    continue  # a directory name this layout never writes


def quarantined_in_place(root: Path) -> list[Path]:
    """Entries moved aside beside their spec directory (`.quarantined.*`)."""
    return sorted(root.glob(f"{LAYOUT}/*/tc-*/{KERNELS}/*/{QUARANTINED_IN_PLACE}*"))


def older_layouts(root: Path) -> list[Path]:
    """Layout directories of older schemas (v0, ...); newer ones belong to a newer kdajit."""
    out = []
    for d in subdirs(root):
        m = _LAYOUT_DIR.match(d.name)
        if m and int(m.group(1)) < SCHEMA:
            out.append(d)
    return out


def _host() -> str:
    return socket.gethostname()[:40]


def staging_name() -> str:
    """`<host>.<pid>.<rand>`: a fresh build directory's name under staging/."""
    return f"{_host()}.{os.getpid()}.{secrets.token_hex(4)}"


def trash_name() -> str:
    return f"trash.{os.getpid()}.{secrets.token_hex(4)}"


def parse_staging_name(name: str) -> tuple[str, int] | None:
    """(host, pid) of a build directory's name, None for trash and foreign names."""
    parts = name.rsplit(".", 2)
    if name.startswith("trash.") or len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])


def is_trash(name: str) -> bool:
    return name.startswith("trash.")


def is_this_host(host: str) -> bool:
    return host == _host()


def quarantine_name(relpath: str) -> str:
    """`<utc>.<pid>.<rand>.<spec>.<config>`: where an entry goes under quarantine/."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    spec, config = relpath.split("/")[-2:]
    return f"{stamp}.{os.getpid()}.{secrets.token_hex(3)}.{spec[:80]}.{config}"
