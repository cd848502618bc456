"""GPU: the any-gate path (safe_gate=False) keeps every promise for gates of any steepness.

Gates are FLA's unbounded test gates, logsigmoid(randn) * scale per token (scale 1, 10 and 40; x 10 with half
of them exactly 0, FLA's mask_p): far steeper than the safe path's bound, where it overflows. For each: every
element written and finite, fp64 accuracy and the exact structure, each output's error at most FLA's
safe_gate=False path's on the same inputs times docs/contract.md's factor, the fused kernel (every configuration
it builds for the spec) bitwise equal to the standalone route, causal bits (appending tokens keeps earlier rows),
the off-diagonal 16 x 16 blocks bit-identical to the safe path's (only the diagonal blocks change), and diagonal
blocks whose rows lie on both sides of the fast spread (docs/numerics.md) right in each row, also when a single
head-dim column decides it.
"""
import pytest
import torch

import kdajit
from kdajit import reference, tuner
from kdajit.keys import ForwardSpec, FusedConfig
from kdajit.outputs import IO_TORCH_DTYPES
from test_gpu_causal import assert_rows_equal, complete_chunk_rows
from test_gpu_forward import (INPUTS, OUTPUTS, FLA_ERROR_FACTOR, assert_bitwise, assert_fp64_accuracy_and_exact_structure,
                              chunk_upper_mask, fla_intra_or_skip, seed)  # noqa: F401
from test_gpu_fused import _arch_has_fused, fused, standalone

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (gate scale, fraction of exact zeros): FLA's test_chunk gate draws
GATES = [(1.0, 0.0), (10.0, 0.0), (10.0, 0.5), (40.0, 0.0)]
GATE_IDS = ["logsigmoid", "x10", "x10-zeros", "x40"]
LENGTHS = [1, 15, 63, 64, 65, 500, 1000]


def gate_inputs(gate, varlen, io="bf16", K=128, H=3, beta_dtype=torch.float32):
    scale, zeros = gate
    dtype = IO_TORCH_DTYPES[io]
    kw = dict(beta_dtype=beta_dtype, io_dtype=dtype, gate_scale=scale, gate_zeros=zeros, device="cuda")
    if varlen:
        cu = torch.tensor([0] + LENGTHS, device="cuda").cumsum(0).to(torch.int64)
        return reference.make_inputs(1, sum(LENGTHS), H, K, K, cu_seqlens=cu, **kw), cu
    return reference.make_inputs(2, 300, H, K, K, **kw), None


def any_gate(x, cu=None, output_qg=True, config=None):
    """forward(safe_gate=False) into NaN-poisoned outputs (the fused kernel in `config` when given)."""
    return fused(x, cu, output_qg, config, safe_gate=False)


def any_gate_standalone(x, cu=None, output_qg=True):
    return standalone(x, cu, output_qg, safe_gate=False)


def reference_of(x, cu):
    return reference.forward_reference(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, output_qg=True)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("gate", GATES, ids=GATE_IDS)
def test_accuracy_against_fp64_and_exact_structure(seed, gate, varlen):
    x, cu = gate_inputs(gate, varlen)
    assert_finite_and_accurate(x, cu)


def assert_finite_and_accurate(x, cu=None):
    """forward(safe_gate=False) on x: every output finite, fp64 accuracy, the exact structure. Returns the outputs."""
    out = any_gate(x, cu)
    for name in OUTPUTS:
        assert torch.isfinite(getattr(out, name)).all(), f"{name} has non-finite values"
    assert_fp64_accuracy_and_exact_structure(x, cu, out, reference_of(x, cu))
    return out


def fla_any_gate_errors(fla_intra, x, ref, cu):
    """FLA's relative errors (safe_gate=False, its token-parallel path) against fp64 on the same inputs."""
    w, u, qg, kg, Aqk, Akk = fla_intra(x["q"], x["k"], x["v"], x["gk"], x["beta"], x["q"].shape[-1] ** -0.5,
                                       cu_seqlens=cu, safe_gate=False, disable_recompute=True)
    upper = chunk_upper_mask(x["q"].shape[1], cu)
    got = {"w": w, "u": u, "kg": kg, "qg": qg, "Akk": Akk,
           # FLA leaves Aqk's strictly-upper 16x16 blocks unwritten: compare the lower triangle only.
           "Aqk": torch.where(upper[None, :, None, :], 0.0, Aqk.float())}
    return {name: reference.relative_error(got[name], getattr(ref, name)) for name in OUTPUTS}


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("gate", GATES, ids=GATE_IDS)
def test_accuracy_within_contract_factor_of_fla_any_gate(seed, gate, varlen):
    fla_intra = fla_intra_or_skip()
    x, cu = gate_inputs(gate, varlen, H=4)
    ref = reference_of(x, cu)
    theirs = fla_any_gate_errors(fla_intra, x, ref, cu)
    out = any_gate(x, cu)
    ours = {name: reference.relative_error(getattr(out, name), getattr(ref, name)) for name in OUTPUTS}
    report = "\n".join(f"{name}: kdajit {ours[name]:.3e} vs FLA {theirs[name]:.3e}" for name in OUTPUTS)
    print(report)
    worse = [name for name in OUTPUTS if not ours[name] <= theirs[name] * FLA_ERROR_FACTOR]
    assert not worse, f"gate {gate}: above {FLA_ERROR_FACTOR} x FLA's safe_gate=False error: {worse}\n{report}"


def fused_configs(output_qg):
    spec = ForwardSpec("fp32", "dense", 128, 128, 64, output_qg, "sm_90a", "bf16", False)
    return tuner.candidates(spec)[0]


@pytest.mark.skipif(not _arch_has_fused(), reason="this GPU's arch has no fused kernel")
@pytest.mark.parametrize("output_qg", [False, True], ids=["no_qg", "qg"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_every_fused_config_equals_standalone(seed, varlen, output_qg):
    x, cu = gate_inputs((10.0, 0.5), varlen)
    expected = any_gate_standalone(x, cu, output_qg)
    for config in fused_configs(output_qg):
        assert_bitwise(expected, any_gate(x, cu, output_qg, config), f"any gate: {config.slug()} vs standalone")


@pytest.mark.skipif(not _arch_has_fused(), reason="this GPU's arch has no fused kernel")
@pytest.mark.parametrize("io, K", [("fp16", 64), ("bf16", 256)], ids=["fp16-K64", "bf16-K256"])
def test_coverage_specializations_fused_equal_standalone(seed, io, K):
    x, cu = gate_inputs((10.0, 0.0), True, io, K, beta_dtype=IO_TORCH_DTYPES[io])
    out = any_gate(x, cu, True, FusedConfig())
    assert_bitwise(any_gate_standalone(x, cu), out, f"any gate {io} K={K}: tile vs standalone")
    assert_fp64_accuracy_and_exact_structure(x, cu, out, reference_of(x, cu))


@pytest.mark.parametrize("offset", [1, 7, 8, 9, 15, 16, 17, 63])
def test_appending_tokens_keeps_earlier_rows(seed, offset):
    prefix = 64 + offset
    x = reference.make_inputs(2, prefix + 58, 3, gate_scale=10.0, device="cuda")
    longer = any_gate(x)
    shorter = any_gate({n: x[n][:, :prefix].contiguous() for n in INPUTS})
    assert_rows_equal(longer, shorter, slice(0, prefix), slice(0, prefix), complete_chunk_rows(prefix),
                      f"any gate: prefix of {prefix} tokens vs the same tokens followed by 58 more")


def test_rows_on_both_sides_of_the_fast_spread(seed):
    """A gate that drops 20 (log2) per token in every column: in each 16-row diagonal block rows 0-7 drop at most
    140 from the block's first row and take the 3xTF32 products, rows 8-15 drop 160-300 and take the per-pair sums
    (tile_intra.FAST_SPREAD = 150), so one block mixes both. Each row must get its own kind: the products of rows
    10-15 overflow (NaN), so a row given the wrong kind is not finite."""
    x = reference.make_inputs(2, 300, 3, device="cuda")
    x["gk"] = reference.chunk_local_cumsum(torch.full_like(x["gk"], -20.0), 64)
    out = assert_finite_and_accurate(x)
    assert torch.equal(out.Aqk.view(torch.int16), any_gate_standalone(x).Aqk.view(torch.int16))


@pytest.mark.parametrize("column", range(8))
def test_one_steep_column_makes_its_rows_slow(seed, column):
    """Only head-dim column `column` drops (20 per token, log2); the others are flat (gate exactly 0). Rows 8-15 of
    each diagonal block are slow because of that one column, which one lane of the row's four holds: the row's
    minimum must gather all four lanes, or the lanes that miss it take the row as fast, where column `column`'s
    factors overflow (NaN). The 8 columns cover every lane position of an MMA step."""
    x = reference.make_inputs(2, 300, 3, device="cuda")
    drop = torch.zeros_like(x["gk"])
    drop[..., column] = -20.0
    x["gk"] = reference.chunk_local_cumsum(drop, 64)
    assert_finite_and_accurate(x)


def test_only_the_diagonal_blocks_differ_from_the_safe_path(seed):
    """On safe gates, Aqk's off-diagonal 16 x 16 blocks are the same bits in both paths (the same TF32 products);
    the diagonal blocks are the any-gate path's 3xTF32 products (every row is within the fast spread here), closer
    to fp64 than the safe path's TF32 ones."""
    x = reference.make_inputs(2, 256, 4, device="cuda")
    safe = kdajit.forward(x["q"], x["k"], x["v"], x["gk"], x["beta"])
    exact = kdajit.forward(x["q"], x["k"], x["v"], x["gk"], x["beta"], safe_gate=False)
    rows = torch.arange(256, device="cuda") % 64 // 16
    diagonal = rows[:, None] == torch.arange(64, device="cuda")[None, :] // 16  # [T, 64]
    off = ~diagonal[None, :, None, :].expand_as(safe.Aqk)
    assert torch.equal(safe.Aqk[off].view(torch.int16), exact.Aqk[off].view(torch.int16))
    assert not torch.equal(safe.Aqk.view(torch.int16), exact.Aqk.view(torch.int16))
    ref = reference.forward_reference(x["q"], x["k"], x["v"], x["gk"], x["beta"])
    on = ~off
    err = {name: (out.Aqk[on].double() - ref.Aqk[on].double().to(out.Aqk.device)).norm().item()
           for name, out in (("safe", safe), ("exact", exact))}
    assert err["exact"] <= err["safe"], err


def test_safe_path_overflows_where_the_any_gate_path_does_not(seed):
    """The reason for the path: gates 40x steeper than the bound give non-finite values on the safe path."""
    x = reference.make_inputs(1, 300, 2, gate_scale=40.0, device="cuda")
    safe = kdajit.forward(x["q"], x["k"], x["v"], x["gk"], x["beta"])
    exact = kdajit.forward(x["q"], x["k"], x["v"], x["gk"], x["beta"], safe_gate=False)
    assert not torch.isfinite(safe.Akk).all()
    assert all(torch.isfinite(getattr(exact, name)).all() for name in OUTPUTS[:5])
