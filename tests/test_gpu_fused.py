"""GPU: the fused forward kernel is bitwise equal to the standalone route, in every configuration.

`kdajit.forward` runs the fused kernel on sm_90a; `kdajit.intra` + `kdajit.recompute_w_u` run the
standalone kernels. Every output of every fused configuration (`kdajit.keys.FUSED_CONFIG_SPACE`: one
tile per CTA, or persistent CTAs with 1 or 2 CTAs per SM, either raster order, loads issued one tile
ahead or not, 4 or 8 warps, each gate-row schedule and intra unroll, W and U stored by threads or by TMA), and of the
configurations outside it (`FUSED_PROBE_CONFIGS`: two tiles per CTA, `FusedConfig.pingpong`) in the many-tile tests, must
equal the standalone route's bits, for both beta dtypes, dense and varlen (int32 and
int64 cu_seqlens), with and without QG, on partial chunks, 1-token and empty sequences, and on shapes
with many more tiles than CTAs (so every persistent CTA walks several tiles and reuses its shared
memory). Outputs are poisoned with NaN before each call.
"""
import pytest
import torch

import kdajit
from kdajit import api, compiler, reference, tuner
from kdajit.keys import BETA_DTYPES, FUSED_CONFIG_SPACE, FUSED_PROBE_CONFIGS, ForwardSpec, FusedConfig
from kdajit.outputs import BETA_TORCH_DTYPES
from test_gpu_forward import OUTPUTS, assert_bitwise, assert_written, poisoned_out, seed  # noqa: F401 (fixture)


def _arch_has_fused() -> bool:
    return torch.cuda.is_available() and ForwardSpec("bf16", "dense", 128, 128, 64, False,
                                                     compiler.current_arch()).uses_fused


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not _arch_has_fused(), reason="this GPU's arch has no fused kernel")]

CONFIGS = FUSED_CONFIG_SPACE


def poisoned(x, output_qg, chunk=64):
    B, T, H, K = x["gk"].shape  # H: the value heads (grouped value heads: a multiple of q's)
    return poisoned_out(B, T, H, K, x["v"].shape[-1], chunk, qg=output_qg, dtype=x["q"].dtype)


def fused(x, cu, output_qg, config, safe_gate=True, chunk=64):
    """forward into NaN-poisoned outputs, the fused kernel in `config` (None: forward's own choice of route)."""
    out = api._forward(x["q"], x["k"], x["v"], x["gk"], x["beta"], None, cu, chunk, output_qg, safe_gate,
                       poisoned(x, output_qg, chunk), fused_config=config)
    torch.cuda.synchronize()
    assert_written(out, f"fused {config}")
    return out


def standalone(x, cu, output_qg, safe_gate=True, chunk=64):
    out = poisoned(x, output_qg, chunk)
    _, Akk = kdajit.intra(x["q"], x["k"], x["gk"], x["beta"], cu_seqlens=cu, chunk_size=chunk, safe_gate=safe_gate,
                          out=out)
    kdajit.recompute_w_u(x["k"], x["v"], x["beta"], Akk, x["gk"], cu_seqlens=cu, chunk_size=chunk,
                         q=x["q"] if output_qg else None, out=out)
    torch.cuda.synchronize()
    assert_written(out, "standalone")
    return out


def varlen_inputs(lengths, H, beta_dtype, index_dtype=torch.int32):
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(index_dtype)
    return reference.make_inputs(1, sum(lengths), H, beta_dtype=beta_dtype, cu_seqlens=cu, device="cuda"), cu


@pytest.mark.parametrize("output_qg", [False, True], ids=["no_qg", "qg"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_forward_runs_the_fused_kernel_but_where_standalone_is_faster(head_dim, output_qg):
    """`forward` picks the fused kernel in its untuned configuration, and the standalone kernels at K = 256 with
    QG (faster there); a given fused configuration still runs the fused kernel (the tests and the tuner use that)."""
    problem = kdajit.validate.Problem(1, 64, 1, head_dim, head_dim, 64, "bf16", "dense", "bf16", 1)
    kernels = api._kernels(problem, 64, output_qg, torch.cuda.current_device(), intra=True, recompute=True)
    fused = (head_dim, output_qg) != (256, True)
    assert (kernels.fused is not None, kernels.intra is not None) == (fused, not fused), kernels
    forced = api._kernels(problem, 64, output_qg, torch.cuda.current_device(), intra=True, recompute=True,
                          fused_config=FusedConfig())
    assert forced.fused is not None and forced.intra is None


@pytest.mark.parametrize("output_qg", [False, True], ids=["no_qg", "qg"])
@pytest.mark.parametrize("beta", BETA_DTYPES)
def test_reference_config_equals_standalone_dense(seed, beta, output_qg):
    x = reference.make_inputs(2, 1000, 5, beta_dtype=BETA_TORCH_DTYPES[beta], device="cuda")
    assert_bitwise(fused(x, None, output_qg, FusedConfig()), standalone(x, None, output_qg), f"dense {beta}")


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["cu32", "cu64"])
@pytest.mark.parametrize("output_qg", [False, True], ids=["no_qg", "qg"])
@pytest.mark.parametrize("beta", BETA_DTYPES)
def test_reference_config_equals_standalone_varlen(seed, beta, output_qg, index_dtype):
    lengths = [1, 63, 0, 65, 64, 127, 1, 300] + torch.randint(1, 200, (4,)).tolist()
    x, cu = varlen_inputs(lengths, 3, BETA_TORCH_DTYPES[beta], index_dtype)
    assert_bitwise(fused(x, cu, output_qg, FusedConfig()), standalone(x, cu, output_qg), f"varlen {lengths}")


def builds(config: FusedConfig, beta: str, output_qg: bool) -> bool:
    """Whether `config` is in the space the tuner builds for bf16 K = V = 128 (8 warps: QG off only), or a probe
    configuration that the fused template implements there."""
    spec = ForwardSpec(beta, "dense", 128, 128, 64, output_qg, compiler.current_arch())
    key = spec.fused_key(config)
    return config in tuner.candidates(spec)[0] or (config in FUSED_PROBE_CONFIGS
                                                   and compiler.template_class(key).can_implement(key))


@pytest.mark.parametrize("config", CONFIGS[1:] + FUSED_PROBE_CONFIGS, ids=lambda c: c.slug())
def test_configs_equal_standalone_with_many_tiles_per_cta(seed, config):
    # 2 x 65 chunks x 24 heads = 3120 tiles: about 12-24 per persistent CTA; the last chunk is partial.
    x = reference.make_inputs(2, 4100, 24, beta_dtype=torch.float32, device="cuda")
    # with QG off, loads_ahead=1 reloads q right after the intra phase, and 8 warps put Kp in q's buffer
    for output_qg in [qg for qg in (True, False) if builds(config, "fp32", qg)]:
        assert_bitwise(fused(x, None, output_qg, config), standalone(x, None, output_qg), f"dense, {config}")
    lengths = torch.randint(1, 700, (40,)).tolist() + [1, 63, 65]
    x, cu = varlen_inputs(lengths, 16, torch.bfloat16, torch.int64)
    assert_bitwise(fused(x, cu, False, config), standalone(x, cu, False), f"varlen, {config}")


@pytest.mark.parametrize("config", FUSED_PROBE_CONFIGS, ids=lambda c: c.slug())
def test_probes_equal_standalone_on_few_and_odd_tile_counts(seed, config):
    # Two tiles per CTA (`FusedConfig.pingpong`): 1 tile, 9 tiles, and 240 (more than the SMs, fewer than their
    # groups on a 132-SM card), so one group's tiles run out first and it must keep passing the turn.
    for B, T, H in ((1, 64, 1), (1, 130, 3), (3, 1000, 5)):
        x = reference.make_inputs(B, T, H, beta_dtype=torch.bfloat16, device="cuda")
        assert_bitwise(fused(x, None, False, config), standalone(x, None, False), f"dense {B}x{T}x{H}, {config}")


@pytest.mark.parametrize("config", [c for c in CONFIGS + FUSED_PROBE_CONFIGS if c.persistent], ids=lambda c: c.slug())
def test_persistent_walk_over_long_sequences_equals_standalone(seed, config):
    # A persistent CTA's next varlen tile is x + gridDim.x / HV chunks on (raster head) or gridDim.x chunks on (raster
    # chunk, wrapping to the next head): with HV = 32 and sequences of up to 20,000 tokens (313 chunks) many of a
    # CTA's tiles lie in the sequence of its previous tile, and many cross into a later one or wrap back.
    lengths = [20000, 1, 64, 0, 65] + torch.randint(1, 4097, (10,)).tolist() + [8192, 63]
    x, cu = varlen_inputs(lengths, 32, torch.bfloat16, torch.int64)
    assert_bitwise(fused(x, cu, False, config), standalone(x, cu, False), f"varlen {lengths}, {config}")


def test_fused_accuracy_against_fp64(seed):
    lengths = [1, 63, 65, 200, 130]
    x, cu = varlen_inputs(lengths, 2, torch.bfloat16)
    out = fused(x, cu, True, FusedConfig(True, 2, "head"))
    ref = reference.forward_reference(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, output_qg=True)
    for name in OUTPUTS:
        assert reference.relative_error(getattr(out, name), getattr(ref, name)) < 1e-2, name
