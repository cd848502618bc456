"""The linked loader on the CPU (KDAJIT_LOADER=linked, and the default `auto` where a C compiler is found): cached
objects link into shared libraries that TVM-FFI loads without the CuTe DSL, each library binds its own symbols, a
failed link falls back to the DSL's loader once, and `auto` without a C compiler uses the DSL's loader silently.

(Running linked kernels needs a GPU: tests/test_gpu_cache.py compares their bits with the DSL-loaded ones.)
"""
import os
import shutil
import subprocess

import cache_helpers as ch
import pytest

from kdajit import compiler, linked_loader

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="needs a C compiler")


@needs_cc
@pytest.mark.parametrize("mode", ["linked", "default"])
def test_linked_loader_loads_cached_kernels_without_importing_the_dsl(copy, mode):
    extra = {"KDAJIT_LOADER": mode} if mode != "default" else {}  # the default is auto: linked, a compiler is here
    linked = ch.lookup(ch.GOLDEN_KEYS, ch.child_env(copy, **extra))
    assert all(r["ok"] and r["type"] == "Function" for r in linked["results"]), linked
    assert (linked["stats"]["disk_hits"], linked["stats"]["compiles"]) == (len(ch.GOLDEN_KEYS), 0), linked
    assert linked["cutlass_imported"] is False, linked
    assert not linked["warnings"], linked["warnings"]


def test_a_failed_link_falls_back_to_the_dsl_loader_once(copy, tmp_path):
    calls = tmp_path / "cc-calls"
    failing_cc = tmp_path / "cc"
    failing_cc.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit 1\n')
    failing_cc.chmod(0o755)
    report = ch.lookup(ch.GOLDEN_KEYS[:2], ch.child_env(copy, KDAJIT_LOADER="linked", CC=str(failing_cc)))
    assert all(r["ok"] for r in report["results"]), report
    assert report["stats"]["quarantined"] == 0 and report["cutlass_imported"] is True, report
    assert sum("could not load a cached kernel" in w for w in report["warnings"]) == 1, report["warnings"]
    assert len(calls.read_text().splitlines()) == 1, "the failed link was retried for the second kernel"


def test_auto_without_a_c_compiler_uses_the_dsl_loader_silently(copy, tmp_path):
    report = ch.lookup(ch.GOLDEN_KEYS[:2], ch.child_env(copy, CC=str(tmp_path / "no-such-cc")))
    assert all(r["ok"] for r in report["results"]), report
    assert report["stats"]["disk_hits"] == 2 and report["stats"]["quarantined"] == 0, report
    assert report["cutlass_imported"] is True and not report["warnings"], report


def test_a_bad_loader_value_is_a_clear_error_and_no_entry_is_quarantined(copy):
    code = ("from kdajit import cache; from kdajit.keys import key_from_json; "
            f"cache.get_kernel(key_from_json({ch.GOLDEN_KEYS[0]!r}))")
    proc = subprocess.run([ch.PY, "-c", code], env=ch.child_env(copy, KDAJIT_LOADER="magic"), capture_output=True,
                          text=True, timeout=300, cwd="/")
    assert proc.returncode != 0
    assert "KDAJIT_LOADER='magic' is not valid; expected one of ('auto', 'dsl', 'linked')" in proc.stderr
    assert not (copy / "quarantine").exists() or not any((copy / "quarantine").iterdir())


@needs_cc
@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs binutils' readelf")
def test_each_linked_library_binds_the_symbols_every_kdajit_object_shares(golden, tmp_path):
    # Every object defines __cute_internal_kdajit_kernel_cuda_init and friends; without -Bsymbolic a
    # library's calls to them go through dynamic relocations that another loaded kernel could satisfy.
    obj = next(golden[0].rglob("kernel.o"))
    so = tmp_path / "kernel.so"
    linked_loader.link_shared(str(obj), str(so))

    def names(*args: str) -> set[str]:
        out = subprocess.run(["readelf", "-W", *args, str(so)], capture_output=True, text=True, check=True).stdout
        return {word for line in out.splitlines() for word in line.split() if "kdajit_kernel" in word}

    defined = names("--dyn-syms")
    assert any(n.startswith("__cute_internal_kdajit_kernel_cuda_init") for n in defined), defined
    assert not names("-r") & defined, "the library's own symbols are bound at load time (no -Bsymbolic?)"


def test_kdajit_env_says_whether_the_linked_loader_would_work(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert linked_loader.unavailable_reason() == "no C compiler '/nonexistent/cc' on PATH (set CC)"
    monkeypatch.delenv("CC")
    if shutil.which("cc"):  # this machine: a compiler and the one runtime of the installed DSL package
        assert linked_loader.unavailable_reason() is None


def test_the_loader_is_not_part_of_the_toolchain_fingerprint():
    # How objects are opened never changes their code: editing the loader must not turn caches into misses.
    hashed = {os.path.basename(f) for f in compiler.template_files()}
    assert "linked_loader.py" not in hashed and "compiler.py" in hashed
