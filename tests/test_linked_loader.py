"""KDAJIT_LOADER=linked on the CPU: cached objects link into shared libraries that TVM-FFI loads without
the CuTe DSL, each library binds its own symbols, and a failed link falls back to the DSL's loader.

(Running linked kernels needs a GPU: tests/test_gpu_cache.py compares their bits with the DSL-loaded ones.)
"""
import shutil
import subprocess

import cache_helpers as ch
import pytest

from kdajit import compiler


def test_linked_loader_loads_cached_kernels_without_importing_the_dsl(copy):
    linked = ch.lookup(ch.GOLDEN_KEYS, ch.child_env(copy, KDAJIT_LOADER="linked"))
    assert all(r["ok"] and r["type"] == "Function" for r in linked["results"]), linked
    assert (linked["stats"]["disk_hits"], linked["stats"]["compiles"]) == (len(ch.GOLDEN_KEYS), 0), linked
    assert linked["cutlass_imported"] is False, linked
    assert not linked["warnings"], linked["warnings"]


def test_a_failed_link_falls_back_to_the_dsl_loader_with_a_warning(copy):
    report = ch.lookup(ch.GOLDEN_KEYS[:2], ch.child_env(copy, KDAJIT_LOADER="linked", CC="/nonexistent/cc"))
    assert all(r["ok"] for r in report["results"]), report
    assert report["cutlass_imported"] is True
    assert sum("could not link" in w for w in report["warnings"]) == 1, report["warnings"]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="needs binutils' readelf")
def test_each_linked_library_binds_the_symbols_every_kdajit_object_shares(golden, tmp_path):
    # Every object defines __cute_internal_kdajit_kernel_cuda_init and friends; without -Bsymbolic a
    # library's calls to them go through dynamic relocations that another loaded kernel could satisfy.
    obj = next(golden[0].rglob("kernel.o"))
    so = tmp_path / "kernel.so"
    compiler.link_shared(str(obj), str(so))

    def names(*args: str) -> set[str]:
        out = subprocess.run(["readelf", "-W", *args, str(so)], capture_output=True, text=True, check=True).stdout
        return {word for line in out.splitlines() for word in line.split() if "kdajit_kernel" in word}

    defined = names("--dyn-syms")
    assert any(n.startswith("__cute_internal_kdajit_kernel_cuda_init") for n in defined), defined
    assert not names("-r") & defined, "the library's own symbols are bound at load time (no -Bsymbolic?)"


def test_an_unknown_loader_is_a_clear_error(monkeypatch):
    from kdajit import env

    monkeypatch.setenv("KDAJIT_LOADER", "magic")
    with pytest.raises(ValueError, match=r"KDAJIT_LOADER='magic' is not valid; expected one of \('dsl', 'linked'\)"):
        env.object_loader()
