"""The `kdajit` command lines that the library suggests to its users, written in one place.

The runtime names them when a kernel is missing or compiling; the CLI parses exactly this syntax
(`kdajit precompile --key KEY`, KEY as `kdajit cache ls` prints it plus `@arch`, or the key's JSON),
and the tests check that the two agree.
"""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Iterable

from kdajit.keys import _KernelKey


def key_word(key: _KernelKey) -> str:
    """`key` in the KEY syntax of `kdajit precompile --key` and `kdajit cache why`."""
    if key.config == key.CONFIG():
        return f"{key.spec_slug()}@{key.arch}"
    return key.canonical()


def precompile_command(keys: Iterable[_KernelKey], root: Path | str | None = None) -> str:
    """The `kdajit precompile` command that puts exactly `keys` into the cache at `root`."""
    argv = ["kdajit", "precompile"]
    if root is not None:
        argv += ["--cache-dir", str(root)]
    for key in keys:
        argv += ["--key", key_word(key)]
    return shlex.join(argv)
