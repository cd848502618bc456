"""The `kdajit` command: precompile, cache ls/show/why/verify/prune/clear/export/import, env.

Verbs run in this process (`kdajit.cli.main`, no CuTe DSL import) on copies of the session's golden
cache (4 AkkInverse entries, see cache_helpers); the checks that need a compile or a load run in
child processes and read their `cache.stats()`.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import socket
import subprocess
import stat
import tarfile
import time
from pathlib import Path

import cache_helpers as ch
import pytest

from kdajit import cache_layout, cache_toolchain, cli


def kd(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def kd_json(capsys, *argv: str, rc: int = 0) -> dict:
    got_rc, out, err = kd(capsys, *argv, "--json")
    assert got_rc == rc, out + err
    return json.loads(out)


def make_stale(root: Path, arch: str = "sm_100a") -> str:
    """Turn `arch`'s entries into entries of an older toolchain (older DSL, edited template)."""
    comp = cache_toolchain.toolchain_components()
    comp["dsl_stack"] = [d.split("==")[0] + "==4.0.0" if d.startswith("nvidia-cutlass-dsl==") else d
                         for d in comp["dsl_stack"]]
    comp["kernel_src"]["templates/akk_inverse.py"] = "0" * 64
    old_fp = cache_toolchain.fingerprint_of(comp)
    cur = root / "v1" / arch / f"tc-{cache_toolchain.toolchain_fingerprint()}"
    stale = cur.with_name(f"tc-{old_fp}")
    cur.rename(stale)
    (stale / cache_layout.TOOLCHAIN_FILE).write_text(json.dumps({"fingerprint": old_fp, "components": comp}))
    for meta_path in stale.glob("kernels/*/*/meta.json"):
        meta = json.loads(meta_path.read_text())
        meta["toolchain_fp"] = old_fp
        meta_path.write_text(json.dumps(meta))
    return old_fp


# -- ls / show / why ---------------------------------------------------------------------------
def test_ls_table_and_json(copy, capsys):
    rc, out, _ = kd(capsys, "cache", "ls", "--cache-dir", copy)
    lines = out.splitlines()
    assert rc == 0 and lines[0].split() == ["ARCH", "TOOLCHAIN", "SPEC", "CONFIG", "SIZE", "CREATED", "LAST", "USED"]
    assert len(lines) == 6 and lines[-1].startswith("4 entries")
    assert sum("akk_inverse.varlen-dense.chunk-64" in line and "current" in line for line in lines) == 2
    doc = kd_json(capsys, "cache", "ls", "--cache-dir", copy)
    assert doc["toolchain"] == cache_toolchain.toolchain_fingerprint() and len(doc["entries"]) == 4
    for e in doc["entries"]:
        assert e["toolchain_current"] and e["bytes"] > 10_000 and e["created"] and e["last_used"]
        assert e["config"].startswith("w4-") and e["key"]["template"] == "akk_inverse"
    assert len(kd_json(capsys, "cache", "ls", "--cache-dir", copy, "--arch", "sm_100a")["entries"]) == 2
    assert len(kd_json(capsys, "cache", "ls", "--cache-dir", copy, "--spec", "cu32")["entries"]) == 2


def test_ls_marks_stale_toolchains(copy, capsys):
    old_fp = make_stale(copy)
    doc = kd_json(capsys, "cache", "ls", "--cache-dir", copy)
    assert sorted((e["arch"], e["toolchain_current"]) for e in doc["entries"]) == [
        ("sm_100a", False), ("sm_100a", False), ("sm_90a", True), ("sm_90a", True)]
    assert {e["toolchain"] for e in doc["entries"] if not e["toolchain_current"]} == {old_fp}
    rc, out, _ = kd(capsys, "cache", "ls", "--cache-dir", copy, "--stale")
    assert rc == 0 and out.count(f"stale tc-{old_fp[:8]}") == 2 and "2 entries" in out


def test_show_by_key_and_by_path(copy, capsys):
    doc = kd_json(capsys, "cache", "show", "akk_inverse.varlen-dense.chunk-64@sm_90a", "--cache-dir", copy)
    assert doc["status"] == "ok" and doc["toolchain_current"] and doc["meta"]["key"]["varlen"] == "dense"
    assert doc["toolchain_components"] == cache_toolchain.toolchain_components()
    rc, out, _ = kd(capsys, "cache", "show", doc["path"], "--cache-dir", copy)
    assert rc == 0 and "status:    ok" in out and '"sha256"' in out
    rc, out, _ = kd(capsys, "cache", "show", "akk_inverse.varlen-cu64.chunk-64@sm_90a", "--cache-dir", copy)
    assert rc == 1 and "status:    missing" in out
    rc, _, err = kd(capsys, "cache", "show", "akk_inverse.varlen-dense@sm_90a", "--cache-dir", copy)
    assert rc == 2 and "lacks ['chunk']" in err


def test_why_explains_hits_misses_and_rejections(copy, capsys):
    rc, out, _ = kd(capsys, "cache", "why", "akk_inverse.varlen-dense.chunk-64", "--arch", "sm_90a",
                    "--cache-dir", copy)
    assert rc == 0 and "result:    hit" in out
    doc = kd_json(capsys, "cache", "why", "akk_inverse.varlen-cu64.chunk-64@sm_90a", "--cache-dir", copy, rc=1)
    assert doc["status"] == "miss"
    assert doc["nearest"][0]["differences"] == [{"part": "spec", "field": "varlen", "entry": doc["nearest"][0][
        "differences"][0]["entry"], "now": "cu64"}]
    assert "/sm_90a/" in doc["nearest"][0]["relpath"]
    assert "--key akk_inverse.varlen-cu64.chunk-64.io_dtype-bf16@sm_90a" in doc["fix"]
    (ch.find_entry(copy, "sm_90a", "cu32") / cache_layout.META).write_text("{]")
    rc, out, _ = kd(capsys, "cache", "why", "akk_inverse.varlen-cu32.chunk-64@sm_90a", "--cache-dir", copy)
    assert rc == 1 and "rejected: corrupt" in out and "not valid JSON" in out


def test_why_names_the_toolchain_component_that_changed(copy, capsys):
    make_stale(copy)
    doc = kd_json(capsys, "cache", "why", "akk_inverse.varlen-dense.chunk-64@sm_100a", "--cache-dir", copy, rc=1)
    nearest = doc["nearest"][0]
    assert "/sm_100a/" in nearest["relpath"] and [d["part"] for d in nearest["differences"]] == ["toolchain"]
    changed = nearest["differences"][0]["components"]
    assert changed["kernel_src"] == {"templates/akk_inverse.py": "changed"}
    assert changed["dsl_stack"]["entry"] == ["nvidia-cutlass-dsl==4.0.0"]
    assert changed["dsl_stack"]["now"][0].startswith("nvidia-cutlass-dsl==")
    rc, out, _ = kd(capsys, "cache", "why", "akk_inverse.varlen-dense.chunk-64@sm_100a", "--cache-dir", copy)
    assert "kernel sources templates/akk_inverse.py changed" in out
    assert "dsl stack nvidia-cutlass-dsl==4.0.0 -> nvidia-cutlass-dsl==" in out


# -- verify / prune / clear --------------------------------------------------------------------
def test_verify_reports_and_fixes_bad_entries(copy, capsys):
    assert kd_json(capsys, "cache", "verify", "--cache-dir", copy)["ok"] == 4
    obj = ch.find_entry(copy, "sm_90a", "dense") / cache_layout.ARTIFACT
    obj.write_bytes(obj.read_bytes()[:1000])
    (ch.find_entry(copy, "sm_100a", "cu32") / cache_layout.ARTIFACT).chmod(0o646)
    doc = kd_json(capsys, "cache", "verify", "--cache-dir", copy, rc=1)
    assert (doc["ok"], doc["bad"], doc["fixed"]) == (2, 2, 0)
    assert sorted(e["status"] for e in doc["entries"] if e["status"] != "ok") == ["corrupt", "unsafe"]
    doc = kd_json(capsys, "cache", "verify", "--cache-dir", copy, "--fix")
    assert (doc["bad"], doc["fixed"]) == (2, 2)
    assert len(list((copy / cache_layout.QUARANTINE).iterdir())) == 2
    rc, out, _ = kd(capsys, "cache", "verify", "--cache-dir", copy)
    assert rc == 0 and "2 entries, 2 ok, 0 bad" in out


def test_verify_checks_stale_entries_against_their_own_toolchain(copy, capsys):
    make_stale(copy)
    assert kd_json(capsys, "cache", "verify", "--cache-dir", copy)["ok"] == 4


def test_prune_stale_and_older_than(copy, capsys):
    rc, _, err = kd(capsys, "cache", "prune", "--cache-dir", copy)
    assert rc == 2 and "nothing to prune" in err
    old_fp = make_stale(copy)
    doc = kd_json(capsys, "cache", "prune", "--stale", "--dry-run", "--cache-dir", copy)
    assert [r["reason"] for r in doc["removed"]] == [f"stale toolchain tc-{old_fp} (sm_100a)"]
    assert len(ch.entry_dirs(copy)) == 4
    kd_json(capsys, "cache", "prune", "--stale", "--cache-dir", copy)
    assert [p.relative_to(copy).parts[1] for p in ch.entry_dirs(copy)] == ["sm_90a", "sm_90a"]
    month_ago = time.time() - 40 * 86400
    os.utime(ch.find_entry(copy, "sm_90a", "dense") / cache_layout.META, (month_ago, month_ago))
    doc = kd_json(capsys, "cache", "prune", "--older-than", "30d", "--cache-dir", copy)
    assert len(doc["removed"]) == 1 and "varlen-dense" in doc["removed"][0]["path"]
    assert [p.name.split(".")[1] for p in [e.parent for e in ch.entry_dirs(copy)]] == ["varlen-cu32"]
    assert not (copy / "v1" / "sm_90a" / f"tc-{cache_toolchain.toolchain_fingerprint()}" / "kernels" /
                "akk_inverse.varlen-dense.chunk-64").exists()  # empty parents are removed


def test_prune_max_size_evicts_least_recently_used(copy, capsys):
    entries = ch.entry_dirs(copy)
    now = time.time()
    for age, entry in enumerate(entries):  # entries[0] most recently used, entries[3] least
        os.utime(entry / cache_layout.META, (now - 1000 * age, now - 1000 * age))
    sizes = [sum(f.stat().st_size for f in e.iterdir()) for e in entries]
    doc = kd_json(capsys, "cache", "prune", "--max-size", str(sizes[0] + sizes[1]), "--cache-dir", copy)
    assert sorted(r["path"] for r in doc["removed"]) == sorted(str(e) for e in entries[2:])
    assert ch.entry_dirs(copy) == sorted(entries[:2])


def test_prune_staging_and_quarantine(copy, capsys):
    host = socket.gethostname()[:40]
    staging = copy / cache_layout.STAGING
    dead, alive, foreign = staging / f"{host}.999999999.aa", staging / f"{host}.{os.getpid()}.bb", staging / "h2.7.cc"
    for d in (dead, alive, foreign):
        d.mkdir()
    os.utime(foreign, (time.time() - 7200, time.time() - 7200))
    (copy / cache_layout.QUARANTINE / "x").mkdir(parents=True)
    doc = kd_json(capsys, "cache", "prune", "--staging", "--quarantine", "--cache-dir", copy)
    assert sorted(Path(r["path"]).name for r in doc["removed"]) == sorted([dead.name, foreign.name, "x"])
    assert alive.exists() and not dead.exists() and not foreign.exists() and len(ch.entry_dirs(copy)) == 4


def test_clear_needs_yes_and_honours_filters(copy, capsys):
    rc, _, err = kd(capsys, "cache", "clear", "--cache-dir", copy)
    assert rc == 2 and "--yes" in err and len(ch.entry_dirs(copy)) == 4
    kd_json(capsys, "cache", "clear", "--arch", "sm_100a", "--yes", "--cache-dir", copy)
    assert [p.relative_to(copy).parts[1] for p in ch.entry_dirs(copy)] == ["sm_90a", "sm_90a"]
    kd_json(capsys, "cache", "clear", "--yes", "--cache-dir", copy)
    assert ch.entry_dirs(copy) == [] and sorted(p.name for p in copy.iterdir()) == [cache_layout.CACHEDIR_TAG]


# -- export / import ---------------------------------------------------------------------------
def test_export_then_import_into_an_empty_root(copy, tmp_path, capsys):
    bundle = tmp_path / "kernels.tar.gz"
    doc = kd_json(capsys, "cache", "export", bundle, "--cache-dir", copy)
    assert doc["exported"] == 4 and doc["skipped"] == [] and doc["toolchains"] == [cache_toolchain.toolchain_fingerprint()]
    with tarfile.open(bundle) as tar:
        members = tar.getmembers()
    assert members[0].name == "kdajit-bundle.json" and len(members) == 9
    assert all(not m.name.startswith("/") and ".." not in m.name and m.uid == 0 and m.uname == "" for m in members)

    assert doc["sha256"] == hashlib.sha256(bundle.read_bytes()).hexdigest()
    fresh = tmp_path / "elsewhere" / "cache"
    doc = kd_json(capsys, "cache", "import", bundle, "--sha256", doc["sha256"], "--cache-dir", fresh)
    assert (doc["imported"], doc["present"], doc["failed"], doc["current_toolchain"]) == (4, 0, 0, 4)
    def relpaths(root):
        return sorted(e["relpath"] for e in kd_json(capsys, "cache", "ls", "--cache-dir", root)["entries"])

    assert relpaths(fresh) == relpaths(copy)
    assert kd_json(capsys, "cache", "verify", "--cache-dir", fresh)["ok"] == 4
    for dirpath, _, files in os.walk(fresh / "v1"):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o700
        assert all(stat.S_IMODE(os.stat(Path(dirpath) / f).st_mode) == 0o600 for f in files)
    doc = kd_json(capsys, "cache", "import", bundle, "--trust-unpinned-bundle", "--cache-dir", fresh)  # idempotent
    assert (doc["imported"], doc["present"]) == (0, 4)
    # The imported cache serves a fresh process without compiling.
    report = ch.lookup([ch.GOLDEN_KEYS[0], ch.GOLDEN_KEYS[3]], ch.child_env(fresh, tmp_path / "locks"))
    assert (report["stats"]["compiles"], report["stats"]["disk_hits"]) == (0, 2), report


def test_export_filters_and_world_readable_import(copy, tmp_path, capsys):
    bundle = tmp_path / "b.tar"
    doc = kd_json(capsys, "cache", "export", bundle, "--arch", "sm_100a", "--cache-dir", copy)
    assert doc["exported"] == 2
    fresh = tmp_path / "image-cache"
    kd_json(capsys, "cache", "import", bundle, "--sha256", doc["sha256"], "--world-readable", "--cache-dir", fresh)
    entry = ch.entry_dirs(fresh)[0]
    assert stat.S_IMODE(entry.stat().st_mode) == 0o755
    assert stat.S_IMODE((entry / cache_layout.ARTIFACT).stat().st_mode) == 0o644
    assert kd_json(capsys, "cache", "verify", "--cache-dir", fresh)["ok"] == 2  # readable, still not writable
    rc, out, _ = kd(capsys, "cache", "export", tmp_path / "none.tar", "--spec", "intra", "--cache-dir", copy)
    assert rc == 1 and "nothing to export" in out and not (tmp_path / "none.tar").exists()


def _rewrite_bundle(src: Path, dst: Path, edit) -> None:
    with tarfile.open(src) as tar:
        items = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(dst, "w") as out:
        for m, data in items:
            data = edit(m.name, data)
            m.size = len(data)
            out.addfile(m, io.BytesIO(data))


def test_import_rejects_tampered_bundles(copy, tmp_path, capsys):
    bundle = tmp_path / "b.tar"
    kd_json(capsys, "cache", "export", bundle, "--cache-dir", copy)

    def flip_one_object(name, data):
        if "/sm_90a/" in name and "varlen-dense" in name and name.endswith(cache_layout.ARTIFACT):
            data = bytearray(data)
            data[5000] ^= 1
        return bytes(data)

    _rewrite_bundle(bundle, tmp_path / "flipped.tar", flip_one_object)
    doc = kd_json(capsys, "cache", "import", tmp_path / "flipped.tar", "--trust-unpinned-bundle", "--cache-dir",
                  tmp_path / "r1", rc=1)
    assert (doc["imported"], doc["failed"]) == (3, 1)
    assert [e["error"] for e in doc["entries"] if e["status"] == "failed"] == [
        "ValueError: kernel.o does not match the bundle's sha256"]

    def escape(name, data):
        if name == "kdajit-bundle.json":
            manifest = json.loads(data)
            manifest["entries"][0]["relpath"] = "v1/sm_90a/../../../../tmp/evil"
            data = json.dumps(manifest).encode()
        return data

    _rewrite_bundle(bundle, tmp_path / "escape.tar", escape)
    doc = kd_json(capsys, "cache", "import", tmp_path / "escape.tar", "--trust-unpinned-bundle", "--cache-dir",
                  tmp_path / "r2", rc=1)
    assert doc["failed"] == 1 and "not a cache entry path" in doc["entries"][0]["error"]
    assert not Path("/tmp/evil").exists()


# -- precompile / env / entry points -----------------------------------------------------------
def test_precompile_expands_and_dedups_the_cross_product(tmp_path, capsys):
    def templates(*extra):
        doc = kd_json(capsys, "precompile", "--cache-dir", tmp_path, "--arch", "sm_90a", "--dry-run", *extra)
        assert doc["missing"] == len(doc["keys"])
        return sorted(k["template"] for k in doc["keys"])

    everything = templates()
    # sm_90a: the three standalone templates plus the fused kernel of each specialization: 2 chunk sizes x
    # 2 io dtypes x 3 varlen modes for the inverse; x 3 beta dtypes x 3 head sizes for intra; x 2 QG for the others;
    # intra and the fused kernel once per gate path (safe and any: --gate both, the default), the fused kernel also
    # in its untuned configuration where it is not the reference (chunk 64, K = 64, 128 and 256 without QG).
    inverse, intra = 2 * 2 * 3, 2 * 2 * 3 * 3 * 3
    untuned = intra // 2
    assert [everything.count(t) for t in ("akk_inverse", "intra", "recompute_wu", "fused_forward")] == [
        inverse, 2 * intra, 2 * intra, 2 * (2 * intra + untuned)]
    assert len(templates("--qg", "off")) == inverse + 5 * intra + 2 * untuned
    assert len(templates("--qg", "off", "--config", "ref", "--gate", "safe")) == inverse + 3 * intra
    one_spec = ("--beta", "bf16", "--varlen", "dense", "--qg", "on", "--kv", "128x128", "--io", "bf16", "--chunk", "64")
    assert templates(*one_spec, "--gate", "safe") == ["akk_inverse", "fused_forward", "intra", "recompute_wu"]
    assert templates(*one_spec, "--gate", "any") == ["akk_inverse", "fused_forward", "intra", "recompute_wu"]
    assert len(templates(*one_spec)) == 6
    # K != V: the kernels that read v are new; intra (K only) and the inverse are those of K = V = 64
    unequal = ("--beta", "bf16", "--varlen", "dense", "--qg", "on", "--io", "bf16", "--gate", "safe", "--chunk", "32")
    assert templates(*unequal, "--kv", "64x256") == ["akk_inverse", "fused_forward", "intra", "recompute_wu"]
    assert templates(*unequal, "--kv", "64,64x256") == ["akk_inverse", "fused_forward", "fused_forward", "intra",
                                                        "recompute_wu", "recompute_wu"]
    assert len(templates("--arch", "sm_100a", "--only", "akk_inverse,intra")) == 2 * (inverse + 2 * intra)
    rc, _, err = kd(capsys, "precompile", "--cache-dir", tmp_path, "--arch", "sm_75", "--dry-run")
    assert rc == 2 and "arch='sm_75' is not supported" in err


def test_precompile_key_refuses_the_cross_product_options(tmp_path, capsys):
    for option in (["--io", "fp16"], ["--kv", "64"], ["--beta", "fp16"]):
        rc, _, err = kd(capsys, "precompile", "--cache-dir", tmp_path, "--dry-run", "--key",
                        "akk_inverse.varlen-dense.chunk-64@sm_90a", *option)
        assert rc == 2 and f"drop {option[0]}" in err, err


def test_precompile_is_idempotent(copy, capsys):
    doc = kd_json(capsys, "precompile", "--cache-dir", copy, *ch.GOLDEN_ARGS, "--no-progress")
    assert (doc["compiled"], doc["present"], doc["failed"]) == (0, 4, 0)


def test_unsupported_config_fails_at_argument_checking(tmp_path, capsys):
    for extra in ([], ["--dry-run"]):
        rc, out, err = kd(capsys, "precompile", "--cache-dir", tmp_path / "c", "--arch", "sm_90a", "--only",
                          "akk_inverse", "--varlen", "dense", "--config", "warps=3", *extra)
        assert (rc, out) == (2, ""), out + err
        assert "cannot implement config warps=3" in err and "Traceback" not in err
    assert not (tmp_path / "c").exists()


def test_tune_refuses_unsupported_head_dims_before_any_gpu_work(tmp_path, capsys):
    for kv, words in (("98", "K=98 is not supported; expected an int, a multiple of 4"), ("260", "K=260"), ("128x82", "V=82"),
                      ("12y8", "is not a head dim")):
        rc, out, err = kd(capsys, "tune", "--cache-dir", tmp_path, "--shape", "1x64x1", "--kv", kv)
        assert rc == 2 and words in err and "Traceback" not in err, out + err


def test_zero_jobs_is_refused(tmp_path):
    proc = ch.kdajit_cli(["precompile", "--cache-dir", str(tmp_path), "-j", "0", "--dry-run"], ch.child_env(None))
    assert proc.returncode == 2 and "'0' is not a number of worker processes" in proc.stderr


def test_env_report(copy, capsys):
    doc = kd_json(capsys, "env", "--cache-dir", copy)
    assert doc["toolchain"]["fingerprint"] == cache_toolchain.toolchain_fingerprint()
    assert doc["cache"]["root"]["path"] == str(copy) and doc["cache"]["root"]["writable"]
    assert doc["locks"]["path"] and doc["arch"] in ("sm_80", "sm_90a", "sm_100a")
    assert doc["loader"]["mode"] == "auto" and "linked_unavailable" in doc["loader"]
    assert doc["loader"]["linked"] is (doc["loader"]["linked_unavailable"] is None)
    rc, out, _ = kd(capsys, "env", "--cache-dir", copy)
    assert rc == 0 and f"toolchain:    tc-{cache_toolchain.toolchain_fingerprint()}" in out and "nvidia-cutlass-dsl==" in out
    assert "loader:       auto: cached kernels load " in out


def test_python_dash_m_kdajit(copy, tmp_path):
    env = ch.child_env(copy, tmp_path / "locks")
    proc = ch.kdajit_cli(["cache", "ls", "--json"], env)
    assert proc.returncode == 0 and len(json.loads(proc.stdout)["entries"]) == 4
    proc = ch.kdajit_cli(["--help"], env)
    assert proc.returncode == 0 and all(v in proc.stdout for v in ("precompile", "cache", "env", "demo"))
    assert ch.kdajit_cli(["cache", "frobnicate"], env).returncode == 2


# -- first-run and error messages (issue 7, item 7) --------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_fits_80_columns_and_redraws_in_place_only_on_a_terminal():
    from kdajit.cache_tools import precompile
    from kdajit.keys import ForwardSpec

    keys = ForwardSpec("fp32", "cu64", 128, 128, 64, True, "sm_100a").kernel_keys()
    results = [{"status": "compiled"}, {"status": "present"}, {"status": "failed", "error": "boom"}]
    tty = _Terminal()
    bar = precompile.Progress(len(keys), True, tty)
    bar.start(2, 2)
    started = tty.getvalue()
    for key, r in zip(keys, results, strict=True):
        bar.update(key, r)
    assert started.startswith("precompile: 3 kernels, 1 present; compiling 2 with 2 worker(s)")
    redraws = tty.getvalue()[len(started):]
    frames = [f for f in redraws.split("\r") if f]
    assert len(frames) == 3 and all(len(line) <= 79 for f in frames for line in f.split("\n"))
    assert redraws.endswith("\n") and "3/3" in frames[-1] and "failed: boom" in redraws
    plain = io.StringIO()
    bar = precompile.Progress(len(keys), True, plain)
    for key, r in zip(keys, results, strict=True):
        bar.update(key, r)
    lines = plain.getvalue().splitlines()
    assert "\r" not in plain.getvalue() and [line.split()[:2] for line in lines if not line.startswith("  ")] == [
        ["1/3", "compiled"], ["2/3", "present"], ["3/3", "failed"]]


def test_precompile_prints_before_the_workers_start(tmp_path, capsys, monkeypatch):
    from kdajit.cache_tools import precompile
    from kdajit.keys import AkkInverseKey

    seen = []
    monkeypatch.setattr(precompile, "_run_pool", lambda *a: seen.append(capsys.readouterr().err))
    precompile.precompile([AkkInverseKey("dense", 64, "sm_90a")], tmp_path / "c", 1)
    assert seen and "compiling 1 with 1 worker(s)" in seen[0]


def test_cache_dir_that_is_a_file_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for argv in (["cache", "ls"], ["precompile", "--only", "akk_inverse", "--dry-run"]):
        rc, _, err = kd(capsys, *argv, "--cache-dir", blocker)
        assert rc == 2 and f"{blocker} is a file, not a directory" in err


def test_missing_roots_are_reported_not_listed_as_empty(tmp_path, capsys):
    for verb in ("ls", "verify"):
        rc, out, err = kd(capsys, "cache", verb, "--cache-dir", tmp_path / "typo")
        assert rc == 2 and "does not exist" in err and "0 entries" not in out


def test_why_an_unsupported_key_prints_no_failing_fix(copy, capsys):
    rc, out, _ = kd(capsys, "cache", "why", "akk_inverse.varlen-dense.chunk-128@sm_90a", "--cache-dir", copy)
    assert rc == 1 and "unsupported: akk_inverse: chunk=128 is not supported" in out and "fix:" not in out
    doc = kd_json(capsys, "cache", "why", "akk_inverse.varlen-dense.chunk-64@sm_90a", "--config", "warps=3",
                  "--cache-dir", copy, rc=1)
    assert doc["status"] == "unsupported" and "fix" not in doc


def test_export_to_a_missing_folder_names_it(copy, tmp_path, capsys):
    rc, _, err = kd(capsys, "cache", "export", tmp_path / "no" / "b.tar", "--cache-dir", copy)
    assert rc == 2 and f"the folder {tmp_path / 'no'} does not exist" in err


def test_import_into_a_read_only_place_is_one_clear_error(copy, tmp_path, capsys):
    bundle = tmp_path / "b.tar"
    kd(capsys, "cache", "export", bundle, "--cache-dir", copy)
    ro = tmp_path / "ro"
    ro.mkdir()
    wrapper = ch.read_only_wrapper(ro)
    if wrapper is None:
        pytest.skip("running as root without mount privileges: cannot make a read-only directory")
    if not wrapper:
        ro.chmod(0o555)
    proc = subprocess.run(wrapper + [ch.PY, "-m", "kdajit", "cache", "import", str(bundle), "--trust-unpinned-bundle",
                                     "--cache-dir", str(ro / "cache")],
                          env=ch.child_env(None), capture_output=True, text=True, timeout=120, cwd="/")
    ro.chmod(0o700)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout
    assert proc.stderr.count("error") == 1 and f"cannot import into {ro / 'cache'}" in proc.stderr, proc.stderr
    assert "toolchain" not in proc.stderr


def test_help_documents_arch_and_the_key_format(capsys):
    for argv, words in ((["cache", "ls", "--help"], "SM archs"), (["cache", "verify", "--help"], "SM archs"),
                        (["cache", "show", "--help"], "@arch"), (["cache", "why", "--help"], "@arch"),
                        (["cache", "import", "--help"], "WILL RUN")):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert words in capsys.readouterr().out, argv
