"""Making entries visible and moving them aside: private directories under the root, staging and the
one atomic rename that publishes an entry, quarantine.

Both a compile and `kdajit cache import` publish through `publish_entry`: the entry directory is
complete (object, then meta.json, fsynced) in staging/ before a single rename() makes it visible, so
readers need no lock.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from pathlib import Path

from kdajit import cache_files, cache_layout
from kdajit.cache_entry import utc_now

_TAG_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
             "# This file is a cache directory tag created by kdajit (compiled GPU kernels).\n"
             "# For information about cache directory tags, see https://bford.info/cachedir/\n")


def makedirs_private(root: Path, relpath: str = "") -> Path:
    """Create the root (private, with CACHEDIR.TAG, before anything in it) and `root/relpath`, each
    new directory 0700 whatever the umask."""
    cache_files.mkdirs_private(root)
    tag = root / cache_layout.CACHEDIR_TAG
    if not tag.exists():
        cache_files.write_file_atomic(tag, _TAG_TEXT.encode(), mode=0o644)
    path = root
    for part in Path(relpath).parts:
        path = path / part
        cache_files.mkdir_private(path)
    return path


def write_toolchain_record(root: Path, arch: str, fingerprint: str, components: dict, mode: int = 0o600) -> None:
    """`toolchain.json` of a toolchain directory, if it has none yet."""
    tc_dir = makedirs_private(root, cache_layout.toolchain_relpath(arch, fingerprint))
    path = tc_dir / cache_layout.TOOLCHAIN_FILE
    if not path.exists():
        doc = {"fingerprint": fingerprint, "components": components}
        cache_files.write_file_atomic(path, json.dumps(doc, indent=1, sort_keys=True).encode(), mode=mode)


def publish_entry(root: Path, relpath: str, files: dict[str, bytes], *, replace: bool = False,
                  file_mode: int = 0o600, dir_mode: int = 0o700) -> bool:
    """Publish `files` (name -> bytes: kernel.o and meta.json) as the entry `root/relpath`.

    Returns True if this call published it, False if an entry was already there (another process
    won; its entry is as good). `replace`: move an existing entry aside first (KDAJIT_FORCE_RECOMPILE).
    Raises OSError when the root cannot take it.
    """
    final = root / relpath
    parent = cache_layout.parse_entry_relpath(relpath).parent_relpath
    makedirs_private(root, parent)
    staging = makedirs_private(root, f"{cache_layout.STAGING}/{cache_layout.staging_name()}")
    try:
        stage = staging / final.name
        os.mkdir(stage, 0o700)
        for name in cache_layout.ENTRY_FILES:  # meta.json last
            cache_files.write_file_atomic(stage / name, files[name], mode=file_mode)
        os.chmod(stage, dir_mode)
        cache_files.fsync_dir(stage)
        if replace:
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
                makedirs_private(root, parent)
            except OSError as e:
                if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                    return False
                raise
        cache_files.fsync_dir(final.parent)
        return True
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def quarantine_entry(root: Path, relpath: str, reason: str) -> Path | None:
    """Move an entry out of the lookup path (into quarantine/, else a dot-name beside it).

    Returns where it went, or None if it could not be moved (the caller then just ignores it).
    """
    entry = root / relpath
    name = cache_layout.quarantine_name(relpath)
    try:
        makedirs_private(root, cache_layout.QUARANTINE)
        moved = root / cache_layout.QUARANTINE / name
        os.rename(entry, moved)
    except FileNotFoundError:
        return None  # someone else moved it already
    except OSError:
        try:  # a directory owned by someone else cannot change parent; a rename in place still can
            moved = entry.with_name(cache_layout.QUARANTINED_IN_PLACE + name)
            os.rename(entry, moved)
        except OSError:
            return None
    try:
        record = {"reason": reason, "relpath": relpath, "quarantined_at": utc_now(),
                  "by": {"host": socket.gethostname(), "pid": os.getpid()}}
        cache_files.write_file_atomic(moved / "reason.json", json.dumps(record, indent=1).encode())
    except OSError:
        pass
    return moved
