"""`kdajit env`: everything a bug report about compiling or caching needs, in one paste."""
from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

from kdajit import cache_locks, compiler, env, linked_loader
from kdajit.cache_toolchain import toolchain_components, toolchain_fingerprint

_NETWORK_FS = ("nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "fuse.sshfs", "beegfs", "ceph", "fuse.ceph")


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding `path` (from /proc/mounts; None when unknown)."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return None
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    real = os.path.realpath(probe)
    best, fstype = "", None
    for mount_point, kind in mounts:
        mount_point = mount_point.replace("\\040", " ")
        if (real == mount_point or real.startswith(mount_point.rstrip("/") + "/")) and len(mount_point) >= len(best):
            best, fstype = mount_point, kind
    return fstype


def _dir_state(path: Path | None) -> dict:
    if path is None:
        return {"path": None}
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    fstype = filesystem_type(path)
    return {"path": str(path), "exists": path.exists(), "writable": os.access(probe, os.W_OK),
            "filesystem": fstype, "network_filesystem": fstype in _NETWORK_FS}


def report(root: Path | None) -> dict:
    try:
        arch, arch_error = compiler.current_arch(), None
    except Exception as e:  # noqa: BLE001 - reported
        arch, arch_error = None, str(e)
    lock_dir, refused = cache_locks.usable_lock_dir(root)
    components = toolchain_components()
    return {
        "kdajit": components["kdajit"],
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cache": {"mode": env.cache_mode(), "root": _dir_state(root),
                  "root_source": "KDAJIT_CACHE_DIR" if env.cache_dir() else "platformdirs user cache dir"},
        "locks": {**_dir_state(lock_dir), "timeout_s": env.lock_timeout_s(), "refused": refused},
        "loader": _loader_state(),
        "disable_jit": env.disable_jit(),
        "force_recompile": env.force_recompile(),
        "arch": arch, "arch_error": arch_error,
        "arch_source": "KDAJIT_ARCH" if env.snapshot().get("KDAJIT_ARCH") else "CUDA device (sm_90a without one)",
        "toolchain": {"fingerprint": toolchain_fingerprint(), "components": components},
        "environment": env.snapshot(),
    }


def _loader_state() -> dict:
    """The loader mode, whether cached kernels load linked here (an explicit `linked` without a compiler falls
    back to the DSL's loader, so it is not), and why the linked loader is unavailable (None if it is not)."""
    mode, why = env.object_loader(), linked_loader.unavailable_reason()
    return {"mode": mode, "linked": why is None and linked_loader.uses_linked(mode), "linked_unavailable": why}


def run(root: Path | None, as_json: bool) -> int:
    doc = report(root)
    if as_json:
        print(json.dumps(doc, indent=1))
        return 0
    c, lk = doc["cache"], doc["locks"]
    print(f"kdajit {doc['kdajit']}, Python {doc['python']}, {doc['platform']}")
    root_state = c["root"]
    if root_state["path"] is None:
        print("cache root:   (disk cache off: KDAJIT_CACHE=off)")
    else:
        print(f"cache root:   {root_state['path']} (from {c['root_source']}; mode {c['mode']}; "
              f"{'exists' if root_state['exists'] else 'not created yet'}; "
              f"{'writable' if root_state['writable'] else 'NOT writable'}; fs {root_state['filesystem']})")
    print(f"lock dir:     {lk['path'] or '(none usable: compiles are not deduplicated across processes)'} "
          f"(fs {lk.get('filesystem')}; timeout {lk['timeout_s']:g} s)")
    if lk.get("network_filesystem"):
        print("  warning: locks on a network filesystem may not work; set KDAJIT_LOCK_DIR to a local directory")
    print(f"arch:         {doc['arch'] or 'error: ' + str(doc['arch_error'])} ({doc['arch_source']})")
    print(f"disable_jit:  {doc['disable_jit']}   force_recompile: {doc['force_recompile']}")
    why = doc["loader"]["linked_unavailable"]
    how = "linked" if doc["loader"]["linked"] else "through the DSL"
    print(f"loader:       {doc['loader']['mode']}: cached kernels load {how} "
          f"(the linked loader is {'available' if why is None else 'unavailable: ' + why})")
    tc = doc["toolchain"]
    print(f"toolchain:    tc-{tc['fingerprint']}")
    comp = tc["components"]
    print(f"  dsl stack:  {' '.join(comp['dsl_stack'])}")
    print(f"  recipe {comp['recipe_version']}, cache schema {comp['cache_schema']}, symbol {comp['symbol']}, "
          f"codegen env {comp['codegen_env'] or '{}'}")
    for name, digest in comp["kernel_src"].items():
        print(f"  {name:28} {digest[:16]}")
    print("environment:")
    for k, v in doc["environment"].items():
        print(f"  {k}={v}")
    if not doc["environment"]:
        print("  (no KDAJIT_*, CUTE_DSL_* or CUDA_VISIBLE_DEVICES set)")
    return 0
