"""The persistent kernel cache: cross-process reuse, races, damage, permissions, DISABLE_JIT.

Kernel-free in this process (CuTe DSL is imported only by child processes). Real compiles use the
small AkkInverse template: a golden cache of 4 entries (sm_90a and sm_100a, dense and cu32) is
cross-compiled once per session with `kdajit precompile`, and each test damages its own copy. Every
compile and load is counted by `kdajit.cache.stats()` in the child that did it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import stat
import subprocess
import time
from pathlib import Path

import cache_helpers as ch
import pytest

from kdajit import cache, cache_entry, cache_layout, cache_locks, cache_toolchain, hints
from kdajit.keys import AkkInverseKey, ForwardSpec, FusedConfig, KernelConfig, key_from_json


def _modes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            out[p.relative_to(root).as_posix()] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


# -- keys, layout, fingerprint -----------------------------------------------------------------
def test_entry_path_holds_arch_toolchain_spec_and_config():
    key = AkkInverseKey("dense", 64, "sm_90a")
    rel = cache_layout.entry_relpath(key, "0123456789abcdef")
    assert rel.startswith("v1/sm_90a/tc-0123456789abcdef/kernels/akk_inverse.varlen-dense.chunk-64.io_dtype-bf16/w4-")
    assert not os.path.isabs(rel) and len(rel) < 200
    other_arch = cache_layout.entry_relpath(AkkInverseKey("dense", 64, "sm_100a"), "0123456789abcdef")
    other_cfg = cache_layout.entry_relpath(AkkInverseKey("dense", 64, "sm_90a", KernelConfig(warps=8)), "0123456789abcdef")
    assert len({rel, other_arch, other_cfg}) == 3
    assert other_arch.startswith("v1/sm_100a/")


def test_toolchain_fingerprint_has_no_paths_or_python_version():
    comp = cache_toolchain.toolchain_components()
    text = json.dumps(comp)
    assert str(ch.REPO) not in text and "site-packages" not in text and "/" + "work" not in text
    assert "python" not in comp
    assert any(d.startswith("nvidia-cutlass-dsl==") for d in comp["dsl_stack"])
    assert any(d.startswith("nvidia-cutlass-dsl-libs-") for d in comp["dsl_stack"])  # the cu12/cu13 flavour
    assert {"templates/akk_inverse.py", "templates/common.py", "kdajit/keys.py", "kdajit/compiler.py"} <= set(
        comp["kernel_src"])
    fp = cache_toolchain.toolchain_fingerprint()
    assert len(fp) == 16 and int(fp, 16) >= 0 and fp == cache_toolchain.fingerprint_of(comp)


def test_fingerprint_is_stable_across_processes_and_follows_codegen_flags(tmp_path):
    code = "from kdajit import cache_toolchain; print(cache_toolchain.toolchain_fingerprint())"
    env = ch.child_env(None)
    same = subprocess.run([ch.PY, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, check=True)
    lineinfo = subprocess.run([ch.PY, "-c", code], env={**env, "CUTE_DSL_LINEINFO": "1"}, cwd=tmp_path,
                              capture_output=True, text=True, check=True)
    assert same.stdout.strip() == cache_toolchain.toolchain_fingerprint()
    assert lineinfo.stdout.strip() != cache_toolchain.toolchain_fingerprint()


def test_precompile_command_names_exactly_the_missing_keys():
    from kdajit import cli

    parser = cli.build_parser()
    for qg, config in ((False, KernelConfig()), (True, KernelConfig(warps=8))):
        keys = [dataclasses.replace(key, config=config)
                for key in ForwardSpec("fp32", "cu64", 128, 128, 64, qg, "sm_100a").kernel_keys()]
        argv = shlex.split(hints.precompile_command(keys, "/some root/x"))
        assert argv[:2] == ["kdajit", "precompile"]
        args = parser.parse_args(argv[1:])
        assert args.cache_dir == "/some root/x"
        assert cli.precompile_keys(args, check_supported=config == KernelConfig()) == keys, argv
    fused = ForwardSpec("bf16", "dense", 128, 128, 64, False, "sm_90a").fused_key(FusedConfig(True, 1, "head"))
    args = parser.parse_args(shlex.split(hints.precompile_command([fused]))[1:])
    assert cli.precompile_keys(args, check_supported=False) == [fused]


# -- cross-compile, then a fresh process loads without compiling -------------------------------
def test_precompile_cross_compiles_private_entries(golden):
    root, summary = golden
    assert (summary["compiled"], summary["present"], summary["failed"]) == (4, 0, 0)
    entries = ch.entry_dirs(root)
    assert {p.relative_to(root).parts[1] for p in entries} == {"sm_90a", "sm_100a"}
    fp = cache_toolchain.toolchain_fingerprint()
    for entry in entries:
        meta = json.loads((entry / cache_layout.META).read_text())
        key = key_from_json(meta["key"])
        assert entry.relative_to(root).as_posix() == cache_layout.entry_relpath(key, fp)
        assert meta["artifact"]["bytes"] == (entry / cache_layout.ARTIFACT).stat().st_size > 10_000
        assert cache_entry.check_entry(root, cache_layout.entry_relpath(key, fp), expect_key=key, expect_fp=fp).ok
    for rel, mode in _modes(root).items():
        if rel == cache_layout.CACHEDIR_TAG:
            assert mode == 0o644
        elif (root / rel).is_dir():
            assert mode == 0o700, rel
        else:
            assert mode == 0o600, rel
    assert not list((root / cache_layout.STAGING).iterdir())  # staging is cleaned up


def test_fresh_process_loads_without_compiling(copy, tmp_path):
    report = ch.lookup([ch.GOLDEN_KEYS[0], ch.GOLDEN_KEYS[2]], ch.child_env(copy, tmp_path / "locks"), preimport=True)
    s = report["stats"]
    assert (s["compiles"], s["disk_hits"], s["quarantined"], s["disk_errors"]) == (0, 2, 0, 0), report
    assert all(r["ok"] and r["callable"] and r["type"] == "Function" for r in report["results"])
    assert report["warnings"] == []
    # The first lookup in a fresh process, beyond imports: verify meta + sha256, load_module (~5-10 ms here).
    print(f"warm first call {report['first_call_s'] * 1e3:.1f} ms, load_s {s['load_s'] * 1e3:.1f} ms")
    assert report["first_call_s"] < 0.25


def test_racing_processes_compile_once(golden, tmp_path):
    root, locks = tmp_path / "cache", tmp_path / "locks"
    env = ch.child_env(root, locks)
    go = tmp_path / "go"
    script = str(Path(ch.__file__).resolve())
    procs = [subprocess.Popen([ch.PY, script, "race", json.dumps([ch.COLD_KEY]), str(go), str(tmp_path / f"ready{i}")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
             for i in range(8)]
    deadline = time.time() + 240
    while not all((tmp_path / f"ready{i}").exists() for i in range(8)):
        assert time.time() < deadline and all(p.poll() is None for p in procs), "a racer died before the start"
        time.sleep(0.05)
    go.touch()  # all 8 look the cold key up at once
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["stats"]["compiles"] for r in reports) == 1
    assert sum(r["stats"]["disk_hits"] for r in reports) == 7
    assert any(r["stats"]["lock_wait_s"] > 0.5 for r in reports)  # losers waited for the winner's compile
    assert all(r["results"][0]["ok"] for r in reports)
    assert all(r["stats"]["disk_errors"] == 0 and r["stats"]["lock_timeouts"] == 0 for r in reports)
    assert len(ch.entry_dirs(root)) == 1
    assert not (root / cache_layout.QUARANTINE).exists() and not list((root / cache_layout.STAGING).iterdir())


def test_lock_timeout_compiles_anyway(tmp_path, monkeypatch):
    import filelock

    root, locks = tmp_path / "cache", tmp_path / "locks"
    env = ch.child_env(root, locks, KDAJIT_LOCK_TIMEOUT="0.5")
    monkeypatch.setenv("KDAJIT_LOCK_DIR", str(locks))
    locks.mkdir(mode=0o700)
    path = cache_locks.lock_file(locks, root, key_from_json(ch.COLD_KEY), cache_toolchain.toolchain_fingerprint())
    with filelock.FileLock(str(path)):  # a "hung" compile holds the entry's lock
        report = ch.lookup([ch.COLD_KEY], env)
    s = report["stats"]
    assert (s["lock_timeouts"], s["compiles"]) == (1, 1) and report["results"][0]["ok"]
    assert any("KDAJIT_LOCK_TIMEOUT" in w for w in report["warnings"])
    assert 0.4 < s["lock_wait_s"] < 5


# -- damaged, foreign and unsafe entries -------------------------------------------------------
def _damage(entry: Path, how: str, root: Path) -> None:
    meta_path, obj = entry / cache_layout.META, entry / cache_layout.ARTIFACT
    if how == "truncated object":
        obj.write_bytes(obj.read_bytes()[: obj.stat().st_size // 2])
    elif how == "flipped byte":
        data = bytearray(obj.read_bytes())
        data[len(data) // 2] ^= 0xFF
        obj.write_bytes(bytes(data))
    elif how == "garbage metadata":
        meta_path.write_bytes(b"\x00{not json")
    elif how == "missing metadata":
        meta_path.unlink()
    elif how == "wrong toolchain":
        meta = json.loads(meta_path.read_text())
        meta["toolchain_fp"] = "0" * 16
        meta_path.write_text(json.dumps(meta))
    elif how == "another key's metadata":
        other = ch.find_entry(root, "sm_90a", "cu32")
        meta_path.write_bytes((other / cache_layout.META).read_bytes())
    elif how == "world-writable object":
        obj.chmod(0o666)
    elif how == "group-writable entry dir":
        entry.chmod(0o770)
    elif how == "symlinked object":
        target = entry.parent / "elsewhere.o"
        obj.rename(target)
        obj.symlink_to(target)
    elif how == "owned by another user":
        os.chown(obj, 65534, 65534)
    else:
        raise AssertionError(how)


DAMAGE = {  # how -> (status, words in the reason)
    "truncated object": ("corrupt", "truncated"),
    "flipped byte": ("corrupt", "sha256"),
    "garbage metadata": ("corrupt", "not valid JSON"),
    "missing metadata": ("corrupt", "incomplete"),
    "wrong toolchain": ("foreign", "toolchain tc-0000000000000000"),
    "another key's metadata": ("foreign", "describes"),
    "world-writable object": ("unsafe", "writable by group or others"),
    "group-writable entry dir": ("unsafe", "writable by group or others"),
    "symlinked object": ("unsafe", "symlink"),
    "owned by another user": ("unsafe", "owned by uid 65534"),
}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_damaged_entries_are_detected(copy, how):
    if how == "owned by another user" and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    entry = ch.find_entry(copy, "sm_90a", "dense")
    key = AkkInverseKey("dense", 64, "sm_90a")
    store = cache.DiskCache(copy)
    assert store.check(key).ok
    _damage(entry, how, copy)
    check = store.check(key)
    status, words = DAMAGE[how]
    assert (check.status, check.bad) == (status, True) and words in check.reason, check


def test_damaged_entries_are_quarantined_and_rebuilt(copy, tmp_path):
    damage = {("sm_90a", "dense"): "truncated object", ("sm_90a", "cu32"): "garbage metadata",
              ("sm_100a", "dense"): "wrong toolchain", ("sm_100a", "cu32"): "world-writable object"}
    for (arch, varlen), how in damage.items():
        _damage(ch.find_entry(copy, arch, varlen), how, copy)
    report = ch.lookup(ch.GOLDEN_KEYS, ch.child_env(copy, tmp_path / "locks"))
    s = report["stats"]
    assert (s["compiles"], s["quarantined"], s["disk_hits"], s["disk_errors"]) == (4, 4, 0, 0), report
    assert all(r["ok"] for r in report["results"])
    assert sum("moved to" in w for w in report["warnings"]) == 4
    assert report["stderr"].count("kdajit: compiling") == 1  # said once per process, not per kernel
    reasons = sorted(json.loads((q / "reason.json").read_text())["reason"]
                     for q in (copy / cache_layout.QUARANTINE).iterdir())
    assert len(reasons) == 4
    for status, words in (DAMAGE[h] for h in damage.values()):
        assert any(r.startswith(status) and words in r for r in reasons), (status, reasons)
    fp = cache_toolchain.toolchain_fingerprint()
    for k in ch.GOLDEN_KEYS:  # rebuilt, valid and private again
        key = key_from_json(k)
        assert cache_entry.check_entry(copy, cache_layout.entry_relpath(key, fp), expect_key=key, expect_fp=fp).ok
        assert stat.S_IMODE((copy / cache_layout.entry_relpath(key, fp) / cache_layout.ARTIFACT).stat().st_mode) == 0o600


def test_read_only_root_loads_hits_and_compiles_misses_in_memory(golden, tmp_path):
    # A read-only cache (a baked image, a read-only home): hits load, a miss compiles in memory with
    # one warning, and nothing is written.
    root = ch.copy_cache(golden[0], tmp_path / "cache")
    wrapper = ch.read_only_wrapper(root)
    if wrapper is None:
        pytest.skip("running as root without mount privileges: cannot make a read-only root")
    if not wrapper:
        for p in sorted(root.rglob("*"), reverse=True) + [root]:
            p.chmod(0o555 if p.is_dir() else 0o444)
    before = _modes(root)
    try:
        report = ch.lookup([ch.GOLDEN_KEYS[0], ch.COLD_KEY], ch.child_env(root, tmp_path / "locks"), wrapper=wrapper)
    finally:
        for p in [root] + [p for p in root.rglob("*") if p.is_dir()]:
            p.chmod(0o700)
    s = report["stats"]
    assert (s["disk_hits"], s["compiles"], s["quarantined"]) == (1, 1, 0), report
    assert s["disk_errors"] >= 1 and all(r["ok"] for r in report["results"])
    assert sum("cannot write the kernel cache" in w for w in report["warnings"]) == 1, report["warnings"]
    assert set(_modes(root)) == set(before)  # nothing created, nothing moved


def test_root_writable_by_others_is_never_loaded(copy, tmp_path):
    copy.chmod(0o777)  # anyone could have swapped the objects below it
    assert cache.DiskCache(copy).check(AkkInverseKey("dense", 64, "sm_90a")).status == "untrusted"
    before = _modes(copy)
    report = ch.lookup([ch.GOLDEN_KEYS[0]], ch.child_env(copy, tmp_path / "locks"))
    s = report["stats"]
    assert (s["disk_hits"], s["compiles"], s["published"], s["quarantined"]) == (0, 1, 0, 0), report
    assert any("not using the kernel cache" in w and "writable by group or others" in w for w in report["warnings"])
    assert _modes(copy) == before


def test_unusable_root_degrades_to_memory(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache root should be")
    report = ch.lookup([ch.COLD_KEY], ch.child_env(blocker / "cache", tmp_path / "locks"))
    s = report["stats"]
    assert (s["compiles"], s["disk_hits"]) == (1, 0) and s["disk_errors"] >= 1 and report["results"][0]["ok"]
    assert any("using in-memory kernels" in w for w in report["warnings"])


def test_a_first_call_that_compiles_says_so_once_with_the_command_that_avoids_it(tmp_path):
    root = tmp_path / "cache"
    report = ch.lookup([ch.COLD_KEY], ch.child_env(root, tmp_path / "locks"))
    assert report["stats"]["compiles"] == 1
    notes = [line for line in report["stderr"].splitlines() if "kdajit: compiling" in line]
    assert len(notes) == 1 and "about 10 s each" in notes[0], report["stderr"]
    command = shlex.split(notes[0].split("run: ", 1)[1])
    fix = ch.kdajit_cli(command[1:] + ["--json", "--no-progress"], ch.child_env(None, tmp_path / "locks"))
    assert fix.returncode == 0 and json.loads(fix.stdout)["present"] == 1, fix.stdout + fix.stderr
    code = "import logging, sys; logging.basicConfig(stream=sys.stdout); " \
           "from kdajit import cache, keys; cache.get_kernel(keys.key_from_json(%r))" % ch.COLD_KEY
    proc = subprocess.run([ch.PY, "-c", code], env=ch.child_env(tmp_path / "other", tmp_path / "locks"),
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert proc.returncode == 0 and "WARNING:kdajit:kdajit: compiling 1 kernel(s)" in proc.stdout  # via logging


# -- KDAJIT_DISABLE_JIT ------------------------------------------------------------------------
def test_disable_jit_miss_names_the_command_that_fixes_it(tmp_path):
    root, locks = tmp_path / "my cache", tmp_path / "locks"
    env = ch.child_env(root, locks, KDAJIT_DISABLE_JIT="1")
    miss = ch.lookup([ch.COLD_KEY], env)
    assert miss["stats"]["compiles"] == 0 and not miss["results"][0]["ok"]
    message = miss["results"][0]["message"]
    command = next(line.strip() for line in message.splitlines() if line.strip().startswith("kdajit precompile"))
    argv = shlex.split(command)
    assert argv[argv.index("--cache-dir") + 1] == str(root)
    fix = ch.kdajit_cli(argv[1:] + ["--json", "--no-progress"], ch.child_env(None, locks))
    assert fix.returncode == 0, fix.stderr
    assert json.loads(fix.stdout)["compiled"] == 1
    hit = ch.lookup([ch.COLD_KEY], env)
    assert hit["results"][0]["ok"] and (hit["stats"]["compiles"], hit["stats"]["disk_hits"]) == (0, 1)


def test_cache_off_never_touches_the_disk(tmp_path):
    report = ch.lookup([ch.COLD_KEY], ch.child_env(tmp_path / "cache", tmp_path / "locks", KDAJIT_CACHE="off",
                                                   KDAJIT_DISABLE_JIT="1"))
    assert "KDAJIT_CACHE=off" in report["results"][0]["message"]
    assert not (tmp_path / "cache").exists()


# -- KDAJIT_CACHE_RO_DIRS --------------------------------------------------------------------------
def test_read_only_layers_serve_hits_and_a_bad_entry_there_is_skipped_untouched(golden, tmp_path):
    root, layer, broken = tmp_path / "empty-root", tmp_path / "layer", tmp_path / "broken-layer"
    ch.copy_cache(golden[0], layer)
    ch.copy_cache(golden[0], broken)
    damaged = ch.find_entry(broken, "sm_90a", "dense")
    _damage(damaged, "truncated object", broken)
    before = sorted(p.relative_to(broken).as_posix() for p in broken.rglob("*"))
    env = ch.child_env(root, tmp_path / "locks", KDAJIT_DISABLE_JIT="1",
                       KDAJIT_CACHE_RO_DIRS=os.pathsep.join([str(broken), str(layer)]))
    report = ch.lookup(ch.GOLDEN_KEYS, env)
    s = report["stats"]
    assert all(r["ok"] for r in report["results"]), report
    assert (s["compiles"], s["disk_hits"], s["quarantined"]) == (0, 4, 0), report
    assert sum("ignoring cache entry" in w and "broken-layer" in w for w in report["warnings"]) == 1, report
    assert sorted(p.relative_to(broken).as_posix() for p in broken.rglob("*")) == before  # never modified
    assert not root.exists() or not list(root.rglob("kernel.o"))  # nothing was copied into the root
