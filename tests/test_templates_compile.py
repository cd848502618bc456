"""Compile-only tier: every template specialization cross-compiles, for every arch, without a GPU.

Each case traces and compiles the real kernel (2-6 s each on 2 cores), exports it as the cache would,
and checks the object: an ELF file whose embedded cubins are all for the key's arch, and that loads
into a callable through its exported symbol. A template that stops compiling, that ignores the
key's arch, or that stops accepting a key it is meant to implement fails here before it reaches a GPU.

The sweep is every ForwardSpec of kdajit.keys' value lists on every arch (K != V in bf16 with the safe gate),
plus the fused kernel in every configuration of `kdajit.keys.FUSED_CONFIG_SPACE`. By default only its fast tier runs (each template's
reference key plus a sample covering every field value, config fields included; tests/tiers.py);
`python -m pytest -q --full` compiles all of it (run it before submitting kernel changes).
"""
import dataclasses
import itertools
import os
import re

import pytest
import tiers

from kdajit import compiler, cubins, keys
from kdajit.keys import ForwardSpec, FusedConfig, KernelConfig

SPECS = [ForwardSpec(beta, varlen, d, d, chunk, qg, arch, io, safe_gate)
         for beta, varlen, d, chunk, qg, arch, io, safe_gate in itertools.product(
             keys.BETA_DTYPES, keys.VARLEN_MODES, keys.HEAD_DIMS + keys.PADDED_HEAD_DIM_EXAMPLES, keys.CHUNK_SIZES,
             (False, True), keys.ARCHS,
             keys.IO_DTYPES, (True, False))]
# K != V: only the kernels that read v (recompute, fused) see V, so every pair in one io dtype and gate path.
UNEQUAL_HEADS = [ForwardSpec(beta, varlen, head_k, head_v, chunk, qg, arch)
                 for beta, varlen, (head_k, head_v), chunk, qg, arch in itertools.product(
                     keys.BETA_DTYPES, keys.VARLEN_MODES, [*itertools.permutations(keys.HEAD_DIMS, 2),
                                                           *itertools.permutations(keys.PADDED_HEAD_DIM_EXAMPLES),
                                                           (100, 128), (64, 60), (4, 252)],
                     keys.CHUNK_SIZES, (False, True), keys.ARCHS)]
SPECS += UNEQUAL_HEADS
# A padded size whose rows are 16-byte multiples (96: a 128-column tile), which the fused kernel's bulk row loads
# (one copy per whole, unpadded row) must leave to cp.async.
PADDED_BY_EIGHT = ForwardSpec("bf16", "dense", 96, 96, 64, False, "sm_90a")
SPECS.append(PADDED_BY_EIGHT)
# Every kernel `forward`/`intra`/`recompute_w_u` run, plus the fused kernel in every configuration of its space that
# fits the specialization (two persistent CTAs per SM do not fit K = 256, for one: `can_implement` refuses those, and
# `test_fused_refuses_configs_that_do_not_fit` checks that).
KEYS = sorted({key for spec in SPECS for key in spec.kernel_keys()}
              | {key for spec in SPECS if spec.uses_fused for key in map(spec.fused_key, keys.FUSED_CONFIG_SPACE)
                 if compiler.template_class(key).can_implement(key)},
              key=lambda k: (k.arch != "sm_90a", k.canonical()))
# Each template's reference configuration: the reference spec (the demo's) on the reference arch.
REFERENCE = ForwardSpec("bf16", "cu32", 128, 128, 64, True, "sm_90a").kernel_keys()
# The fast tier covers field values one at a time, so it would never pick K != V: four pairs join it (the smaller
# head first and last; the third of two padded sizes, the fourth of the smallest and largest padded sizes, 4 and
# 252), the 8-warp fused configuration (which splits W and U across its groups), and the 8-warp fused kernel at
# PADDED_BY_EIGHT.
FAST_UNEQUAL = (ForwardSpec("fp32", "dense", 64, 256, 64, True, "sm_90a").kernel_keys()
                + ForwardSpec("bf16", "cu32", 60, 100, 64, False, "sm_90a").kernel_keys()
                + ForwardSpec("bf16", "dense", 4, 252, 64, True, "sm_90a").kernel_keys()
                + (ForwardSpec("bf16", "cu64", 256, 128, 64, False, "sm_90a").fused_key(FusedConfig(warps=8)),
                   PADDED_BY_EIGHT.fused_key(FusedConfig(warps=8))))

def cubin_archs(obj: bytes) -> list[str]:
    """The SM arch of every cubin embedded in a host object, from the cubin ELF headers."""
    return [cubins.cubin_arch(c) for c in cubins.embedded_cubins(obj)]


def test_sweep_covers_every_template_and_arch():
    assert {k.TEMPLATE for k in KEYS} == set(keys.KEY_TYPES)
    assert {k.arch for k in KEYS} == set(keys.ARCHS)
    # The fast tier compiles every value of every field of every template at least once.
    fast = tiers.fast_tier(KEYS, REFERENCE)
    assert set(REFERENCE) <= set(fast) and len(fast) < len(KEYS)
    leaves = lambda ks: set().union(*(tiers.field_values(k) for k in ks))  # (template, field, value)
    assert leaves(fast) == leaves(KEYS)
    assert {k.config for k in KEYS if k.TEMPLATE == "fused_forward"} == set(keys.FUSED_CONFIG_SPACE)


@pytest.mark.parametrize("key", tiers.tiered(KEYS, REFERENCE + FAST_UNEQUAL,
                                             ids=lambda k: f"{k.arch}-{k.spec_slug()}-{k.config.slug()}"))
def test_template_compiles(key, tmp_path):
    path = os.fspath(tmp_path / "kernel.o")
    compiler.export_object(compiler.compile_key(key), path)
    with open(path, "rb") as f:
        obj = f.read()
    assert obj[:4] == b"\x7fELF" and len(obj) > 10_000, f"{len(obj)} bytes"
    archs = cubin_archs(obj)
    assert archs and set(archs) == {key.arch}, f"cubins for {archs}, key arch {key.arch}"
    assert callable(compiler.load_object(path))


# A configuration each template's can_implement must refuse (3 fused CTAs of ~115 KB overflow 228 KB at chunk 64).
UNBUILDABLE_CONFIG = {"intra": KernelConfig(warps=8), "akk_inverse": KernelConfig(warps=8),
                      "recompute_wu": KernelConfig(warps=8), "fused_forward": FusedConfig(True, 3, "chunk")}


@pytest.mark.parametrize("template", sorted(keys.KEY_TYPES))
def test_templates_refuse_configs_they_do_not_implement(template):
    key = next(k for k in KEYS if k.TEMPLATE == template and k.chunk == 64
               and getattr(k, "head_k", 128) == getattr(k, "head_v", 128) == 128)
    assert compiler.template_class(key).can_implement(key)
    bad = dataclasses.replace(key, config=UNBUILDABLE_CONFIG[template])
    assert not compiler.template_class(bad).can_implement(bad)
    with pytest.raises(ValueError, match="cannot implement"):
        compiler.compile_key(bad)


def test_fused_refuses_configs_that_do_not_fit():
    spec = ForwardSpec("bf16", "cu32", 128, 128, 64, False, "sm_90a")
    cls = compiler.template_class(spec.fused_key())
    assert not cls.can_implement(spec.fused_key(FusedConfig(False, 1, "chunk")))  # not persistent: defaults
    assert not cls.can_implement(spec.fused_key(FusedConfig(False, loads_ahead=1)))  # no next tile to load
    assert not cls.can_implement(spec.fused_key(FusedConfig(True, 2, "chunk", 2)))  # loads_ahead is 0 or 1
    for gate_rows in ("early", "early-vbuf"):
        early = FusedConfig(True, 2, "head", 1, gate_rows=gate_rows)
        assert cls.can_implement(spec.fused_key(early))
        assert not cls.can_implement(dataclasses.replace(spec, output_qg=True).fused_key(early))  # QG's rows read q
        assert not cls.can_implement(spec.fused_key(dataclasses.replace(early, loads_ahead=0)))  # nothing to move
    # Kp and Vp trade tiles only where they have one layout
    k_ne_v = dataclasses.replace(spec, head_v=64)
    assert cls.can_implement(k_ne_v.fused_key(dataclasses.replace(early, gate_rows="early")))
    assert not cls.can_implement(k_ne_v.fused_key(early))
    assert not cls.can_implement(spec.fused_key(dataclasses.replace(early, gate_rows="first")))
    rolled = FusedConfig(True, 2, "head", 1, intra_unroll=1)  # the intra mainloop one head-dim step per iteration
    assert cls.can_implement(spec.fused_key(rolled))
    assert not cls.can_implement(spec.fused_key(dataclasses.replace(rolled, intra_unroll=4)))  # 2 or 1
    assert not cls.can_implement(spec.fused_key(FusedConfig(intra_unroll=1)))  # one tile per CTA: the defaults
    assert not cls.can_implement(spec.fused_key(FusedConfig(True, 2, "head", 0, 8, intra_unroll=1)))  # 8 warps: 1
    assert not cls.can_implement(dataclasses.replace(spec.fused_key(), arch="sm_80"))
    largest = ForwardSpec("bf16", "cu32", 256, 256, 64, False, "sm_90a")  # 208,896 B: one CTA per SM
    assert not cls.can_implement(largest.fused_key(FusedConfig(True, 2, "head", 1)))
    assert cls.can_implement(largest.fused_key(FusedConfig(True, 1, "head", 1)))


def test_tma_stores_only_where_a_warp_stores_whole_panels():
    spec = ForwardSpec("bf16", "cu32", 128, 128, 64, False, "sm_90a")
    cls = compiler.template_class(spec.fused_key())
    tma = FusedConfig(True, 2, "head", 1, stores="tma")
    threads = dataclasses.replace(tma, stores="threads")
    for other in (spec, dataclasses.replace(spec, head_v=64), dataclasses.replace(spec, head_k=64, head_v=64)):
        assert cls.can_implement(other.fused_key(tma))
    for other in (dataclasses.replace(spec, head_k=100, head_v=100),  # rows that end inside a 64-column panel
                  dataclasses.replace(spec, chunk=32)):  # W and U by two warps each
        assert cls.can_implement(other.fused_key(threads)) and not cls.can_implement(other.fused_key(tma))
    assert not cls.can_implement(spec.fused_key(FusedConfig(True, 2, "head", 0, 8, stores="tma")))  # 8 warps
    assert not cls.can_implement(spec.fused_key(FusedConfig(stores="tma")))  # one tile per CTA: the defaults
    assert not cls.can_implement(spec.fused_key(dataclasses.replace(tma, stores="bulk")))


def test_tma_stores_emit_tma_stores_and_threads_none(tmp_path):
    """`FusedConfig.stores` "tma" stores W and U by TMA boxes (two 64-column panels each at K = V = 128) and waits
    for their reads; "threads" has neither. A knob that silently kept the per-thread stores would pass every bitwise
    test."""
    spec = ForwardSpec("bf16", "dense", 128, 128, 64, False, "sm_90a")
    found = {}
    for stores in keys.STORE_PATHS:
        key = spec.fused_key(FusedConfig(True, 2, "head", 1, stores=stores))
        ptx_dir = tmp_path / stores
        ptx_dir.mkdir()
        compiler.compile_template(compiler.template_class(key)(key), key.arch, os.fspath(ptx_dir))
        ptx = "".join(p.read_text() for p in ptx_dir.rglob("*.ptx"))
        found[stores] = (ptx.count("cp.async.bulk.tensor.3d.global.shared::cta"),
                         ptx.count("cp.async.bulk.wait_group.read"))
    assert found == {"threads": (0, 0), "tma": (4, 2)}


def test_pingpong_only_as_two_4_warp_groups_in_one_cta_per_sm():
    spec = ForwardSpec("bf16", "cu32", 128, 128, 64, False, "sm_90a")
    cls = compiler.template_class(spec.fused_key())
    pp = FusedConfig(True, 1, "head", 1, 8, pingpong="intra")
    assert cls.can_implement(spec.fused_key(pp))
    assert cls.can_implement(spec.fused_key(dataclasses.replace(pp, gate_rows="early-vbuf")))  # a 4-warp schedule
    assert cls.can_implement(dataclasses.replace(spec, output_qg=True).fused_key(pp))
    assert not cls.can_implement(spec.fused_key(dataclasses.replace(pp, warps=4)))  # two groups of 4 warps
    assert not cls.can_implement(spec.fused_key(dataclasses.replace(pp, ctas_per_sm=2)))  # two tiles' bytes per CTA
    assert not cls.can_implement(spec.fused_key(dataclasses.replace(pp, persistent=False)))
    assert not cls.can_implement(spec.fused_key(dataclasses.replace(pp, loads_ahead=0)))  # the schedule tested
    assert not cls.can_implement(spec.fused_key(dataclasses.replace(pp, pingpong="yes")))
    assert not cls.can_implement(dataclasses.replace(spec, chunk=32).fused_key(pp))  # the product barriers' ids
    wide_v = ForwardSpec("bf16", "cu32", 128, 256, 64, False, "sm_90a")  # TMA loads, but two tiles' bytes overflow
    assert not cls.can_implement(wide_v.fused_key(pp))
    assert cls.can_implement(wide_v.fused_key(FusedConfig(True, 1, "head", 1)))


@pytest.mark.parametrize("spec", [ForwardSpec("bf16", "cu32", 100, 100, 64, False, "sm_90a"),  # cp.async loads
                                  ForwardSpec("fp32", "dense", 64, 64, 64, True, "sm_90a")],  # QG
                         ids=["cu32-k100", "dense-k64-qg"])
def test_probe_configs_compile(spec, tmp_path):
    """The configurations outside the space (`keys.FUSED_PROBE_CONFIGS`, not in the sweep) build for sm_90a beyond
    the dense K = 128 kernels that the turn test compiles: the padded rows' cp.async loads, and QG."""
    built = 0
    for config in keys.FUSED_PROBE_CONFIGS:
        key = spec.fused_key(config)
        if compiler.template_class(key).can_implement(key):
            compiler.export_object(compiler.compile_key(key), os.fspath(tmp_path / f"{config.slug()}.o"))
            built += 1
    assert built == (3 if spec.output_qg else 4)  # early-vbuf needs QG off


def test_pingpong_turns_emit_turn_barriers_and_free_none(tmp_path):
    """`FusedConfig.pingpong` "intra" and "inverse" hand the turn between the groups with named-barrier arrivals
    ("bar.arrive", the other group waiting in "bar.sync" on 256 threads), around different phases; "free" has neither,
    only each group's own barrier (128 threads); the one-group kernel only the CTA's. Turns that were silently left out
    or put around the wrong phase would pass every bitwise test."""
    spec = ForwardSpec("bf16", "dense", 128, 128, 64, False, "sm_90a")
    found, texts = {}, {}
    for mode in keys.PINGPONG_MODES:
        config = FusedConfig(True, 1, "head", 1, 8, pingpong=mode) if mode != "off" else FusedConfig(True, 2, "head", 1)
        key = spec.fused_key(config)
        ptx_dir = tmp_path / mode
        ptx_dir.mkdir()
        compiler.compile_template(compiler.template_class(key)(key), key.arch, os.fspath(ptx_dir))
        ptx = "".join(p.read_text() for p in ptx_dir.rglob("*.ptx"))
        texts[mode] = ptx
        found[mode] = tuple(len(re.findall(pattern, ptx)) for pattern in
                            (r"\bbar\.arrive\s+\S+, 256;", r"\bbar\.sync\s+\S+, 256;", r"\bbar\.sync\s+\S+, 128;",
                             r"\bbar\.sync\s+5, 256;"))
    assert found["off"] == (0, 0, 0, 0), found  # the CTA barrier only
    assert found["free"][:2] == (0, 0) and found["free"][2] > 0, found  # each group's own barrier, no turns
    assert min(found["intra"][:3]) > 0 and found["inverse"] == found["intra"], found
    assert texts["inverse"] != texts["intra"]
    assert found["intra"][3] == 1, found  # group 0's last wait, for the turn group 1 passes after its last tile


def test_every_untuned_fused_configuration_is_buildable():
    """What `forward` runs without a tuning record must fit every K, V it may meet (a shared-memory change that
    broke it would otherwise surface only as a compile error in a user's first call)."""
    sizes = range(keys.HEAD_DIM_STEP, keys.HEAD_DIMS[-1] + 1, keys.HEAD_DIM_STEP)
    checked = 0
    for (k, v), chunk, qg, io in itertools.product(
            [(n, n) for n in sizes] + [(a, b) for a in keys.HEAD_DIMS for b in keys.HEAD_DIMS if a != b],
            keys.CHUNK_SIZES, (False, True), keys.IO_DTYPES):
        spec = ForwardSpec("bf16", "cu32", k, v, chunk, qg, "sm_90a", io)
        config = spec.untuned_fused_config
        if config is not None:
            key = spec.fused_key(config)
            assert compiler.template_class(key).can_implement(key), key
            checked += 1
    assert checked > 4 * len(sizes)


def _parameter_word(name: str) -> str:
    """The template's parameter naming (mQ, mCuSeqlens, scale) reduced to compare with KernelArg names."""
    if len(name) > 1 and name[0] == "m" and name[1].isupper():
        name = name[1:]
    return name.replace("_", "").lower()


@pytest.mark.parametrize("template", sorted(keys.KEY_TYPES))
def test_kernel_parameters_follow_the_key_argument_definition(template):
    # The API launches by KernelArg name in key.ARGS order; the template's __call__ must take exactly that order.
    import inspect

    key = next(k for k in REFERENCE if k.TEMPLATE == template)
    cls = compiler.template_class(key)
    call = inspect.unwrap(cls.__call__)
    params = [p for p in inspect.signature(call).parameters if p not in ("self", "stream")]
    assert [_parameter_word(p) for p in params] == [_parameter_word(a.name) for a in key.ARGS]
    fakes = cls(key).fake_args()
    assert len(fakes) == len(key.ARGS) + 1  # + the stream


@pytest.mark.parametrize("template", sorted(keys.KEY_TYPES))
def test_shared_memory_layouts_are_the_documented_bytes(template):
    # Each template's shared memory is a cute.struct; the byte count its docstring states is that struct's size.
    import importlib

    key = next(k for k in REFERENCE if k.TEMPLATE == template)
    compiler._cute()
    module = importlib.import_module(compiler._TEMPLATES[type(key)][0])
    doc = " ".join(module.__doc__.split())  # a number and its unit may sit on two lines
    assert f"{module.smem_bytes(key):,} B" in doc or f"{module.smem_bytes(key):,} bytes" in doc, (
        template, module.smem_bytes(key))


def test_load_paths_by_head_size_and_arch():
    """q, k, g tiles load by one TMA box where the padded rows fit a box, by one bulk copy per row at the other
    unpadded sizes, and by cp.async at padded sizes (whose tiles need zeroed columns) and on sm_80 (no bulk copies)."""
    import cutlass

    from kdajit.templates.tile_intra import load_path

    want = {64: "tma", 128: "tma", 256: "bulk", 4: "cp.async", 60: "cp.async", 96: "cp.async", 100: "cp.async",
            252: "cp.async"}
    for io in (cutlass.BFloat16, cutlass.Float16):
        assert {k: load_path("sm_90a", io, k) for k in want} == want
        assert {load_path("sm_80", io, k) for k in want} == {"cp.async"}
        assert load_path("sm_100a", io, 128) == "tma"


def test_row_vectors_take_one_wide_access_only_where_16_bit_rows_split():
    """A row vector of 8 16-bit values takes one 16-byte access in place of two 8-byte pieces only at the padded
    sizes that split it (K = 60, 100, 252); the fp32 gate's 32-byte row vector keeps its two 16-byte pieces (one
    16-byte access there would leave half the vector unloaded), and so do the unpadded sizes and K = 4."""
    import cutlass

    from kdajit.templates.tile_recompute import splits_vec

    sizes = (4, 60, 64, 96, 100, 128, 252, 256)
    for io in (cutlass.BFloat16, cutlass.Float16):
        assert {k for k in sizes if splits_vec(io, k)} == {60, 100, 252}
    assert not any(splits_vec(cutlass.Float32, k) for k in sizes)
