"""GPU: the specializations beside bf16 K = V = 128 keep every promise of the reference one.

Each case is an io dtype (q, k, v and every output: bf16 or fp16) and head sizes K and V (64, 128 or 256, or a
padded size such as 60 or 100; K != V too), with beta in the io dtype (as FLA's fp16 tests draw it). For each, dense
and varlen (partial chunks, 1-token sequences): every element written (outputs poisoned with NaN), outputs in the io
dtype, error against the fp64 reference within the accuracy rule and the exact structure (Aqk zero above the
diagonal, Akk unit lower triangular), the fused kernel (reference and a persistent configuration, and with QG off
the 8-warp tile configuration) bitwise equal to the standalone route, causal bits (appending tokens keeps earlier
rows), and each output's error at most FLA's on the same inputs times docs/contract.md's factor.
Grouped value heads (q, k with H heads; v, gk, beta and the outputs with HV = group * H) keep the same
promises and give the bits of the ungrouped call on q, k with each head repeated `group` times.
"""
import pytest
import torch

from kdajit import reference
from kdajit.keys import FusedConfig
from kdajit.outputs import IO_TORCH_DTYPES
from test_gpu_causal import assert_rows_equal, complete_chunk_rows
from test_gpu_forward import (INPUTS, OUTPUTS, accuracy_case, assert_bitwise, assert_fp64_accuracy_and_exact_structure,
                              assert_within_fla_factor, fla_intra_or_skip, run, seed)  # noqa: F401 (seed: fixture)
from test_gpu_fused import _arch_has_fused, fused, standalone

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (io dtype, K, V); the reference specialization (bf16, 128, 128) is tested everywhere else. The K != V pairs
# put the smaller head on each side once, and 64 against 256 (v's rows and k's rows furthest apart); the padded
# sizes come as K = V and as K != V pairs whose tiles differ (100 with 60) or agree (100 with 128, 64 with 60: the
# 8-warp kernel's single product code must still use W's and U's own layouts), and at the ends of the range (4 with
# 252: a row shorter than one 8-column tile; 252 with 4).
CASES = [("fp16", 128, 128), ("bf16", 64, 64), ("bf16", 256, 256), ("fp16", 64, 64), ("fp16", 256, 256),
         ("bf16", 64, 128), ("bf16", 128, 64), ("fp16", 256, 64), ("bf16", 64, 256),
         ("bf16", 60, 60), ("fp16", 100, 100), ("bf16", 100, 60), ("bf16", 100, 128), ("bf16", 64, 60),
         ("bf16", 4, 252), ("bf16", 252, 4)]
CASE_IDS = [f"{io}-K{K}" + (f"-V{V}" if V != K else "") for io, K, V in CASES]
# The FLA comparison runs on head sizes FLA's own tests use (16 and up); K = 4 is checked against fp64 only.
FLA_CASES = [case for case in CASES if min(case[1:]) >= 16]
FLA_CASE_IDS = [name for case, name in zip(CASES, CASE_IDS) if case in FLA_CASES]
# A persistent configuration every case can build (one CTA per SM fits K = 256).
PERSISTENT = FusedConfig(True, 1, "head", 1)
EIGHT_WARPS = FusedConfig(warps=8)  # forward's untuned configuration without QG at K = 256 and K != V of the 128 tile
VARLEN_LENGTHS = [1, 63, 65, 200, 130]


def inputs(io, K, varlen, H=3, group=1, V=None):
    """(inputs, cu_seqlens): q, k with H heads and head size K, v (head size V, default K), gk, beta with H * group
    heads (grouped value heads when group > 1)."""
    V = K if V is None else V
    dtype = IO_TORCH_DTYPES[io]
    dtypes = dict(beta_dtype=dtype, io_dtype=dtype, value_heads=H * group, device="cuda")
    if varlen:
        cu = torch.tensor([0] + VARLEN_LENGTHS, device="cuda").cumsum(0).to(torch.int32)
        return reference.make_inputs(1, sum(VARLEN_LENGTHS), H, K, V, cu_seqlens=cu, **dtypes), cu
    return reference.make_inputs(2, 300, H, K, V, **dtypes), None


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("io, K, V", CASES, ids=CASE_IDS)
def test_accuracy_against_fp64_and_exact_structure(seed, io, K, V, varlen):
    x, cu, out, ref = accuracy_case(io, varlen, io, K, V)
    for name in OUTPUTS:
        got = getattr(out, name)
        assert got.dtype == IO_TORCH_DTYPES[io], f"{name} has dtype {got.dtype}, expected the inputs' {io}"
    assert_fp64_accuracy_and_exact_structure(x, cu, out, ref)


@pytest.mark.skipif(not _arch_has_fused(), reason="this GPU's arch has no fused kernel")
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("io, K, V", CASES, ids=CASE_IDS)
def test_fused_configs_equal_standalone(seed, io, K, V, varlen):
    x, cu = inputs(io, K, varlen, V=V)
    expected = standalone(x, cu, True)
    for config in (FusedConfig(), PERSISTENT):
        assert_bitwise(expected, fused(x, cu, True, config), f"{io} K={K} V={V}: {config.slug()} vs the standalone "
                                                             f"route")
    assert_bitwise(standalone(x, cu, False), fused(x, cu, False, EIGHT_WARPS),
                   f"{io} K={K} V={V}, no QG: {EIGHT_WARPS.slug()} vs the standalone route")


@pytest.mark.parametrize("offset", [1, 17, 63])
@pytest.mark.parametrize("io, K, V", CASES, ids=CASE_IDS)
def test_appending_tokens_keeps_earlier_rows(seed, io, K, V, offset):
    prefix = 64 + offset
    dtype = IO_TORCH_DTYPES[io]
    x = reference.make_inputs(2, prefix + 58, 3, K, V, beta_dtype=dtype, io_dtype=dtype, device="cuda")
    longer = run(x)
    shorter = run({n: x[n][:, :prefix].contiguous() for n in INPUTS})
    assert_rows_equal(longer, shorter, slice(0, prefix), slice(0, prefix), complete_chunk_rows(prefix),
                      f"{io} K={K} V={V}: prefix of {prefix} tokens vs the same tokens followed by 58 more")


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("io, K, V", FLA_CASES, ids=FLA_CASE_IDS)
def test_accuracy_within_contract_factor_of_fla(seed, io, K, V, varlen):
    fla_intra = fla_intra_or_skip()
    assert_within_fla_factor(fla_intra, *accuracy_case(io, varlen, io, K, V), what=f"{io} K={K} V={V}:")


# (io dtype, K = V, H, group): grouped value heads, HV = group * H; at K = 60 with an even H, where the q / k rows of
# even heads start on 16 bytes and those of odd heads on 8 (every other case has H = 3 or 1).
GROUPED = [("bf16", 128, 2, 2), ("fp16", 64, 1, 4), ("bf16", 60, 2, 2)]
GROUPED_IDS = [f"{io}-K{K}-H{H}-HV{H * group}" for io, K, H, group in GROUPED]


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("io, K, H, group", GROUPED, ids=GROUPED_IDS)
def test_grouped_value_heads(seed, io, K, H, group, varlen):
    x, cu = inputs(io, K, varlen, H, group)
    out = run(x, cu)
    assert out.Aqk.shape[2] == out.w.shape[2] == H * group
    ref = reference.forward_reference(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, output_qg=True)
    assert_fp64_accuracy_and_exact_structure(x, cu, out, ref)
    repeated = {**x, **{n: x[n].repeat_interleave(group, dim=2).contiguous() for n in ("q", "k")}}
    assert_bitwise(out, run(repeated, cu), f"grouped ({H} q/k heads, {H * group} value heads) vs the same call "
                                            f"with q and k repeated per value head")
    if _arch_has_fused():
        expected = standalone(x, cu, True)
        for config in (FusedConfig(), PERSISTENT):
            assert_bitwise(expected, fused(x, cu, True, config), f"grouped: {config.slug()} vs the standalone route")
        assert_bitwise(standalone(x, cu, False), fused(x, cu, False, EIGHT_WARPS),
                       f"grouped, no QG: {EIGHT_WARPS.slug()} vs the standalone route")


@pytest.mark.parametrize("io, K, H, group", GROUPED, ids=GROUPED_IDS)
def test_grouped_accuracy_within_contract_factor_of_fla(seed, io, K, H, group):
    """FLA's `chunk_kda_fwd_intra` takes grouped value heads too: the same inputs, its error, ours."""
    fla_intra = fla_intra_or_skip()
    x, cu = inputs(io, K, False, H, group)
    out = run(x, cu)
    ref = reference.forward_reference(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, output_qg=True)
    assert_within_fla_factor(fla_intra, x, cu, out, ref, what=f"grouped {io} K={K} H={H} HV={H * group}:")


# chunk_size 32: (io dtype, K, V), beta in the io dtype; every promise of chunk 64, checked at 32.
CHUNK32 = [("bf16", 128, 128), ("fp16", 64, 64), ("bf16", 256, 128)]
CHUNK32_IDS = [f"{io}-K{K}" + (f"-V{V}" if V != K else "") + "-C32" for io, K, V in CHUNK32]


def chunk32_inputs(io, K, V, varlen, **gate):
    dtype = IO_TORCH_DTYPES[io]
    common = dict(beta_dtype=dtype, io_dtype=dtype, chunk_size=32, device="cuda", **gate)
    if varlen:
        cu = torch.tensor([0] + VARLEN_LENGTHS, device="cuda").cumsum(0).to(torch.int32)
        return reference.make_inputs(1, sum(VARLEN_LENGTHS), 3, K, V, cu_seqlens=cu, **common), cu
    return reference.make_inputs(2, 300, 3, K, V, **common), None


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("io, K, V", CHUNK32, ids=CHUNK32_IDS)
def test_chunk32_accuracy_against_fp64_and_exact_structure(seed, io, K, V, varlen):
    x, cu, out, ref = accuracy_case(io, varlen, io, K, V, chunk=32)
    assert out.Aqk.shape[-1] == out.Akk.shape[-1] == 32
    assert_fp64_accuracy_and_exact_structure(x, cu, out, ref)


@pytest.mark.skipif(not _arch_has_fused(), reason="this GPU's arch has no fused kernel")
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("io, K, V", CHUNK32, ids=CHUNK32_IDS)
def test_chunk32_fused_configs_equal_standalone(seed, io, K, V, varlen):
    x, cu = chunk32_inputs(io, K, V, varlen)
    expected = standalone(x, cu, True, chunk=32)
    for config in (FusedConfig(), PERSISTENT):
        assert_bitwise(expected, fused(x, cu, True, config, chunk=32), f"{io} K={K} V={V} chunk 32: {config.slug()}")
    assert_bitwise(standalone(x, cu, False, chunk=32), fused(x, cu, False, EIGHT_WARPS, chunk=32),
                   f"{io} K={K} V={V} chunk 32, no QG: {EIGHT_WARPS.slug()}")


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("io, K, V", CHUNK32, ids=CHUNK32_IDS)
def test_chunk32_any_gate(seed, io, K, V, varlen):
    """The any-gate path at chunk 32 (logsigmoid x 10 gates, a fifth of them exactly 0): finite, within the fp64
    rule, and the same bits in every route and configuration."""
    x, cu = chunk32_inputs(io, K, V, varlen, gate_scale=10.0, gate_zeros=0.2)
    out = run(x, cu, chunk=32, safe_gate=False)
    ref = reference.forward_reference(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, chunk_size=32,
                                      output_qg=True)
    assert_fp64_accuracy_and_exact_structure(x, cu, out, ref)
    expected = standalone(x, cu, True, safe_gate=False, chunk=32)
    assert_bitwise(expected, out, "any gate, chunk 32: forward vs the standalone route")
    if _arch_has_fused():
        assert_bitwise(expected, fused(x, cu, True, PERSISTENT, safe_gate=False, chunk=32),
                       f"any gate, chunk 32: {PERSISTENT.slug()}")
        assert_bitwise(standalone(x, cu, False, safe_gate=False, chunk=32),
                       fused(x, cu, False, EIGHT_WARPS, safe_gate=False, chunk=32), f"any gate, chunk 32: tile-w8")


@pytest.mark.parametrize("offset", [1, 17, 31])
@pytest.mark.parametrize("io, K, V", CHUNK32, ids=CHUNK32_IDS)
def test_chunk32_appending_tokens_keeps_earlier_rows(seed, io, K, V, offset):
    prefix = 32 + offset
    x, _ = chunk32_inputs(io, K, V, False)
    longer = run(x, chunk=32)
    shorter = run({n: x[n][:, :prefix].contiguous() for n in INPUTS}, chunk=32)
    assert_rows_equal(longer, shorter, slice(0, prefix), slice(0, prefix), complete_chunk_rows(prefix, 32),
                      f"{io} K={K} V={V} chunk 32: prefix of {prefix} tokens vs the same tokens followed by more")


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("io, K, V", CHUNK32, ids=CHUNK32_IDS)
def test_chunk32_accuracy_within_contract_factor_of_fla(seed, io, K, V, varlen):
    fla_intra = fla_intra_or_skip()
    assert_within_fla_factor(fla_intra, *accuracy_case(io, varlen, io, K, V, chunk=32),
                             what=f"{io} K={K} V={V} chunk 32:")
