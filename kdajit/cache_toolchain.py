"""The toolchain fingerprint: which kdajit sources and CuTe DSL stack built an entry.

It covers kdajit's kernel sources (by content, relative names), the exact nvidia-cutlass-dsl* and
apache-tvm-ffi distributions, the compile recipe version and the CuTe DSL variables that change code
generation; never absolute paths, torch or the Python version. Its 16 hex digits name the `tc-<fp>`
directory of the cache layout.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path

from kdajit import compiler, env
from kdajit.cache_layout import SCHEMA


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
