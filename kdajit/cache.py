"""Persistent kernel cache: each kernel key is compiled once per machine and shared by every process.

`get_kernels(keys)` looks each key up in the process's one kernel table (the hot path: one dict
lookup per kernel), then on disk, in the writable root and then in each read-only layer
(KDAJIT_CACHE_RO_DIRS) (the entry is verified: the path to the root, meta.json, the
object's sha256, owners and permissions; the verified bytes are what gets loaded), then compiles
under a per-entry file lock (re-checking the disk once the lock is held) and publishes the entry
atomically. The layout is `kdajit.cache_layout`; the other `cache_*` modules each do one job
(fingerprint, file checks, entry checks, locks, publishing, loading).

Contracts:
- Disk problems never raise out of `get_kernels`: an unwritable, full or read-only root, a lock that
  cannot be taken or times out, a corrupt, truncated, oversized, foreign or unsafe entry all degrade
  to a warning (once per kind of problem) and an in-memory kernel. Bad entries are moved to
  quarantine/ (rw mode) and rebuilt; they are never loaded. Compile errors do raise: they are bugs.
- With KDAJIT_DISABLE_JIT=1 a miss raises one KernelNotCached naming every missing kernel of the call.
- An entry is loaded only if nobody but this user could have written it (see `kdajit.cache_files`).
- Entries are created private: directories 0700, files 0600; the root is created private first.
"""
from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

from kdajit import (cache_files, cache_layout, cache_load, cache_locks, cache_publish, compiler, env, hints,
                    linked_loader)
from kdajit.cache_entry import EntryCheck, build_meta, check_entry
from kdajit.cache_layout import cache_root
from kdajit.cache_toolchain import toolchain_components, toolchain_fingerprint
from kdajit.keys import _KernelKey

log = logging.getLogger("kdajit")


class KernelNotCached(RuntimeError):
    """Kernels are not in the cache and KDAJIT_DISABLE_JIT=1 forbids compiling them (`keys`: all of them)."""

    def __init__(self, message: str, keys: Sequence[_KernelKey]):
        super().__init__(message)
        self.keys = tuple(keys)


class KdajitCacheWarning(RuntimeWarning):
    """The disk cache could not be used for something; kdajit carries on with in-memory kernels."""


# ---------------------------------------------------------------------------------------------
# Process state: the kernel table, counters, warn-once bookkeeping
# ---------------------------------------------------------------------------------------------
_KERNELS: dict[_KernelKey, Callable] = {}
_SLOW_PATH = threading.RLock()  # one miss at a time per process (compiling is not thread-safe)
_WARNED: set[str] = set()
_STAT_NAMES = ("memory_hits", "disk_hits", "misses", "compiles", "compile_s", "load_s", "published",
               "quarantined", "disk_errors", "lock_wait_s", "lock_timeouts")
_STATS: dict[str, float] = dict.fromkeys(_STAT_NAMES, 0)
# Bumped by `clear`, after the table is emptied: callers that memoize looked-up kernels compare it (`generation`).
_generation = 0


def stats() -> dict:
    """Counters of this process: memory_hits (lookups served in memory: by the kernel table, or by a caller's
    memo of it, which reports them through `count_memory_hits`), disk_hits, misses
    (lookups that went past the table), compiles, compile_s, load_s, published, quarantined,
    disk_errors, lock_wait_s, lock_timeouts; plus `kernels_in_memory`."""
    out = dict(_STATS)
    out["kernels_in_memory"] = len(_KERNELS)
    return out


def clear() -> None:
    """Forget every kernel of this process (the next call loads or compiles again) and reset `stats()`.

    Kernels already handed out stay valid; the disk cache is untouched (see `kdajit cache clear`).
    """
    global _generation
    with _SLOW_PATH:
        _KERNELS.clear()
        _STATS.update(dict.fromkeys(_STAT_NAMES, 0))
        _WARNED.clear()
        _generation += 1


def generation() -> int:
    """A number that changes whenever the kernel table is cleared: what a caller that memoizes `get_kernels`' answer
    checks before reusing it (so that after `clear` the next call loads again, as documented)."""
    return _generation


def count_memory_hits(lookups: int) -> None:
    """Count `lookups` served by a caller's memo of `get_kernels` as memory hits (`stats`)."""
    _STATS["memory_hits"] += lookups


def _warn_once(topic: str, message: str, disk_error: bool = True) -> None:
    _STATS["disk_errors"] += disk_error
    if topic in _WARNED:
        log.debug("%s", message)
        return
    _WARNED.add(topic)
    warnings.warn(message, KdajitCacheWarning, stacklevel=5)


def describe(key: _KernelKey) -> str:
    return f"{key.spec_slug()} ({key.arch}, {key.config.slug()})"


def _compile(key: _KernelKey):
    t0 = time.perf_counter()
    compiled = compiler.compile_key(key)
    _STATS["compiles"] += 1
    _STATS["compile_s"] += time.perf_counter() - t0
    return compiled, time.perf_counter() - t0


class DiskCache:
    """One cache root and a mode ("rw": load and publish, "ro": load only, "off": no disk).

    `load(key)` and `build(key)` are the miss path of `get_kernels`; `ensure(key)` is what
    `kdajit precompile` runs per key (it raises on failure instead of degrading). All I/O goes
    through the root's resolved path.
    """

    def __init__(self, root: Path | str | None, mode: str = "rw"):
        self.root = cache_files.real_root(Path(root).absolute()) if root is not None and mode != "off" else None
        self.mode = mode if self.root is not None else "off"
        self.rejected: dict[_KernelKey, str] = {}  # why an entry looked up was refused
        self._checked = False

    @property
    def writable(self) -> bool:
        return self.mode == "rw"

    def relpath(self, key: _KernelKey) -> str:
        return cache_layout.entry_relpath(key, toolchain_fingerprint())

    def check(self, key: _KernelKey) -> EntryCheck:
        return check_entry(self.root, self.relpath(key), expect_key=key, expect_fp=toolchain_fingerprint())

    def _reject(self, key: _KernelKey, check: EntryCheck) -> None:
        self.rejected[key] = f"{check.status}: {check.reason}"
        relpath = self.relpath(key)
        where = self.root / relpath
        if self.writable:
            moved = cache_publish.quarantine_entry(self.root, relpath, f"{check.status}: {check.reason}")
            if moved is not None:
                _STATS["quarantined"] += 1
                _warn_once(f"bad:{relpath}", f"kdajit: cache entry {where} was {check.status} ({check.reason}); "
                                             f"moved to {moved} and rebuilding", disk_error=False)
                return
        _warn_once(f"bad:{relpath}", f"kdajit: ignoring cache entry {where}: {check.status} ({check.reason})")

    def _usable(self) -> bool:
        """False (after one warning) when the disk cannot be used at all; the root is then dropped."""
        if self._checked or self.root is None:
            return self.root is not None
        self._checked = True
        try:
            toolchain_fingerprint()
        except OSError as e:  # an unhashable kernel source: bypass the disk rather than weaken the key
            _warn_once("fingerprint", f"kdajit: cannot fingerprint the kernel sources ({e}); "
                                      f"the disk cache is off for this process")
            self.root, self.mode = None, "off"
            return False
        if self.writable:
            try:  # private before anything (a lock dir, a compile) can create it with the umask's mode
                cache_publish.makedirs_private(self.root)
            except OSError:
                pass  # read-only or blocked: lookups miss, publishing warns
        problem = cache_files.root_problem(self.root)
        if problem:
            _warn_once("untrusted_root", f"kdajit: not using the kernel cache: {problem} (an object file is "
                                         f"code; `chmod go-w` it or pick another KDAJIT_CACHE_DIR)")
            self.root, self.mode = None, "off"
            return False
        return True

    def load(self, key: _KernelKey) -> Callable | None:
        """The verified, loaded entry for `key`, or None (a bad entry is quarantined first)."""
        if not self._usable() or env.force_recompile():
            return None
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
        linked = linked_loader.uses_linked(env.object_loader())  # a bad value raises here, not as "corrupt" below
        t0 = time.perf_counter()
        try:
            fn = cache_load.load_verified(check.artifact, linked)
        except ImportError:
            raise
        except Exception as e:  # noqa: BLE001 - a verified object that does not load is corrupt
            self._reject(key, EntryCheck("corrupt", f"load_module failed: {type(e).__name__}: {e}"))
            return None
        _STATS["load_s"] += time.perf_counter() - t0
        _STATS["disk_hits"] += 1
        if self.writable:
            try:  # "last used", read by `kdajit cache ls/prune`; once per process per entry
                os.utime(self.root / self.relpath(key) / cache_layout.META)
            except OSError:
                pass
        return fn

    def _acquire_lock(self, key: _KernelKey):
        lock_dir, refused = cache_locks.usable_lock_dir(self.root)
        if lock_dir is None:
            _warn_once("no_lock_dir", f"kdajit: no usable lock directory ({'; '.join(refused)}); concurrent "
                                      f"processes may compile the same kernel")
            return None
        import filelock

        path = cache_locks.lock_file(lock_dir, self.root, key, toolchain_fingerprint())
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

    def publish(self, key: _KernelKey, artifact: bytes, compile_s: float) -> bool:
        """Publish a compiled object as `key`'s entry; True if ours won. Raises OSError."""
        fp = toolchain_fingerprint()
        components = toolchain_components()
        cache_publish.write_toolchain_record(self.root, key.arch, fp, components)
        meta = build_meta(key, fp, artifact, compile_s, components["kdajit"])
        ours = cache_publish.publish_entry(self.root, self.relpath(key), {cache_layout.ARTIFACT: artifact,
                                                                           cache_layout.META: meta},
                                           replace=env.force_recompile())
        _STATS["published"] += ours
        return ours

    def build(self, key: _KernelKey) -> Callable:
        """Compile `key` under its lock (re-checking the disk once held) and publish it if writable."""
        lock = self._acquire_lock(key) if self.writable else None
        try:
            if lock is not None:
                fn = self.load(key)  # another process may have published it while we waited
                if fn is not None:
                    return fn
            compiled, compile_s = _compile(key)
            artifact = None
            if self.writable:
                try:
                    artifact = cache_load.export_bytes(compiled)
                    self.publish(key, artifact, compile_s)
                except Exception as e:  # noqa: BLE001 - any publishing failure degrades to memory
                    _warn_once("publish", f"kdajit: cannot write the kernel cache under {self.root} "
                                          f"({type(e).__name__}: {e}); using in-memory kernels")
        finally:
            if lock is not None:
                lock.release()
        return cache_load.callable_of(compiled, artifact)

    def ensure(self, key: _KernelKey) -> str:
        """Make sure a valid entry for `key` exists: returns "present" or "compiled"; raises on failure."""
        if not self.writable:
            raise RuntimeError(f"the cache at {self.root} is not writable (mode {self.mode})")
        cache_publish.makedirs_private(self.root)
        problem = cache_files.root_problem(self.root)
        if problem:
            raise PermissionError(f"{problem}; entries there would never be loaded")
        lock = None
        try:
            for attempt in range(2):  # without, then with the lock
                check = self.check(key)
                if check.ok and not env.force_recompile():
                    return "present"
                if check.bad:
                    self._reject(key, check)
                if attempt == 0:
                    lock = self._acquire_lock(key)
            compiled, compile_s = _compile(key)
            return "compiled" if self.publish(key, cache_load.export_bytes(compiled), compile_s) else "present"
        finally:
            if lock is not None:
                lock.release()

    def not_cached_message(self, keys: Sequence[_KernelKey]) -> str:
        def where(key: _KernelKey) -> str:
            if self.root is None:
                return "the disk cache is off (KDAJIT_CACHE=off)"
            if key in self.rejected:
                return f"its entry under {self.root} was refused ({self.rejected[key]})"
            return f"not under {self.root} (toolchain tc-{toolchain_fingerprint()})"

        lines = "\n".join(f"    {describe(k)}: {where(k)}" for k in keys)
        return (f"kdajit: {len(keys)} kernel(s) of this call are not compiled, and KDAJIT_DISABLE_JIT=1 forbids "
                f"compiling them now:\n{lines}\nFix: run\n    {hints.precompile_command(keys, self.root)}\n"
                f"(it cross-compiles, so any machine with the same kdajit and nvidia-cutlass-dsl works; "
                f"ship the result with `kdajit cache export` / `kdajit cache import`).")


def default_cache() -> DiskCache:
    """The cache this process uses, from KDAJIT_CACHE_DIR / KDAJIT_CACHE (read at each call)."""
    return DiskCache(cache_root(), env.cache_mode())


def read_only_layers() -> list[DiskCache]:
    """The KDAJIT_CACHE_RO_DIRS layers, searched in order after the writable root. Their entries get
    the same checks as the root's (ownership, hashes, key); a bad one is skipped with a warning (a
    read-only layer is never modified). Listing a layer trusts the native code in it. None when
    KDAJIT_CACHE=off."""
    return [DiskCache(root, mode) for root, mode in cache_layout.layer_roots()[1:]]


_ANNOUNCED = threading.Event()


def _announce_compiles(keys: Sequence[_KernelKey], root: Path | None) -> None:
    """Say once per process, on the "kdajit" logger (stderr unless logging is configured), that a call
    is compiling and how to avoid it."""
    if _ANNOUNCED.is_set():
        return
    _ANNOUNCED.set()
    log.warning("kdajit: compiling %d kernel(s) for this call (first use with this cache; about 10 s each). "
                "To compile ahead of time, run: %s", len(keys), hints.precompile_command(keys, root))


def get_kernels(keys: Sequence[_KernelKey]) -> tuple[Callable, ...]:
    """The TVM-FFI functions for `keys`: the kernel table, else the disk cache, else compile (and publish).

    Raises KernelNotCached (naming every missing key) when KDAJIT_DISABLE_JIT=1, and compile errors;
    disk problems only warn.
    """
    try:
        fns = tuple(map(_KERNELS.__getitem__, keys))
    except KeyError:
        return _get_slow(keys)
    _STATS["memory_hits"] += len(fns)
    return fns


def get_kernel(key: _KernelKey) -> Callable:
    """The TVM-FFI function for one key; see `get_kernels`."""
    return get_kernels((key,))[0]


def _get_slow(keys: Sequence[_KernelKey]) -> tuple[Callable, ...]:
    with _SLOW_PATH:
        missing = [k for k in dict.fromkeys(keys) if k not in _KERNELS]
        _STATS["memory_hits"] += len(keys) - len(missing)
        _STATS["misses"] += len(missing)
        disk = default_cache()
        layers = read_only_layers()
        to_build = []
        for key in missing:
            fn = disk.load(key)
            for layer in layers:
                if fn is not None:
                    break
                fn = layer.load(key)
            if fn is None:
                to_build.append(key)
            else:
                _KERNELS[key] = fn
        if to_build and env.disable_jit():
            raise KernelNotCached(disk.not_cached_message(to_build), to_build)
        if to_build:
            _announce_compiles(to_build, disk.root)
        for key in to_build:
            _KERNELS[key] = disk.build(key)
        return tuple(_KERNELS[k] for k in keys)
