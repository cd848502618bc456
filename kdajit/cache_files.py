"""File-system primitives of the kernel cache: who may have written a path, bounded reads of regular
files, private directories and atomic writes.

An object file is code, so a path is trusted only if nobody but this user could have changed it:
every directory from `/` down to the cache root is owned by this user or root and writable by nobody
else (a sticky directory such as /tmp is fine above the root), and the root and everything below it
belong to this user. Root-owned entries (an administrator's shared cache) are trusted only with
KDAJIT_TRUST_ROOT_OWNED=1: loading them runs root's native code in this process by your choice.
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from kdajit import env

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class UnsafeFile(OSError):
    """A path that another user could have written, or that is not what it should be (a FIFO, a link)."""


class OversizedFile(OSError):
    """A file larger than the bound its reader sets."""


def trusted_owners() -> frozenset[int]:
    """Owners whose cache files this process loads: itself, and root when KDAJIT_TRUST_ROOT_OWNED=1."""
    uid = os.getuid()
    return frozenset({uid, 0}) if uid == 0 or env.trust_root_owned() else frozenset({uid})


def unsafe_mode(st: os.stat_result, owners: frozenset[int], allow_sticky: bool = False) -> str | None:
    """Why `st` could have been written by another user, or None."""
    if st.st_uid not in owners:
        hint = " (KDAJIT_TRUST_ROOT_OWNED=1 trusts root's)" if st.st_uid == 0 else ""
        return f"owned by uid {st.st_uid}{hint}"
    if st.st_mode & _WRITABLE_BY_OTHERS and not (allow_sticky and st.st_mode & stat.S_ISVTX):
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def real_root(root: Path) -> Path:
    """`root` with every symlink resolved: all cache I/O goes through this path, resolved once."""
    return Path(os.path.realpath(root))


def root_problem(root: Path) -> str | None:
    """Why files under `root` can never be trusted, or None (also when `root` does not exist yet).

    Checks every existing directory of the resolved path from `/` down: ancestors owned by this user
    or root and not writable by others unless sticky; the root itself trusted-owned and private.
    """
    real = real_root(root)
    ancestors = frozenset({os.getuid(), 0})
    path = Path(real.anchor)
    for part in ("",) + real.parts[1:]:
        path = path / part if part else path
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None  # created private by the first publish
        except OSError as e:
            return f"cannot check {path} ({e.strerror})"
        if not stat.S_ISDIR(st.st_mode):
            return None  # the root cannot exist there: a miss, and publishing reports why
        is_root = path == real
        problem = unsafe_mode(st, trusted_owners() if is_root else ancestors, allow_sticky=True)
        if problem:
            what = "cache root" if is_root else "parent directory"
            return f"{what} {path}" + (f" (of the cache root {root})" if not is_root else "") + f" is {problem}"
    return None


def unsafe_dirs(root: Path, relpath: str) -> str | None:
    """Why another user could have changed the directories below `root` down to `root/relpath`."""
    path = root
    owners = trusted_owners()
    for part in relpath.split("/"):
        path = path / part
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return f"{path} is a symlink"
        if not stat.S_ISDIR(st.st_mode):
            return f"{path} is not a directory"
        problem = unsafe_mode(st, owners)
        if problem:
            return f"{path} is {problem}"
    return None


def read_regular(path: Path, limit: int, *, check_owner: bool = True) -> bytes:
    """The content of the regular file `path`, at most `limit` bytes.

    Never blocks or follows a link: opened O_NOFOLLOW | O_NONBLOCK and fstat-ed before reading.
    Raises FileNotFoundError, UnsafeFile (not a regular file; or, with `check_owner`, writable by
    another user), OversizedFile, or another OSError.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(errno.ELOOP, "is a symlink", str(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(errno.EINVAL, "is not a regular file", str(path))
        problem = unsafe_mode(st, trusted_owners()) if check_owner else None
        if problem:
            raise UnsafeFile(errno.EPERM, f"is {problem}", str(path))
        if st.st_size > limit:
            raise OversizedFile(errno.EFBIG, f"is {st.st_size} bytes, over the {limit}-byte limit", str(path))
        chunks, total = [], 0
        while total <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:  # grew while we read
            raise OversizedFile(errno.EFBIG, f"grew over the {limit}-byte limit while being read", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def describe_error(e: OSError) -> str:
    """`<name> <what>` for the errors of `read_regular`."""
    name = Path(e.filename).name if e.filename else "file"
    return f"{name} {e.strerror}"


def mkdir_private(path: Path) -> None:
    """Create `path` (0700) if missing. An existing directory of ours that others could write is
    made private again (what is inside is still verified entry by entry)."""
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)
    except FileExistsError:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", str(path)) from None
        if st.st_uid == os.getuid() and st.st_mode & _WRITABLE_BY_OTHERS:
            os.chmod(path, stat.S_IMODE(st.st_mode) & ~_WRITABLE_BY_OTHERS)


def mkdirs_private(path: Path) -> None:
    """Create `path` and every missing directory above it 0700 (whatever the umask); an existing
    `path` is left as it is (the root's trust check judges it)."""
    missing = []
    probe = path
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for d in reversed(missing):
        mkdir_private(d)


def fsync_dir(path: Path) -> None:
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


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a write may be short: signals, quotas, pipes)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.EIO, f"write returned {n}")
        view = view[n:]


def write_file_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `data` to a temporary sibling, fsync, rename over `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
