"""GPU: the specializations beside bf16 K = V = 128 keep every promise of the reference one.

Each case is an io dtype (q, k, v and every output: bf16 or fp16) and a head size K = V (64, 128 or
256), with beta in the io dtype (as FLA's fp16 tests draw it). For each, dense and varlen (partial
chunks, 1-token sequences): every element written (outputs poisoned with NaN), outputs in the io
dtype, error against the fp64 reference within the accuracy rule and the exact structure (Aqk zero
above the diagonal, Akk unit lower triangular), the fused kernel (reference and a persistent
configuration) bitwise equal to the standalone route, causal bits (appending tokens keeps earlier
rows), and each output's error at most FLA's on the same inputs times docs/contract.md's factor.
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

# (io dtype, K = V); the reference specialization (bf16, 128) is tested everywhere else.
CASES = [("fp16", 128), ("bf16", 64), ("bf16", 256), ("fp16", 64), ("fp16", 256)]
CASE_IDS = [f"{io}-K{K}" for io, K in CASES]
# A persistent configuration every case can build (one CTA per SM fits K = 256).
PERSISTENT = FusedConfig(True, 1, "head", 1)
VARLEN_LENGTHS = [1, 63, 65, 200, 130]


def inputs(io, K, varlen):
    dtype = IO_TORCH_DTYPES[io]
    if varlen:
        cu = torch.tensor([0] + VARLEN_LENGTHS, device="cuda").cumsum(0).to(torch.int32)
        x = reference.make_inputs(1, sum(VARLEN_LENGTHS), 3, K, K, beta_dtype=dtype, io_dtype=dtype, cu_seqlens=cu,
                                  device="cuda")
        return x, cu
    return reference.make_inputs(2, 300, 3, K, K, beta_dtype=dtype, io_dtype=dtype, device="cuda"), None


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("io, K", CASES, ids=CASE_IDS)
def test_accuracy_against_fp64_and_exact_structure(seed, io, K, varlen):
    x, cu, out, ref = accuracy_case(io, varlen, io, K)
    for name in OUTPUTS:
        got = getattr(out, name)
        assert got.dtype == IO_TORCH_DTYPES[io], f"{name} has dtype {got.dtype}, expected the inputs' {io}"
    assert_fp64_accuracy_and_exact_structure(x, cu, out, ref)


@pytest.mark.skipif(not _arch_has_fused(), reason="this GPU's arch has no fused kernel")
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("io, K", CASES, ids=CASE_IDS)
def test_fused_configs_equal_standalone(seed, io, K, varlen):
    x, cu = inputs(io, K, varlen)
    expected = standalone(x, cu, True)
    for config in (FusedConfig(), PERSISTENT):
        assert_bitwise(expected, fused(x, cu, True, config), f"{io} K={K}: {config.slug()} vs the standalone route")


@pytest.mark.parametrize("offset", [1, 17, 63])
@pytest.mark.parametrize("io, K", CASES, ids=CASE_IDS)
def test_appending_tokens_keeps_earlier_rows(seed, io, K, offset):
    prefix = 64 + offset
    dtype = IO_TORCH_DTYPES[io]
    x = reference.make_inputs(2, prefix + 58, 3, K, K, beta_dtype=dtype, io_dtype=dtype, device="cuda")
    longer = run(x)
    shorter = run({n: x[n][:, :prefix].contiguous() for n in INPUTS})
    assert_rows_equal(longer, shorter, slice(0, prefix), slice(0, prefix), complete_chunk_rows(prefix),
                      f"{io} K={K}: prefix of {prefix} tokens vs the same tokens followed by 58 more")


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("io, K", CASES, ids=CASE_IDS)
def test_accuracy_within_contract_factor_of_fla(seed, io, K, varlen):
    fla_intra = fla_intra_or_skip()
    assert_within_fla_factor(fla_intra, *accuracy_case(io, varlen, io, K), what=f"{io} K={K}:")
