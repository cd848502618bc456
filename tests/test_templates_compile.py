"""Compile-only tier: every template specialization cross-compiles for sm_90a without a GPU.

Each case traces and compiles the real kernel (1-3 s each on 2 cores), so a template that stops compiling,
or that stops accepting a key it is meant to implement, fails here before it reaches a GPU. sm_80 and
sm_100a (the portable path of these first kernels) are covered by one specialization per template.
"""
import dataclasses
import os

import pytest

from kdajit import compiler
from kdajit.keys import BETA_DTYPES, VARLEN_MODES, ForwardSpec, KernelConfig

SPECS = [ForwardSpec(beta, varlen, 128, 128, 64, qg, "sm_90a")
         for beta in BETA_DTYPES for varlen in VARLEN_MODES for qg in (False, True)]
KEYS = sorted({key for spec in SPECS for key in spec.kernel_keys()}, key=lambda k: k.canonical())
OTHER_ARCH_KEYS = [dataclasses.replace(key, arch=arch) for arch in ("sm_80", "sm_100a")
                   for key in ForwardSpec("fp32", "cu64", 128, 128, 64, True, arch).kernel_keys()]


def test_key_set_is_complete():
    # 2 beta x 3 varlen intra, 3 varlen inverse, 2 beta x 3 varlen x 2 qg recompute.
    assert len(KEYS) == 6 + 3 + 12


@pytest.mark.parametrize("key", KEYS + OTHER_ARCH_KEYS, ids=lambda k: f"{k.arch}-{k.spec_slug()}")
def test_template_compiles(key):
    compiled = compiler.compile_key(key)
    assert compiled.kdajit_compile_s > 0
    assert callable(compiler.callable_of(compiled)) or key.arch != "sm_90a"


@pytest.mark.parametrize("template", ["intra", "akk_inverse", "recompute_wu"])
def test_templates_refuse_configs_they_do_not_implement(template):
    key = next(k for k in SPECS[0].kernel_keys() if k.TEMPLATE == template)
    assert compiler.template_class(key).can_implement(key)
    bad = dataclasses.replace(key, config=KernelConfig(warps=8))
    assert not compiler.template_class(bad).can_implement(bad)
    with pytest.raises(ValueError, match="cannot implement"):
        compiler.compile_key(bad)


def test_object_round_trip(tmp_path):
    key = ForwardSpec("bf16", "dense", 128, 128, 64, True, "sm_90a").recompute_key()
    path = os.fspath(tmp_path / "kernel.o")
    compiler.export_object(compiler.compile_key(key), path)
    assert os.path.getsize(path) > 10_000
    fn = compiler.load_object(path)
    assert callable(fn)
