"""`kdajit precompile`: compile a cross product of specializations into the cache, GPU or not.

Keys already present (verified) are skipped without starting a worker. The others are compiled by a
pool of spawned, GPU-blind worker processes per arch (CUTE_DSL_ARCH pinned to that arch,
CUDA_VISIBLE_DEVICES empty), each running `DiskCache.ensure`: the same lock, re-check and atomic
publish as the runtime, so precompile can run while jobs use the cache. A worker that dies (a
crash in the compiler) fails only its key. Exit status: 0 when every key is present at the end, 1
otherwise.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing
import os
import sys
import time
import traceback
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from kdajit import env
from kdajit.cache import DiskCache, describe
from kdajit.cache_layout import entry_relpath
from kdajit.cache_toolchain import toolchain_fingerprint
from kdajit.keys import key_from_json


def default_jobs() -> int:
    return env.compile_workers() or max(1, min(2, os.cpu_count() or 1))


def _worker_init(arch: str) -> None:
    env.pin_compile_worker(arch)


def compile_one(root: str, key_json: dict) -> dict:
    """Worker body: ensure one key is in the cache at `root`. Never raises."""
    t0 = time.perf_counter()
    try:
        key = key_from_json(key_json)
        status = DiskCache(root, "rw").ensure(key)
        return {"status": status, "seconds": time.perf_counter() - t0, "error": None}
    except Exception as e:  # noqa: BLE001 - reported per key, the run goes on
        tb = traceback.format_exception(type(e), e, e.__traceback__)
        return {"status": "failed", "seconds": time.perf_counter() - t0,
                "error": f"{type(e).__name__}: {e}", "traceback": "".join(tb[-6:])}


class Progress:
    """Progress on `stream` (stderr): on a terminal one line of at most 79 columns, redrawn in place
    with \r; otherwise a plain line per finished key. `start` prints at once, before any worker
    exists, so a run never looks hung while the workers import CuTe DSL."""

    WIDTH = 79

    def __init__(self, total: int, enabled: bool, stream=None):
        self.total, self.done, self.enabled = total, 0, enabled
        self.counts = {"compiled": 0, "present": 0, "failed": 0}
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()

    def _write(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text)
            self.stream.flush()

    def start(self, to_compile: int, jobs: int) -> None:
        if to_compile:
            self._write(f"precompile: {self.total} kernels, {self.total - to_compile} present; compiling "
                        f"{to_compile} with {jobs} worker(s) (each starts by importing CuTe DSL, ~10 s)\n")

    def update(self, key, result: dict) -> None:
        self.done += 1
        self.counts[result["status"]] += 1
        elapsed = time.perf_counter() - self.t0
        if self.tty:
            filled = 16 * self.done // max(self.total, 1)
            line = (f"[{'#' * filled}{'.' * (16 - filled)}] {self.done}/{self.total} "
                    f"failed {self.counts['failed']} {elapsed:.0f}s {key.spec_slug()}")
            self._write("\r" + line[:self.WIDTH].ljust(self.WIDTH) + ("\n" if self.done == self.total else ""))
        else:
            self._write(f"{self.done}/{self.total} {result['status']} {describe(key)} ({elapsed:.0f} s)\n")
        if result["status"] == "failed":
            self._write(("\n" if self.tty and self.done != self.total else "") + f"  failed: {result['error']}\n")


def _run_pool(arch: str, keys: list, root: Path, jobs: int, on_result) -> None:
    ctx = multiprocessing.get_context("spawn")
    pending = list(keys)
    isolate = False  # after a worker death, run each remaining key in its own pool
    while pending:
        batch = [pending.pop(0)] if isolate else pending
        if not isolate:
            pending = []
        workers = 1 if isolate else min(jobs, len(batch))
        died = []
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init,
                                    initargs=(arch,)) as pool:
            futures = {pool.submit(compile_one, str(root), key.to_json()): key for key in batch}
            for fut in cf.as_completed(futures):
                key = futures[fut]
                try:
                    on_result(key, fut.result())
                except BrokenProcessPool:
                    died.append(key)
        if died:
            if isolate:
                for key in died:
                    on_result(key, {"status": "failed", "seconds": 0.0,
                                    "error": "the compile worker process died (crash in the compiler?)"})
            else:
                isolate = True
                pending = died + pending


def precompile(keys: list, root: Path, jobs: int, *, dry_run: bool = False, progress: bool = True) -> dict:
    """Compile `keys` into `root`; returns the summary (see `run`)."""
    store = DiskCache(root, "rw")
    fp = toolchain_fingerprint()
    results: dict[str, dict] = {}
    todo = []
    for key in keys:
        check = store.check(key)
        if check.ok and not env.force_recompile():
            results[key.canonical()] = {"status": "present", "seconds": 0.0, "error": None}
        else:
            todo.append(key)
            results[key.canonical()] = {"status": "missing" if dry_run else "failed", "seconds": 0.0,
                                        "error": None if dry_run else "not attempted",
                                        "check": check.status}
    bar = Progress(len(keys), progress and not dry_run)
    bar.start(len(todo), jobs)
    for key in keys:
        if results[key.canonical()]["status"] == "present":
            bar.update(key, results[key.canonical()])

    def on_result(key, result):
        results[key.canonical()] = result
        bar.update(key, result)

    if not dry_run and todo:
        if not os.access(root if root.exists() else _existing_parent(root), os.W_OK):
            for key in todo:
                on_result(key, {"status": "failed", "seconds": 0.0, "error": f"{root} is not writable"})
        else:
            for arch in sorted({k.arch for k in todo}):
                _run_pool(arch, [k for k in todo if k.arch == arch], root, jobs, on_result)
    entries = []
    for key in keys:
        r = results[key.canonical()]
        entries.append({"spec": key.spec_slug(), "arch": key.arch, "config": key.config.slug(),
                        "template": key.TEMPLATE, "relpath": entry_relpath(key, fp), **r})
    counts = {s: sum(e["status"] == s for e in entries) for s in ("compiled", "present", "failed", "missing")}
    return {"root": str(root), "toolchain": fp, "jobs": jobs, "dry_run": dry_run, **counts, "keys": entries}


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def run(keys: list, root: Path, jobs: int, *, dry_run: bool, as_json: bool, progress: bool) -> int:
    t0 = time.perf_counter()
    summary = precompile(keys, root, jobs, dry_run=dry_run, progress=progress)
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    if as_json:
        print(json.dumps(summary, indent=1))
    elif dry_run:
        for e in summary["keys"]:
            print(f"{e['status']:8} {e['arch']:8} {e['spec']} {e['config']}")
        print(f"{len(keys)} kernels: {summary['present']} present, {summary['missing']} to compile "
              f"(root {root}, toolchain tc-{summary['toolchain']})")
    else:
        for e in summary["keys"]:
            if e["status"] == "failed":
                print(f"FAILED {e['arch']} {e['spec']} {e['config']}: {e['error']}")
                if e.get("traceback"):
                    print("  " + e["traceback"].rstrip().replace("\n", "\n  "))
        print(f"precompile: {summary['compiled']} compiled, {summary['present']} already present, "
              f"{summary['failed']} failed ({len(keys)} kernels, {summary['seconds']:.1f} s, root {root}, "
              f"toolchain tc-{summary['toolchain']})")
    return 1 if summary["failed"] else 0
