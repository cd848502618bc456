"""Compile keys: every field matters, runtime shapes are never part of one, and invalid specs are refused."""
import ast
import dataclasses
import os
import pathlib

import pytest

from kdajit import compiler, keys, untuned_configs
from kdajit.keys import (BETA_DTYPES, AkkInverseKey, ForwardSpec, FusedConfig, FusedForwardKey, IntraKey, KernelConfig,
                         RecomputeWUKey, key_from_json)
from kdajit.outputs import BETA_TORCH_DTYPES

SPEC = ForwardSpec("bf16", "cu32", 128, 128, 64, False, "sm_90a")
# Another legal value for every field, used to check that each one reaches the key.
OTHER = {"beta_dtype": "fp32", "varlen": "dense", "head_k": 64, "head_v": 64, "chunk": 32, "output_qg": True,
         "arch": "sm_100a", "config": KernelConfig(warps=8), "io_dtype": "fp16", "safe_gate": False}


@pytest.mark.parametrize("key", SPEC.kernel_keys(), ids=lambda k: k.TEMPLATE)
def test_every_field_changes_the_key(key):
    seen = {key.canonical()}
    slugs = {(key.spec_slug(), key.arch, key.config.slug())}
    for field in dataclasses.fields(key):
        other = OTHER[field.name]
        if field.name == "config" and isinstance(key, FusedForwardKey):
            other = FusedConfig(persistent=True)
        changed = dataclasses.replace(key, **{field.name: other})
        assert changed != key
        assert changed.canonical() not in seen, field.name
        seen.add(changed.canonical())
        slug = (changed.spec_slug(), changed.arch, changed.config.slug())
        assert slug not in slugs, f"{field.name} does not show in the slug/arch/config path parts"
        slugs.add(slug)


def test_any_gate_spec_reaches_the_intra_and_fused_keys_only():
    """The gate path changes the intra products only: the inverse and recompute kernels are shared."""
    any_gate = dataclasses.replace(SPEC, safe_gate=False)
    assert not any_gate.intra_key().safe_gate and not any_gate.fused_key().safe_gate
    assert any_gate.intra_key() != SPEC.intra_key() and any_gate.fused_key() != SPEC.fused_key()
    assert any_gate.inverse_key() == SPEC.inverse_key() and any_gate.recompute_key() == SPEC.recompute_key()
    with pytest.raises(ValueError, match="safe_gate=None"):
        dataclasses.replace(SPEC, safe_gate=None)


@pytest.mark.parametrize("key", SPEC.kernel_keys(), ids=lambda k: k.TEMPLATE)
def test_json_round_trip(key):
    assert key_from_json(key.to_json()) == key
    assert key_from_json(dict(key.to_json())).canonical() == key.canonical()


def test_no_runtime_shapes_in_keys():
    runtime = {"batch", "b", "tokens", "t", "seq_len", "heads", "h", "n_seqs", "n", "scale"}
    for cls in (IntraKey, AkkInverseKey, RecomputeWUKey, FusedForwardKey):
        names = {f.name.lower() for f in dataclasses.fields(cls)}
        assert not names & runtime, cls


def test_kernel_keys_only_hold_what_the_kernel_depends_on():
    intra, inverse, recompute, fused, fused_untuned = SPEC.kernel_keys()
    assert isinstance(fused, FusedForwardKey) and fused_untuned == SPEC.fused_key(SPEC.untuned_fused_config)
    assert fused.config != fused_untuned.config
    assert not dataclasses.replace(SPEC, arch="sm_80").uses_fused
    other_beta = dataclasses.replace(SPEC, beta_dtype="fp32").kernel_keys()
    assert other_beta[1] == inverse  # the inverse does not read beta
    assert other_beta[0] != intra and other_beta[2] != recompute
    with_qg = dataclasses.replace(SPEC, output_qg=True).kernel_keys()
    assert with_qg[0] == intra and with_qg[1] == inverse and with_qg[2] != recompute


@pytest.mark.parametrize("field,value,words", [
    ("beta_dtype", "fp64", ["beta_dtype", "fp64", "bf16", "fp16", "fp32"]),
    ("io_dtype", "fp32", ["io_dtype", "fp32", "bf16", "fp16"]),
    ("head_v", 98, ["head_v", "98", "multiple of 4", "256"]),
    ("head_v", 0, ["head_v", "0"]),
    ("head_k", 260, ["head_k", "260"]),
    ("head_k", 64.0, ["head_k", "64.0"]),
    ("varlen", "cu16", ["varlen", "cu16"]),
    ("head_k", 98, ["head_k", "98"]),
    ("chunk", 48, ["chunk_size", "48"]),
    ("arch", "sm_90", ["arch", "sm_90", "sm_90a"]),
    ("output_qg", 1, ["output_qg", "bool"]),
])
def test_invalid_spec_is_refused(field, value, words):
    with pytest.raises(ValueError) as info:
        dataclasses.replace(SPEC, **{field: value})
    for w in words:
        assert w in str(info.value)


def test_unknown_template_is_refused():
    with pytest.raises(ValueError, match="template='gemm' is not a kdajit kernel"):
        key_from_json({"template": "gemm"})


def test_one_beta_dtype_vocabulary():
    # The torch-side map names exactly the beta dtypes the keys accept, distinct dtypes for distinct names.
    assert tuple(BETA_TORCH_DTYPES) == BETA_DTYPES
    assert len(set(BETA_TORCH_DTYPES.values())) == len(BETA_DTYPES)


def test_head_dim_rule_and_padding():
    """Every multiple of 4 up to 256 is a head size; each runs the tile of the next HEAD_DIMS size, itself for those."""
    supported = [d for d in range(-4, 300) if keys.head_dim_supported(d)]
    assert supported == list(range(4, 257, 4))
    assert not any(keys.head_dim_supported(d) for d in (True, 64.0, "64", None))
    padded = {d: keys.padded_head_dim(d) for d in supported}
    assert {d: padded[d] for d in keys.HEAD_DIMS} == {d: d for d in keys.HEAD_DIMS}
    assert (padded[4], padded[60], padded[68], padded[100], padded[252]) == (64, 64, 128, 128, 256)
    assert all(d <= p and p in keys.HEAD_DIMS for d, p in padded.items())


def test_untuned_defaults_live_outside_the_fingerprint_and_are_declared_members(monkeypatch):
    # A default changes no kernel's code: a new one must not turn every cached kernel into a miss, so the tables live
    # outside the hashed sources, in a module that imports nothing, and a spec reads them there on first use.
    hashed = {os.path.basename(f) for f in compiler.template_files()}
    assert "keys.py" in hashed and "untuned_configs.py" not in hashed
    tree = ast.parse(pathlib.Path(untuned_configs.__file__).read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    tables = (untuned_configs.FUSED, untuned_configs.SQUARE, untuned_configs.SQUARE_PADDED)
    assert all(f is None or FusedConfig(**f) in keys.FUSED_CONFIG_SPACE for t in tables for f in t.values())
    early = FusedConfig(True, 2, "head", 1, gate_rows="early")
    before = dataclasses.replace(SPEC, head_k=100, head_v=100).untuned_fused_config
    monkeypatch.setitem(untuned_configs.SQUARE, (64, 128, False), dataclasses.asdict(early))
    spec, padded = dataclasses.replace(SPEC), dataclasses.replace(SPEC, head_k=100, head_v=100)  # new: nothing cached
    assert spec.untuned_fused_config == early and spec.fused_key(early) in spec.kernel_keys()
    assert padded.untuned_fused_config == before  # a padded size has its own entry (it loads by cp.async)
