"""The cache as an attacker or a careless user would try it (issue 7, item 2), and the one kernel table.

Each test names the bug it catches; all run in this process on copies of the golden cache (no
CuTe DSL import: loads are faked where a test needs one).
"""
from __future__ import annotations

import io
import json
import os
import stat
import tarfile
import threading
import warnings
from pathlib import Path

import cache_helpers as ch
import pytest

from kdajit import cache, cache_entry, cache_files, cache_layout, cache_locks, cli
from kdajit.cache_toolchain import toolchain_fingerprint
from kdajit.keys import AkkInverseKey, ForwardSpec

KEY = AkkInverseKey("dense", 64, "sm_90a")


def kd(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def entry_of(root: Path) -> Path:
    return ch.find_entry(root, "sm_90a", "dense")


def check(root: Path) -> cache_entry.EntryCheck:
    return cache.DiskCache(root).check(KEY)


@pytest.fixture(autouse=True)
def fresh_kernel_table():
    cache.clear()
    yield
    cache.clear()


# -- trust: bundles, root-owned entries, the path to the root, what gets loaded -----------------
def test_import_needs_the_sha256_that_export_printed(copy, tmp_path, capsys):
    bundle = tmp_path / "b.tar"
    rc, out, _ = kd(capsys, "cache", "export", bundle, "--cache-dir", copy)
    printed = next(line.split()[1] for line in out.splitlines() if line.startswith("sha256:"))
    fresh = tmp_path / "fresh"
    rc, out, err = kd(capsys, "cache", "import", bundle, "--cache-dir", fresh)
    assert rc == 2 and "--sha256" in err and "native code" in err and "--trust-unpinned-bundle" in err
    rc, _, err = kd(capsys, "cache", "import", bundle, "--sha256", "0" * 64, "--cache-dir", fresh)
    assert rc == 2 and "not the pinned" in err
    assert not fresh.exists()
    rc, out, _ = kd(capsys, "cache", "import", bundle, "--sha256", printed, "--cache-dir", fresh)
    assert rc == 0 and "4 imported" in out
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["cache"]._subparsers._group_actions[
        0].choices["import"].format_help()
    assert "WILL RUN" in help_text


def test_root_owned_entries_need_explicit_trust(copy, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("needs root-owned files (run as root)")
    assert check(copy).ok
    monkeypatch.setattr(os, "getuid", lambda: 4242)  # another user looking at root's cache
    refused = check(copy)
    assert refused.status == "untrusted" and "owned by uid 0" in refused.reason
    assert "KDAJIT_TRUST_ROOT_OWNED" in refused.reason
    monkeypatch.setenv("KDAJIT_TRUST_ROOT_OWNED", "1")
    assert check(copy).ok


def test_a_parent_of_the_root_writable_by_others_makes_it_untrusted(golden, tmp_path):
    parent = tmp_path / "shared"
    parent.mkdir()
    root = ch.copy_cache(golden[0], parent / "cache")
    parent.chmod(0o777)  # anyone could rename our root away and put a symlink in its place
    result = check(root)
    assert result.status == "untrusted" and f"parent directory {parent}" in result.reason, result
    parent.chmod(0o1777)  # sticky, like /tmp: others cannot rename what is ours
    assert check(root).ok


@pytest.mark.parametrize("loader, load", [("dsl", "kdajit.compiler.load_object"),
                                          ("linked", "kdajit.linked_loader.load")])
def test_the_bytes_loaded_are_the_bytes_verified(copy, monkeypatch, loader, load):
    obj = entry_of(copy) / cache_layout.ARTIFACT
    verified = obj.read_bytes()
    real_check = cache.check_entry

    def check_then_swap(*args, **kwargs):
        result = real_check(*args, **kwargs)
        obj.write_bytes(b"attacker code")  # the object changes between the check and the load
        return result

    loaded = []
    monkeypatch.setattr(cache, "check_entry", check_then_swap)
    monkeypatch.setenv("KDAJIT_LOADER", loader)
    monkeypatch.setattr(load, lambda path: loaded.append(Path(path).read_bytes()) or len)
    assert cache.DiskCache(copy).load(KEY) is len
    assert loaded == [verified]


# -- damaged meta.json: bounded, non-blocking, never raising ------------------------------------
def test_deeply_nested_meta_is_quarantined_and_listings_survive(copy, capsys):
    (entry_of(copy) / cache_layout.META).write_bytes(b"[" * 20000 + b"]" * 20000)
    rc, out, _ = kd(capsys, "cache", "ls", "--cache-dir", copy)
    assert rc == 0 and "no valid meta.json" in out and "4 entries" in out
    result = check(copy)
    assert result.status == "corrupt" and "nested too deeply" in result.reason
    with pytest.warns(cache.KdajitCacheWarning, match="moved to"):
        assert cache.DiskCache(copy).load(KEY) is None  # quarantined, not raised
    assert cache.stats()["quarantined"] == 1
    (ch.find_entry(copy, "sm_90a", "cu32") / cache_layout.META).write_bytes(b"{" * 20000)
    rc, out, _ = kd(capsys, "cache", "verify", "--fix", "--cache-dir", copy)
    assert rc == 0 and "1 moved to quarantine" in out


def test_a_fifo_as_meta_does_not_hang_lookups_or_listings(copy, capsys):
    meta = entry_of(copy) / cache_layout.META
    meta.unlink()
    os.mkfifo(meta, 0o600)
    results = {}
    worker = threading.Thread(target=lambda: results.update(check=check(copy), ls=cli.main(
        ["cache", "ls", "--cache-dir", str(copy)])), daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():  # release the blocked open so the thread ends
        os.close(os.open(meta, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("reading a FIFO meta.json blocked")
    capsys.readouterr()
    assert results["check"].status == "unsafe" and "not a regular file" in results["check"].reason
    assert results["ls"] == 0


def test_a_huge_meta_is_not_read(copy):
    meta = entry_of(copy) / cache_layout.META
    with open(meta, "r+b") as f:
        f.truncate(300 << 20)  # sparse: no disk used
    result = check(copy)
    assert result.status == "corrupt" and f"over the {cache_entry.MAX_META_BYTES}-byte limit" in result.reason


def test_meta_with_wrong_json_types_is_corrupt_and_why_survives_it(copy, capsys):
    meta_path = ch.find_entry(copy, "sm_90a", "cu32") / cache_layout.META
    meta = json.loads(meta_path.read_text())
    meta["key"]["config"] = [4]
    meta["artifact"]["bytes"] = True
    meta_path.write_text(json.dumps(meta))
    rc, out, err = kd(capsys, "cache", "why", "akk_inverse.varlen-cu64.chunk-64@sm_90a", "--cache-dir", copy)
    assert rc == 1 and "result:    miss" in out, out + err
    relpath = meta_path.parent.relative_to(copy).as_posix()
    assert cache_entry.check_entry(copy, relpath).status == "corrupt"


def _rewrite_manifest(src: Path, dst: Path, edit) -> None:
    with tarfile.open(src) as tar:
        items = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(dst, "w") as out:
        for m, data in items:
            if m.name == "kdajit-bundle.json":
                manifest = json.loads(data)
                edit(manifest)
                data = json.dumps(manifest).encode()
            m.size = len(data)
            out.addfile(m, io.BytesIO(data))


@pytest.mark.parametrize("edit, words", [
    (lambda m: m.update(toolchains=[]), "'toolchains' must be an object, got list"),
    (lambda m: m.update(entries={"a": 1}), "'entries' must be list, got dict"),
    (lambda m: m["entries"][0].update(files="x"), "entries[0].files must be an object, got str"),
    (lambda m: m["entries"][1]["files"]["kernel.o"].update(bytes="12"), "entries[1].files['kernel.o'].bytes must be int"),
])
def test_bundle_manifests_with_wrong_types_give_clear_errors(copy, tmp_path, capsys, edit, words):
    bundle, bad = tmp_path / "b.tar", tmp_path / "bad.tar"
    kd(capsys, "cache", "export", bundle, "--cache-dir", copy)
    _rewrite_manifest(bundle, bad, edit)
    rc, out, err = kd(capsys, "cache", "import", bad, "--trust-unpinned-bundle", "--cache-dir", tmp_path / "r")
    assert rc == 2 and words in err, err


# -- creating the root, lock directories --------------------------------------------------------
def test_root_is_created_private_when_the_shm_lock_dir_is_unusable(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / f"kdajit-{os.getuid()}").write_text("pre-created by another user")
    monkeypatch.setattr(cache_locks, "SHM_DIR", shm)
    monkeypatch.delenv("KDAJIT_LOCK_DIR", raising=False)
    root = tmp_path / "new" / "cache"
    old_umask = os.umask(0o002)
    try:
        lock_dir, refused = cache_locks.usable_lock_dir(root)
    finally:
        os.umask(old_umask)
    assert lock_dir == root / cache_layout.LOCKS and refused
    for d in (root.parent, root, lock_dir):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert cache_files.root_problem(root) is None


def test_a_configured_lock_dir_must_be_private(tmp_path, monkeypatch):
    shared = tmp_path / "locks"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("KDAJIT_LOCK_DIR", str(shared))
    lock_dir, refused = cache_locks.usable_lock_dir(tmp_path / "cache")
    assert lock_dir is None and "writable by group or others" in refused[0]
    if os.geteuid() == 0:
        shared.chmod(0o700)
        os.chown(shared, 65534, 65534)
        lock_dir, refused = cache_locks.usable_lock_dir(tmp_path / "cache")
        assert lock_dir is None and "owned by uid 65534" in refused[0]


# -- races and short writes ---------------------------------------------------------------------
def test_an_entry_pruned_while_being_read_is_a_miss_not_corruption(copy, tmp_path, monkeypatch):
    entry = entry_of(copy)
    real_open = os.open

    def prune_first(path, *args, **kwargs):
        if Path(path) == entry / cache_layout.META and entry.exists():
            os.rename(entry, tmp_path / "pruned")  # what `kdajit cache prune` does before deleting
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", prune_first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.DiskCache(copy).load(KEY) is None
    monkeypatch.undo()
    assert check(copy).status == "missing"
    assert cache.stats()["quarantined"] == 0 and cache.stats()["disk_errors"] == 0 and caught == []


def test_write_file_atomic_finishes_short_writes(tmp_path, monkeypatch):
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:5])))
    data = bytes(range(256)) * 4
    cache_files.write_file_atomic(tmp_path / "f", data)
    monkeypatch.undo()
    assert (tmp_path / "f").read_bytes() == data


# -- one kernel table ----------------------------------------------------------------------------
@pytest.fixture
def fake_disk(monkeypatch, tmp_path):
    """Every disk lookup "loads" a stand-in function; records which keys were looked up."""
    monkeypatch.setenv("KDAJIT_ARCH", "sm_90a")
    monkeypatch.setenv("KDAJIT_CACHE_DIR", str(tmp_path / "cache"))
    looked_up = []
    monkeypatch.setattr(cache.DiskCache, "load", lambda self, key: looked_up.append(key) or (lambda: key))
    return looked_up


def _problem():
    from kdajit.validate import Problem

    return Problem(1, 64, 1, 128, 128, 64, "bf16", "dense", "bf16", 1)


def test_one_table_fetches_only_what_a_call_runs_and_counts_steady_state_hits(fake_disk):
    from kdajit import api

    spec = ForwardSpec("bf16", "dense", 128, 128, 64, False, "sm_90a")
    kernels = api._kernels(_problem(), 64, False, 0, intra=True, recompute=False)  # what intra() fetches
    assert fake_disk == [spec.intra_key(), spec.inverse_key()] and kernels.recompute is None
    for _ in range(3):
        assert api._kernels(_problem(), 64, False, 0, intra=True, recompute=False) == kernels
    s = cache.stats()
    assert (s["misses"], s["memory_hits"], s["kernels_in_memory"]) == (2, 6, 2)
    api._kernels(_problem(), 64, False, 0, intra=False, recompute=True)  # what recompute_w_u() fetches
    assert fake_disk[2:] == [spec.recompute_key()]
    cache.clear()
    assert cache.stats()["kernels_in_memory"] == 0 and cache.stats()["memory_hits"] == 0
    api._kernels(_problem(), 64, False, 0, intra=True, recompute=False)
    assert len(fake_disk) == 5  # cleared: looked up again


@pytest.fixture
def fresh_tuner():
    """The tuner's choices forgotten before and after the test (its demotions and tuning attempts stay in it)."""
    from kdajit import tuner

    tuner.clear()
    yield tuner
    tuner.clear()


@pytest.fixture
def counted_call(fake_disk, monkeypatch):
    """(call, lookups): `call()` asks api._kernels for forward's kernels of `_problem()` on an sm_90a with 132 SMs;
    `lookups` records every key tuple that reached cache.get_kernels."""
    from kdajit import api

    monkeypatch.setattr(api, "_sm_count", lambda index: 132)
    lookups = []
    real_get_kernels = cache.get_kernels
    monkeypatch.setattr(cache, "get_kernels", lambda keys: lookups.append(tuple(keys)) or real_get_kernels(keys))

    def call():
        return api._kernels(_problem(), 64, False, 0, intra=True, recompute=True, seqs=1, shape=lambda: None)

    return call, lookups


def test_a_repeated_call_reuses_its_kernels_until_the_table_a_choice_or_the_route_changes(fake_disk, fresh_tuner,
                                                                                          counted_call, monkeypatch):
    """api._kernels memoizes a call's kernels (host cost); the memo must not outlive what it was read from."""
    tuner = fresh_tuner
    call, lookups = counted_call
    spec = ForwardSpec("bf16", "dense", 128, 128, 64, False, "sm_90a")
    first = call()
    assert lookups == [(spec.fused_key(spec.untuned_fused_config),)] and first.fused is not None
    hits = cache.stats()["memory_hits"]
    for _ in range(3):
        assert call() == first
    assert len(lookups) == 1 and cache.stats()["memory_hits"] == hits + 3  # served by the memo, still counted
    cache.clear()
    call()
    assert len(lookups) == 2 and len(fake_disk) == 2  # the table was cleared: looked up and loaded again
    with pytest.warns(tuner.KdajitTuningWarning):
        tuner.demote(spec, 0, 64, 1, 1, "a test")  # the tuner's choice for this workload changes
    assert call().fused is not None and lookups[-1] == (spec.fused_key(),)
    monkeypatch.setenv("KDAJIT_FORWARD_ROUTE", "standalone")
    assert call().fused is None and lookups[-1] == (spec.intra_key(), spec.inverse_key(), spec.recompute_key())


def test_a_choice_made_under_graph_capture_is_not_memoized(fresh_tuner, counted_call, monkeypatch):
    """Under CUDA-graph capture the tuner cannot tune, answers the untuned configuration without keeping it, and tunes
    on a later call: the call's kernels must not be memoized either, or no later call would tune."""
    tuner = fresh_tuner
    call, lookups = counted_call
    monkeypatch.setenv("KDAJIT_AUTOTUNE", "on")  # no record in this cache: a call wants to tune
    tuned = []
    monkeypatch.setattr(tuner, "tune", lambda *args, **kwargs: tuned.append(args[0]))  # no record comes back
    monkeypatch.setattr(tuner, "may_tune", lambda: False)
    call()
    call()
    assert len(lookups) == 2 and not tuned  # looked up each time, never tuned while capturing
    monkeypatch.setattr(tuner, "may_tune", lambda: True)
    call()
    assert len(tuned) == 1  # the first call after the capture tunes


def test_disable_jit_names_every_missing_kernel_of_the_call_and_only_those(tmp_path, monkeypatch):
    from kdajit import api

    monkeypatch.setenv("KDAJIT_ARCH", "sm_90a")
    monkeypatch.setenv("KDAJIT_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("KDAJIT_DISABLE_JIT", "1")
    spec = ForwardSpec("bf16", "dense", 128, 128, 64, True, "sm_90a")
    with pytest.raises(cache.KernelNotCached) as only_recompute:
        api._kernels(_problem(), 64, True, 0, intra=False, recompute=True)
    assert only_recompute.value.keys == (spec.recompute_key(),)
    with pytest.raises(cache.KernelNotCached) as fused:  # forward() on sm_90a: the fused kernel alone
        api._kernels(_problem(), 64, True, 0, intra=True, recompute=True)
    assert fused.value.keys == (spec.fused_key(),)
    monkeypatch.setenv("KDAJIT_FORWARD_ROUTE", "standalone")
    with pytest.raises(cache.KernelNotCached) as everything:
        api._kernels(_problem(), 64, True, 0, intra=True, recompute=True)
    standalone = (spec.intra_key(), spec.inverse_key(), spec.recompute_key())
    assert everything.value.keys == standalone
    for error, expected in ((fused.value, [spec.fused_key()]), (everything.value, list(standalone))):
        message = str(error)
        command = next(line.strip() for line in message.splitlines() if line.strip().startswith("kdajit precompile"))
        import shlex

        args = cli.build_parser().parse_args(shlex.split(command)[1:])
        assert cli.precompile_keys(args, check_supported=False) == expected
        assert all(cache.describe(k) in message for k in expected)


def test_fingerprint_is_what_the_layout_names(copy):
    # Every entry the golden cache holds parses back to its own key's path.
    fp = toolchain_fingerprint()
    for where in cache_layout.entry_paths(copy):
        meta = json.loads((copy / where.relpath / cache_layout.META).read_text())
        from kdajit.keys import key_from_json

        assert cache_layout.entry_relpath(key_from_json(meta["key"]), fp) == where.relpath
        assert cache_layout.parse_entry_relpath(where.relpath) == where
    with pytest.raises(ValueError, match="not a cache entry path"):
        cache_layout.parse_entry_relpath("v1/sm_90a/../../../../tmp/evil")
