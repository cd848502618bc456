"""Persistent kernel cache: each kernel key is compiled once per machine and shared by every process.

`get_kernel(key)` looks in the in-process dict (the hot path: one dict lookup), then on disk (the
entry is verified: meta.json, sha256 of the object, owner and permissions), then compiles under a
per-entry file lock (re-checking the disk once the lock is held) and publishes the entry atomically.

Layout under the root (KDAJIT_CACHE_DIR, else platformdirs' user cache dir for "kdajit"):

    CACHEDIR.TAG                          tells backup tools to skip the directory
    v1/<arch>/tc-<toolchain fp>/          layout schema / SM arch / toolchain fingerprint (16 hex)
        toolchain.json                    the fingerprint's components (read by `kdajit cache why`)
        kernels/<spec slug>/<config slug>-<key hash>/
            kernel.o                      export_to_c object (TVM-FFI, symbol `compiler.SYMBOL`)
            meta.json                     the key, the object's size and sha256; written last
    staging/<host>.<pid>.<rand>/          entries are built here, then renamed into v1/ (same fs)
    quarantine/<utc>.<pid>.<rand>.<entry>/  entries that failed verification, with reason.json
    locks/                                lock files, only when no node-local lock dir is usable

The key hash is sha256 of the key's canonical JSON (arch and config included); meta.json holds the
full key, and a lookup checks it, so a hash collision or a misplaced entry is caught. The toolchain
fingerprint covers kdajit's kernel sources (by content, relative names), the exact
nvidia-cutlass-dsl* and apache-tvm-ffi distributions, the compile recipe version and the CuTe DSL
variables that change code generation; never absolute paths, torch or the Python version.

Contracts:
- Disk problems never raise out of `get_kernel`: an unwritable, full or read-only root, a lock that
  cannot be taken or times out, a corrupt, truncated, foreign or unsafe entry all degrade to a
  warning (once per kind of problem) and an in-memory kernel. Bad entries are moved to quarantine/
  (rw mode) and rebuilt; they are never loaded. Compile errors do raise: they are bugs.
- Publishing is atomic: the entry directory is complete (object, then meta.json, fsynced) before a
  single rename() makes it visible, so readers need no lock; the lock only deduplicates compiles.
- An entry is loaded only if every directory from the root down and both files belong to this user
  (or root) and are writable by nobody else: an object file is code.
- Entries are created private: directories 0700, files 0600.
"""
from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import json
import logging
import os
import secrets
import shlex
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from kdajit import compiler, env
from kdajit.keys import KernelConfig, _KernelKey, key_from_json

SCHEMA = 1
LAYOUT = f"v{SCHEMA}"
ARTIFACT = "kernel.o"
META = "meta.json"
TOOLCHAIN_FILE = "toolchain.json"
STAGING = "staging"
QUARANTINE = "quarantine"
CACHEDIR_TAG = "CACHEDIR.TAG"
_TAG_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
             "# This file is a cache directory tag created by kdajit (compiled GPU kernels).\n"
             "# For information about cache directory tags, see https://bford.info/cachedir/\n")

log = logging.getLogger("kdajit.cache")


class KernelNotCached(RuntimeError):
    """A kernel is not in the cache and KDAJIT_DISABLE_JIT=1 forbids compiling it."""


class KdajitCacheWarning(RuntimeWarning):
    """The disk cache could not be used for something; kdajit carries on with in-memory kernels."""


# ---------------------------------------------------------------------------------------------
# Process state: the in-memory kernels, counters, warn-once bookkeeping
# ---------------------------------------------------------------------------------------------
_MEMORY: dict[_KernelKey, Callable] = {}
_SLOW_PATH = threading.RLock()  # one miss at a time per process (compiling is not thread-safe)
_WARNED: set[str] = set()
_STAT_NAMES = ("memory_hits", "disk_hits", "misses", "compiles", "compile_s", "load_s", "published",
               "quarantined", "disk_errors", "lock_wait_s", "lock_timeouts")
_STATS: dict[str, float] = dict.fromkeys(_STAT_NAMES, 0)


def stats() -> dict:
    """Counters of this process: memory_hits, disk_hits, misses (lookups that went past the memory
    dict), compiles, compile_s, load_s, published, quarantined, disk_errors, lock_wait_s,
    lock_timeouts; plus `kernels_in_memory`."""
    out = dict(_STATS)
    out["kernels_in_memory"] = len(_MEMORY)
    return out


def _warn_once(topic: str, message: str, disk_error: bool = True) -> None:
    _STATS["disk_errors"] += disk_error
    if topic in _WARNED:
        log.debug("%s", message)
        return
    _WARNED.add(topic)
    warnings.warn(message, KdajitCacheWarning, stacklevel=4)


# ---------------------------------------------------------------------------------------------
# Root, toolchain fingerprint, entry paths
# ---------------------------------------------------------------------------------------------
def cache_root() -> Path | None:
    """The cache root (absolute; it may not exist yet), or None when KDAJIT_CACHE=off."""
    if env.cache_mode() == "off":
        return None
    configured = env.cache_dir()
    if configured:
        return Path(configured).expanduser().absolute()
    import platformdirs

    return Path(platformdirs.user_cache_dir("kdajit", appauthor=False)).absolute()


def _norm_dist(name: str) -> str:
    return "-".join(name.replace("_", "-").replace(".", "-").lower().split("-"))


def _distribution_versions() -> list[str]:
    """`name==version` of every installed nvidia-cutlass-dsl* distribution and of apache-tvm-ffi.

    Read from the `*.dist-info` directory names on sys.path: parsing every installed package's metadata
    (importlib.metadata.distributions()) cost ~190 ms of a warm-cache first call on the H200 machine.
    """
    found = set()
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for dirname in names:
            if not dirname.endswith(".dist-info"):
                continue
            dist, _, version = dirname[: -len(".dist-info")].partition("-")
            name = _norm_dist(dist)
            if name.startswith("nvidia-cutlass-dsl") or name == "apache-tvm-ffi":
                found.add(f"{name}=={version}")
    return sorted(found)


def _kdajit_version() -> str:
    import importlib.metadata as md

    try:
        return md.version("kdajit")
    except md.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=None)
def _components_json() -> str:
    sources = {}
    for path in compiler.template_files():
        p = Path(path)
        sources[f"{p.parent.name}/{p.name}"] = hashlib.sha256(p.read_bytes()).hexdigest()
    components = {
        "cache_schema": SCHEMA,
        "recipe_version": compiler.RECIPE_VERSION,
        "symbol": compiler.SYMBOL,
        "kdajit": _kdajit_version(),
        "kernel_src": dict(sorted(sources.items())),
        "dsl_stack": _distribution_versions(),
        "codegen_env": dict(sorted(env.codegen_env().items())),
    }
    return json.dumps(components, sort_keys=True, separators=(",", ":"))


def toolchain_components() -> dict:
    """What the toolchain fingerprint hashes (computed once per process)."""
    return json.loads(_components_json())


def fingerprint_of(components: dict) -> str:
    canonical = json.dumps(components, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def toolchain_fingerprint() -> str:
    """16 hex digits naming the toolchain directory (`tc-<fp>`) of this process's entries."""
    return fingerprint_of(toolchain_components())


def _safe_name(part: str, what: str) -> str:
    if not part or part.startswith(".") or not all(c.isascii() and (c.isalnum() or c in "_.-") for c in part):
        raise ValueError(f"{what} {part!r} cannot be used in a cache path")
    return part


def key_hash(key: _KernelKey) -> str:
    return hashlib.sha256(key.canonical().encode()).hexdigest()[:8]


def entry_relpath(key: _KernelKey, fingerprint: str | None = None) -> str:
    """`v1/<arch>/tc-<fp>/kernels/<spec slug>/<config slug>-<key hash>` (POSIX, relative)."""
    fp = fingerprint or toolchain_fingerprint()
    arch = _safe_name(key.arch, "arch")
    spec = _safe_name(key.spec_slug(), "spec")
    cfg = _safe_name(f"{key.config.slug()}-{key_hash(key)}", "config")
    return f"{LAYOUT}/{arch}/tc-{fp}/kernels/{spec}/{cfg}"


def describe(key: _KernelKey) -> str:
    return f"{key.spec_slug()} ({key.arch}, {key.config.slug()})"


def precompile_command(key, root: Path | str | None = None) -> str:
    """The `kdajit precompile` command that puts exactly `key` into the cache at `root`.

    `key` is a kernel key, or a `ForwardSpec` (then the command builds all of its kernels).
    """
    fields = {f.name for f in dataclasses.fields(key)}
    argv = ["kdajit", "precompile"]
    if root is not None:
        argv += ["--cache-dir", str(root)]
    argv += ["--arch", key.arch]
    if getattr(key, "TEMPLATE", None):
        argv += ["--only", key.TEMPLATE]
    if "beta_dtype" in fields:
        argv += ["--beta", key.beta_dtype]
    if "varlen" in fields:
        argv += ["--varlen", key.varlen]
    if "head_v" in fields:
        argv += ["--kv", f"{key.head_k}x{key.head_v}"]
    elif "head_k" in fields:
        argv += ["--kv", str(key.head_k)]  # K=V=head_k; this kernel does not depend on V
    if "chunk" in fields:
        argv += ["--chunk", str(key.chunk)]
    if "output_qg" in fields:
        argv += ["--qg", "on" if key.output_qg else "off"]
    if "config" in fields and key.config != KernelConfig():
        argv += ["--config", ",".join(f"{k}={v}" for k, v in dataclasses.asdict(key.config).items())]
    return shlex.join(argv)


# ---------------------------------------------------------------------------------------------
# Verification (pure file checks: no CuTe DSL import)
# ---------------------------------------------------------------------------------------------
@dataclass
class EntryCheck:
    """Outcome of checking one entry.

    status: "ok"; "missing" (no entry); "unreadable" (no permission: a miss, left alone);
    "untrusted" (the cache root itself is writable by others: nothing under it is used, or moved);
    "corrupt" (incomplete, truncated, bad hash, bad meta); "foreign" (the meta describes another key
    or toolchain); "unsafe" (another user could have written it, or a symlink). The last three are
    `bad`: never loaded, moved aside by the runtime and by `kdajit cache verify --fix`.
    """

    status: str
    reason: str = ""
    meta: dict | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def bad(self) -> bool:
        return self.status in ("corrupt", "foreign", "unsafe")


_TRUSTED_OWNERS = frozenset({os.getuid(), 0})


def _unsafe_mode(st: os.stat_result, allow_sticky: bool = False) -> str | None:
    if st.st_uid not in _TRUSTED_OWNERS:
        return f"owned by uid {st.st_uid}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (allow_sticky and st.st_mode & stat.S_ISVTX):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _unsafe_dirs(root: Path, relpath: str) -> str | None:
    """Why another user could have changed the directories below `root` down to the entry, if so."""
    path = root
    for part in relpath.split("/"):
        path = path / part
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return f"{path} is a symlink"
        if not stat.S_ISDIR(st.st_mode):
            return f"{path} is not a directory"
        problem = _unsafe_mode(st)
        if problem:
            return f"{path} is {problem}"
    return None


def _read_checked(path: Path) -> tuple[bytes, str | None]:
    """(content, why it is unsafe or None); symlinks are refused (ELOOP)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return b"", f"{path.name} is not a regular file"
        problem = _unsafe_mode(st)
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks), (f"{path.name} is {problem}" if problem else None)
    finally:
        os.close(fd)


def check_entry(root: Path, relpath: str, *, expect_key: _KernelKey | None = None,
                expect_fp: str | None = None) -> EntryCheck:
    """Verify the entry at `root/relpath` without loading it. Never raises for file problems."""
    entry = root / relpath
    try:
        os.lstat(entry)
    except (FileNotFoundError, NotADirectoryError):
        return EntryCheck("missing")
    except PermissionError as e:
        return EntryCheck("unreadable", str(e))
    try:
        problem = root_problem(root)
        if problem:
            return EntryCheck("untrusted", problem)
        unsafe = _unsafe_dirs(root, relpath)
        if unsafe:
            return EntryCheck("unsafe", unsafe)
        try:
            meta_bytes, unsafe = _read_checked(entry / META)
        except FileNotFoundError:
            return EntryCheck("corrupt", "meta.json is missing (incomplete entry)")
        if unsafe:
            return EntryCheck("unsafe", unsafe)
        try:
            data, unsafe = _read_checked(entry / ARTIFACT)
        except FileNotFoundError:
            data = None
        if unsafe:
            return EntryCheck("unsafe", unsafe)
        return check_content(meta_bytes, data, relpath, expect_key=expect_key, expect_fp=expect_fp)
    except PermissionError as e:
        return EntryCheck("unreadable", str(e))
    except OSError as e:
        if e.errno == errno.ELOOP:
            return EntryCheck("unsafe", f"symlink in the entry ({e.filename})")
        return EntryCheck("corrupt", f"{type(e).__name__}: {e}")


def check_content(meta_bytes: bytes, artifact: bytes | None, relpath: str, *,
                  expect_key: _KernelKey | None = None, expect_fp: str | None = None) -> EntryCheck:
    """Verify an entry's content: meta.json parses, describes the entry at `relpath` (and the
    expected key and toolchain), and records the object's exact size and sha256."""
    try:
        meta = json.loads(meta_bytes)
    except ValueError as e:
        return EntryCheck("corrupt", f"meta.json is not valid JSON ({e})")
    problem = _meta_problem(meta)
    if problem:
        return EntryCheck("corrupt", f"meta.json: {problem}", meta if isinstance(meta, dict) else None)
    try:
        meta_key = key_from_json(meta["key"])
    except (ValueError, TypeError) as e:
        return EntryCheck("corrupt", f"meta.json: unknown key ({e})", meta)
    if expect_key is not None and meta_key != expect_key:
        return EntryCheck("foreign", f"meta.json describes {meta_key}, not {expect_key}", meta)
    if expect_fp is not None and meta["toolchain_fp"] != expect_fp:
        return EntryCheck("foreign", f"built by toolchain tc-{meta['toolchain_fp']}, not tc-{expect_fp}", meta)
    try:
        described = entry_relpath(meta_key, meta["toolchain_fp"])
    except ValueError as e:
        return EntryCheck("corrupt", f"meta.json: {e}", meta)
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
    return EntryCheck("ok", meta=meta)


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
    if not isinstance(art, dict) or art.get("file") != ARTIFACT or not isinstance(art.get("bytes"), int) \
            or not isinstance(art.get("sha256"), str):
        return "artifact record missing or malformed"
    if meta.get("symbol") != compiler.SYMBOL:
        return f"symbol {meta.get('symbol')!r}, expected {compiler.SYMBOL!r}"
    return None


# ---------------------------------------------------------------------------------------------
# Private directories, atomic files, quarantine
# ---------------------------------------------------------------------------------------------
def _mkdir_private(path: Path) -> None:
    """Create `path` (0700) if missing. An existing directory of ours that others could write is
    made private again (what is inside is still verified entry by entry)."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", str(path)) from None
        if st.st_uid == os.getuid() and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))


def root_problem(root: Path) -> str | None:
    """Why entries under `root` can never be trusted (another user owns it or may write it), or None."""
    try:
        st = os.stat(root)
    except OSError:
        return None  # missing (created private on first publish) or unreadable (a miss)
    problem = _unsafe_mode(st, allow_sticky=True)
    return f"cache root {root} is {problem}" if problem else None


def makedirs_private(root: Path, relpath: str) -> Path:
    """Create the root (if needed, with CACHEDIR.TAG) and `root/relpath`, each new directory 0700."""
    if not root.is_dir():
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    tag = root / CACHEDIR_TAG
    if not tag.exists():
        write_file_atomic(tag, _TAG_TEXT.encode(), mode=0o644)
    path = root
    for part in Path(relpath).parts:
        path = path / part
        _mkdir_private(path)
    return path


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `data` to a temporary sibling, fsync, rename over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def quarantine_entry(root: Path, relpath: str, reason: str) -> Path | None:
    """Move an entry out of the lookup path (into quarantine/, else a dot-name beside it).

    Returns where it went, or None if it could not be moved (the caller then just ignores it).
    """
    entry = root / relpath
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    rel = Path(relpath)
    name = f"{stamp}.{os.getpid()}.{secrets.token_hex(3)}.{rel.parent.name[:80]}.{rel.name}"
    moved = None
    try:
        makedirs_private(root, QUARANTINE)
        os.rename(entry, root / QUARANTINE / name)
        moved = root / QUARANTINE / name
    except FileNotFoundError:
        return None  # someone else moved it already
    except OSError:
        try:  # a directory owned by someone else cannot change parent; a rename in place still can
            os.rename(entry, entry.with_name(f".quarantined.{name}"))
            moved = entry.with_name(f".quarantined.{name}")
        except OSError:
            return None
    _STATS["quarantined"] += 1
    try:
        record = {"reason": reason, "relpath": relpath, "quarantined_at": _utc_now(),
                  "by": {"host": socket.gethostname(), "pid": os.getpid()}}
        write_file_atomic(moved / "reason.json", json.dumps(record, indent=1).encode())
    except OSError:
        pass
    return moved


# ---------------------------------------------------------------------------------------------
# The disk store
# ---------------------------------------------------------------------------------------------
def _lock_dirs(root: Path | None) -> list[Path]:
    configured = env.lock_dir()
    if configured:
        return [Path(configured).expanduser()]
    dirs = []
    if os.path.isdir("/dev/shm"):
        dirs.append(Path("/dev/shm") / f"kdajit-{os.getuid()}")
    if root is not None:
        dirs.append(root / "locks")
    return dirs


def usable_lock_dir(root: Path | None) -> Path | None:
    """The first lock directory we can write. A default one must be ours (another user could
    otherwise hold our locks); locks never decide correctness, only who compiles."""
    configured = env.lock_dir() is not None
    for d in _lock_dirs(root):
        try:
            if not d.exists():
                d.mkdir(mode=0o700, parents=True, exist_ok=True)
                os.chmod(d, 0o700)
            st = os.stat(d)
            if stat.S_ISDIR(st.st_mode) and os.access(d, os.W_OK) and (configured or st.st_uid == os.getuid()):
                return d
        except OSError:
            continue
    return None


def lock_path(root: Path | None, key: _KernelKey) -> Path | None:
    """The lock file that serializes compiles of `key` into `root` (None: no usable lock dir)."""
    lock_dir = usable_lock_dir(root)
    if lock_dir is None:
        return None
    ident = f"{os.path.realpath(root) if root is not None else ''}\0{entry_relpath(key)}"
    return lock_dir / f"{hashlib.sha256(ident.encode()).hexdigest()[:32]}.lock"


def _compile(key: _KernelKey):
    t0 = time.perf_counter()
    compiled = compiler.compile_key(key)
    _STATS["compiles"] += 1
    _STATS["compile_s"] += time.perf_counter() - t0
    return compiled, time.perf_counter() - t0


class DiskCache:
    """One cache root and a mode ("rw": load and publish, "ro": load only, "off": no disk).

    `get(key)` is the whole miss path of `get_kernel`; `ensure(key)` is what `kdajit precompile`
    runs per key (it raises on failure instead of degrading).
    """

    def __init__(self, root: Path | str | None, mode: str = "rw"):
        self.root = Path(root).absolute() if root is not None and mode != "off" else None
        self.mode = mode if self.root is not None else "off"
        self.rejected: str | None = None  # why the last entry looked up was refused, if it was

    @property
    def writable(self) -> bool:
        return self.mode == "rw"

    def entry_dir(self, key: _KernelKey) -> Path:
        assert self.root is not None
        return self.root / entry_relpath(key)

    # -- lookups --------------------------------------------------------------------------------
    def check(self, key: _KernelKey) -> EntryCheck:
        return check_entry(self.root, entry_relpath(key), expect_key=key, expect_fp=toolchain_fingerprint())

    def _reject(self, key: _KernelKey, check: EntryCheck) -> None:
        self.rejected = f"{check.status}: {check.reason}"
        relpath = entry_relpath(key)
        where = self.root / relpath
        if self.writable:
            moved = quarantine_entry(self.root, relpath, f"{check.status}: {check.reason}")
            if moved is not None:
                _warn_once(f"bad:{relpath}", f"kdajit: cache entry {where} was {check.status} ({check.reason}); "
                                             f"moved to {moved} and rebuilding", disk_error=False)
                return
        _warn_once(f"bad:{relpath}", f"kdajit: ignoring cache entry {where}: {check.status} ({check.reason})")

    def try_load(self, key: _KernelKey) -> Callable | None:
        """The verified, loaded entry for `key`, or None (a bad entry is quarantined first)."""
        check = self.check(key)
        if check.status == "missing":
            return None
        if check.status in ("unreadable", "untrusted"):
            _warn_once(check.status, f"kdajit: cannot use cache entries under {self.root} ({check.reason}); "
                                     f"compiling in memory")
            return None
        if not check.ok:
            self._reject(key, check)
            return None
        path = self.entry_dir(key)
        t0 = time.perf_counter()
        try:
            fn = compiler.load_object(str(path / ARTIFACT))
        except ImportError:
            raise
        except Exception as e:  # noqa: BLE001 - a verified object that does not load is corrupt
            self._reject(key, EntryCheck("corrupt", f"load_module failed: {type(e).__name__}: {e}"))
            return None
        _STATS["load_s"] += time.perf_counter() - t0
        _STATS["disk_hits"] += 1
        if self.writable:
            try:  # "last used", read by `kdajit cache ls/prune`; once per process per entry
                os.utime(path / META)
            except OSError:
                pass
        return fn

    # -- compile and publish --------------------------------------------------------------------
    def _acquire_lock(self, key: _KernelKey):
        path = lock_path(self.root, key)
        if path is None:
            tried = ", ".join(map(str, _lock_dirs(self.root)))
            _warn_once("no_lock_dir", f"kdajit: no usable lock directory ({tried}); concurrent processes may "
                                      f"compile the same kernel")
            return None
        import filelock

        lock = filelock.FileLock(str(path), mode=0o600)
        timeout = env.lock_timeout_s()
        t0 = time.perf_counter()
        try:
            lock.acquire(timeout=timeout, poll_interval=0.1)
            return lock
        except filelock.Timeout:
            _STATS["lock_timeouts"] += 1
            _warn_once("lock_timeout", f"kdajit: waited {timeout:g} s (KDAJIT_LOCK_TIMEOUT) for another process "
                                       f"compiling {describe(key)}; compiling it here instead", disk_error=False)
            return None
        except OSError as e:
            _warn_once("lock_error", f"kdajit: cannot take the compile lock {path} ({e}); compiling without it")
            return None
        finally:
            _STATS["lock_wait_s"] += time.perf_counter() - t0

    def publish(self, key: _KernelKey, compiled, compile_s: float) -> tuple[Path, bool]:
        """Write the entry atomically; returns (entry dir, True if ours won, False if one was there).

        Raises OSError (or a CuTe DSL error from the export) when the root cannot take it.
        """
        assert self.writable
        fp = toolchain_fingerprint()
        relpath = entry_relpath(key, fp)
        final = self.root / relpath
        tc_dir = makedirs_private(self.root, str(Path(relpath).parents[2]))
        if not (tc_dir / TOOLCHAIN_FILE).exists():
            write_file_atomic(tc_dir / TOOLCHAIN_FILE, json.dumps(
                {"fingerprint": fp, "components": toolchain_components()}, indent=1, sort_keys=True).encode())
        makedirs_private(self.root, str(Path(relpath).parent))
        staging = makedirs_private(self.root, f"{STAGING}/{socket.gethostname()[:40]}.{os.getpid()}."
                                              f"{secrets.token_hex(4)}")
        try:
            stage = staging / final.name
            os.mkdir(stage, 0o700)
            os.chmod(stage, 0o700)
            obj = stage / ARTIFACT
            compiler.export_object(compiled, str(obj))
            os.chmod(obj, 0o600)
            data = obj.read_bytes()
            meta = {
                "schema": SCHEMA, "kind": "kernel", "template": key.TEMPLATE, "arch": key.arch,
                "key": key.to_json(), "toolchain_fp": fp, "symbol": compiler.SYMBOL,
                "artifact": {"file": ARTIFACT, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()},
                "compile_s": round(compile_s, 3), "created_at": _utc_now(),
                "created_by": {"host": socket.gethostname(), "pid": os.getpid(),
                               "python": sys.version.split()[0], "kdajit": toolchain_components()["kdajit"]},
            }
            with open(obj, "rb") as f:
                os.fsync(f.fileno())
            write_file_atomic(stage / META, json.dumps(meta, indent=1, sort_keys=True).encode())
            _fsync_dir(stage)
            if env.force_recompile() and final.exists():
                try:
                    os.rename(final, staging / "replaced")
                except OSError:
                    pass
            for attempt in range(3):
                try:
                    os.rename(stage, final)
                    break
                except FileNotFoundError:  # a prune removed the empty spec dir meanwhile
                    if attempt == 2:
                        raise
                    makedirs_private(self.root, str(Path(relpath).parent))
                except OSError as e:
                    if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                        return final, False  # another process published first; theirs is as good
                    raise
            _fsync_dir(final.parent)
            _STATS["published"] += 1
            return final, True
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def _usable(self) -> bool:
        """False (after one warning) when the disk cannot be used at all; the root is then dropped."""
        if self.root is None:
            return False
        try:
            toolchain_fingerprint()
        except OSError as e:  # an unhashable kernel source: bypass the disk rather than weaken the key
            _warn_once("fingerprint", f"kdajit: cannot fingerprint the kernel sources ({e}); "
                                      f"the disk cache is off for this process")
            self.root, self.mode = None, "off"
            return False
        problem = root_problem(self.root)
        if problem:
            _warn_once("untrusted_root", f"kdajit: not using the kernel cache: {problem} (an object file is "
                                         f"code; `chmod go-w` it or pick another KDAJIT_CACHE_DIR)")
            self.root, self.mode = None, "off"
            return False
        return True

    def get(self, key: _KernelKey) -> Callable:
        """Disk, then compile (under the lock, publishing the entry); see the module docstring."""
        self._usable()
        if self.root is not None and not env.force_recompile():
            fn = self.try_load(key)
            if fn is not None:
                return fn
        if env.disable_jit():
            raise KernelNotCached(self._not_cached_message(key))
        lock = self._acquire_lock(key) if self.writable else None
        try:
            if self.writable and not env.force_recompile():
                fn = self.try_load(key)  # another process may have published it while we waited
                if fn is not None:
                    return fn
            compiled, compile_s = _compile(key)
            entry = None
            if self.writable:
                try:
                    published, ours = self.publish(key, compiled, compile_s)
                    entry = published if ours else None
                except Exception as e:  # noqa: BLE001 - any publishing failure degrades to memory
                    _warn_once("publish", f"kdajit: cannot write the kernel cache under {self.root} "
                                          f"({type(e).__name__}: {e}); using in-memory kernels")
        finally:
            if lock is not None:
                lock.release()
        return _callable_of(compiled, entry)

    def ensure(self, key: _KernelKey) -> str:
        """Make sure a valid entry for `key` exists: returns "present" or "compiled"; raises on failure."""
        if not self.writable:
            raise RuntimeError(f"the cache at {self.root} is not writable (mode {self.mode})")
        problem = root_problem(self.root)
        if problem:
            raise PermissionError(f"{problem}; entries there would never be loaded")
        check = self.check(key)
        if check.ok and not env.force_recompile():
            return "present"
        if check.bad:
            self._reject(key, check)
        lock = self._acquire_lock(key)
        try:
            check = self.check(key)
            if check.ok and not env.force_recompile():
                return "present"
            if check.bad:
                self._reject(key, check)
            compiled, compile_s = _compile(key)
            _, ours = self.publish(key, compiled, compile_s)
            return "compiled" if ours else "present"
        finally:
            if lock is not None:
                lock.release()

    def _not_cached_message(self, key: _KernelKey) -> str:
        where = "the disk cache is off (KDAJIT_CACHE=off)" if self.root is None else \
            f"it is not under {self.root} (toolchain tc-{toolchain_fingerprint()})"
        if self.rejected:
            where = f"its entry under {self.root} was refused ({self.rejected})"
        return (f"kdajit: no compiled kernel for {describe(key)}: {where}, and KDAJIT_DISABLE_JIT=1 forbids "
                f"compiling it now. Fix: run\n    {precompile_command(key, self.root)}\n"
                f"(it cross-compiles, so any machine with the same kdajit and nvidia-cutlass-dsl works; "
                f"ship the result with `kdajit cache export` / `kdajit cache import`).")


def _callable_of(compiled, entry: Path | None) -> Callable:
    fn = compiler.callable_of(compiled)
    if fn is not None:
        return fn
    # Compiled for an arch other than CUTE_DSL_ARCH: no JIT engine holds it, so load the object.
    if entry is not None:
        return compiler.load_object(str(entry / ARTIFACT))
    with tempfile.TemporaryDirectory(prefix="kdajit-") as tmp:
        path = os.path.join(tmp, ARTIFACT)
        compiler.export_object(compiled, path)
        return compiler.load_object(path)


def default_cache() -> DiskCache:
    """The cache this process uses, from KDAJIT_CACHE_DIR / KDAJIT_CACHE (read at each call)."""
    return DiskCache(cache_root(), env.cache_mode())


def get_kernel(key: _KernelKey) -> Callable:
    """The TVM-FFI function for `key`: memory, else the disk cache, else compile (and publish).

    Raises KernelNotCached on a miss when KDAJIT_DISABLE_JIT=1, and compile errors; disk problems
    only warn.
    """
    fn = _MEMORY.get(key)
    if fn is not None:
        _STATS["memory_hits"] += 1
        return fn
    with _SLOW_PATH:
        fn = _MEMORY.get(key)
        if fn is None:
            _STATS["misses"] += 1
            fn = default_cache().get(key)
            _MEMORY[key] = fn
        else:
            _STATS["memory_hits"] += 1
    return fn
