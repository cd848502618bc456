"""Helpers for the cache and CLI tests: subprocess environments, a once-per-session golden cache, a
child-process script that looks kernels up and reports `kdajit.cache.stats()`.

The golden cache is built once per test session by the real CLI (`python -m kdajit precompile`,
cross-compiling the small AkkInverse kernel for sm_90a and sm_100a on this CPU-only machine); tests
copy it and damage the copy. Run as a script, this file is the child: `python cache_helpers.py
lookup '<json list of keys>'`.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
GOLDEN_ARGS = ["--arch", "sm_90a,sm_100a", "--only", "akk_inverse", "--varlen", "dense,cu32", "--chunk", "64",
               "--io", "bf16"]
# The four keys of the golden cache, as JSON (the test process never needs CuTe DSL for these).
GOLDEN_KEYS = [{"template": "akk_inverse", "varlen": v, "chunk": 64, "arch": a, "config": {"warps": 4},
               "io_dtype": "bf16"} for a in ("sm_90a", "sm_100a") for v in ("dense", "cu32")]
COLD_KEY = {"template": "akk_inverse", "varlen": "cu64", "chunk": 64, "arch": "sm_90a", "config": {"warps": 4}}

_MEMO: dict = {}


def child_env(cache_dir: Path | str | None, lock_dir: Path | str | None = None, **extra: str) -> dict:
    """A clean environment for a kdajit child process: CPU-only, sm_90a, this cache root."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KDAJIT_", "CUTE_DSL_"))}
    env.update(CUTE_DSL_ARCH="sm_90a", KDAJIT_ARCH="sm_90a", PYTHONDONTWRITEBYTECODE="1")
    if cache_dir is not None:
        env["KDAJIT_CACHE_DIR"] = str(cache_dir)
    if lock_dir is not None:
        env["KDAJIT_LOCK_DIR"] = str(lock_dir)
    env.update(extra)
    return env


def kdajit_cli(args: list[str], env: dict, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "kdajit", *args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=kw.pop("cwd", "/"), **kw)


def lookup(keys: list[dict], env: dict, *, timeout: float = 300, preimport: bool = False,
           wrapper: list[str] | None = None) -> dict:
    """Run `cache.get_kernel` on `keys` in a fresh process; returns its report (see `_child`) and its stderr."""
    argv = [PY, str(Path(__file__).resolve()), "lookup", json.dumps(keys)] + (["--preimport"] if preimport else [])
    proc = subprocess.run((wrapper or []) + argv, env=env, capture_output=True, text=True, timeout=timeout, cwd="/")
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "stderr": proc.stderr}


def read_only_wrapper(path: Path) -> list[str] | None:
    """How to run a child that sees `path` read-only.

    Not root: [] (the caller chmods the tree; permissions bind). Root ignores permissions, so the
    child runs in a private mount namespace with `path` bind-mounted read-only (EROFS, like a
    read-only container layer). None when neither works (root without mount privileges).
    """
    if os.geteuid() != 0:
        return []
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    wrapper = ["unshare", "--mount", "sh", "-c", script, str(path)]
    probe = subprocess.run(wrapper + ["true"], capture_output=True)
    return wrapper if probe.returncode == 0 and shutil.which("unshare") else None


def golden_cache(tmp_path_factory) -> tuple[Path, dict]:
    """(root, precompile --json summary) of the session's golden cache, built on first use."""
    if "golden" not in _MEMO:
        root = tmp_path_factory.mktemp("golden") / "cache"
        t0 = time.perf_counter()
        proc = kdajit_cli(["precompile", "--cache-dir", str(root), *GOLDEN_ARGS, "-j", "2", "--json", "--no-progress"],
                          child_env(None, tmp_path_factory.mktemp("golden-locks")))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        summary = json.loads(proc.stdout)
        summary["wall_s"] = time.perf_counter() - t0
        _MEMO["golden"] = (root, summary)
    return _MEMO["golden"]


def copy_cache(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)  # copies modes; ownership is ours
    return dst


def entry_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.glob("v1/*/tc-*/kernels/*/*/meta.json"))


def find_entry(root: Path, arch: str, varlen: str) -> Path:
    hits = [p for p in entry_dirs(root) if f"/{arch}/" in p.as_posix() and f".varlen-{varlen}." in p.as_posix()]
    assert len(hits) == 1, hits
    return hits[0]


def _child(keys_json: str, preimport: bool) -> None:
    """Look the keys up; print one JSON line: stats, per-key outcome, warnings, first-call seconds."""
    import warnings

    t0 = time.perf_counter()
    from kdajit import cache, compiler
    from kdajit.keys import key_from_json

    import_s = time.perf_counter() - t0
    if preimport:  # the imports any kernel load needs, so the lookup below is measured alone
        compiler._cute()
        import tvm_ffi  # noqa: F401
    results, first_call_s = [], None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in json.loads(keys_json):
            t = time.perf_counter()
            try:
                fn = cache.get_kernel(key_from_json(k))
                results.append({"ok": True, "type": type(fn).__name__, "callable": callable(fn)})
            except cache.KernelNotCached as e:
                results.append({"ok": False, "error": "KernelNotCached", "message": str(e)})
            if first_call_s is None:
                first_call_s = time.perf_counter() - t
    print(json.dumps({"stats": cache.stats(), "results": results, "import_s": import_s,
                      "first_call_s": first_call_s, "fingerprint": cache.toolchain_fingerprint(),
                      "cutlass_imported": "cutlass" in sys.modules,
                      "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]}))


if __name__ == "__main__":
    if sys.argv[1] == "lookup":
        _child(sys.argv[2], "--preimport" in sys.argv[3:])
    elif sys.argv[1] == "race":  # lookup after every racer is ready: see test_racing_processes_compile_once
        go = Path(sys.argv[3])
        from kdajit import compiler as _compiler

        _compiler._cute()
        Path(sys.argv[4]).touch()
        while not go.exists():
            time.sleep(0.01)
        _child(sys.argv[2], False)
