"""The fp64 reference (kdajit.reference) against independent evaluations. CPU only, a few seconds.

- The chunked delta-rule forward assembled from the reference pieces equals the token-by-token KDA
  recurrence (output and final state), dense and varlen, zero and random initial state.
- Per-element Python loops (no vectorisation shared with the reference) give the same Aqk, L, W, U,
  KG and QG, and Akk @ (I + L) == I.
- Structure: Akk is unit lower triangular (exact 1 / exact 0), Aqk is exactly 0 above the diagonal.
- fp32 evaluation is close to fp64; varlen equals per-sequence dense runs bit for bit.
- make_inputs: the gate restarts at chunk and sequence starts and respects the lower bound.

Inputs are fresh random draws every run. Each test prints its seed (pytest shows it on failure) and
puts it in the assertion messages; set REFERENCE_TEST_SEED=<seed> to replay a failure.
"""
from __future__ import annotations

import ast
import math
import os
from pathlib import Path

import pytest
import torch

import kdajit
from kdajit import outputs, reference
from kdajit.reference import (
    RCP_LN2,
    ForwardOutput,
    chunk_local_cumsum,
    chunked_kda_forward,
    forward_reference,
    make_inputs,
    naive_recurrent_kda,
    relative_error,
)

F64 = torch.float64
EXACT_TOL = 1e-10       # chunked form vs recurrence, both in fp64
LOOP_TOL = 1e-12        # vectorised reference vs per-element loops, fp64
FP32_TOL = 1e-5         # fp32 reference vs fp64 reference
VARLEN_LENGTHS = [1, 63, 64, 65, 127, 0]


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """These tests run thousands of small ops; OpenMP synchronisation between threads costs more than it saves
    (3x slower on a loaded 2-core runner), so the module runs on one thread and restores the setting after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def rng(request) -> torch.Generator:
    """A CPU generator with a fresh seed (or REFERENCE_TEST_SEED), printed for reproduction."""
    seed = int(os.environ.get("REFERENCE_TEST_SEED") or int.from_bytes(os.urandom(8), "little") >> 1)
    print(f"{request.node.name}: REFERENCE_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def tag(rng: torch.Generator) -> str:
    return f"REFERENCE_TEST_SEED={rng.initial_seed()}"


def packed_cu_seqlens(lengths: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=dtype)


def shuffled_lengths(rng: torch.Generator) -> list[int]:
    return [VARLEN_LENGTHS[i] for i in torch.randperm(len(VARLEN_LENGTHS), generator=rng).tolist()]


def fp64_gate(inputs: dict, chunk_size: int) -> torch.Tensor:
    """gk summed in fp64 from g_raw, so that 2^gk == exp(cumsum g_raw) to fp64 precision."""
    return chunk_local_cumsum(inputs["g_raw"].to(F64), chunk_size, cu_seqlens=inputs.get("cu_seqlens"),
                              scale=RCP_LN2)


def sequence_bounds(inputs: dict) -> list[tuple[int, int]]:
    cu = inputs.get("cu_seqlens")
    tokens = inputs["q"].shape[1]
    if cu is None:
        return [(0, tokens)]
    values = cu.tolist()
    return list(zip(values[:-1], values[1:]))


def position_in_chunk(inputs: dict, chunk_size: int) -> torch.Tensor:
    """[T] row index inside its chunk (chunks counted from each sequence start)."""
    pos = torch.empty(inputs["q"].shape[1], dtype=torch.long)
    for bos, eos in sequence_bounds(inputs):
        pos[bos:eos] = torch.arange(eos - bos) % chunk_size
    return pos


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str, rng: torch.Generator) -> None:
    err = relative_error(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e} ({tag(rng)})"


# ---------------------------------------------------------------------------------------------------------
# Independent evaluation: chunked form of the reference pieces == token-by-token recurrence


def check_against_recurrence(inputs: dict, chunk_size: int, random_state: bool, rng: torch.Generator) -> None:
    q, k, v, beta = inputs["q"], inputs["k"], inputs["v"], inputs["beta"]
    cu = inputs.get("cu_seqlens")
    scale = q.shape[-1] ** -0.5
    gk = fp64_gate(inputs, chunk_size)
    n_states = q.shape[0] if cu is None else cu.numel() - 1
    state0 = None
    if random_state:
        state0 = torch.randn(n_states, q.shape[2], q.shape[3], v.shape[3], generator=rng, dtype=F64)

    pieces = forward_reference(q, k, v, gk, beta, cu_seqlens=cu, chunk_size=chunk_size, output_qg=True)
    o_chunk, s_chunk = chunked_kda_forward(q, k, v, gk, beta, scale, pieces, cu_seqlens=cu,
                                           chunk_size=chunk_size, initial_state=state0)
    o_rec, s_rec = naive_recurrent_kda(q, k, v, inputs["g_raw"], beta, scale, cu_seqlens=cu,
                                       initial_state=state0)
    assert o_chunk.dtype == F64 and s_chunk.shape == (n_states, q.shape[2], q.shape[3], v.shape[3])
    assert_close(o_chunk, o_rec, EXACT_TOL, "o", rng)
    assert_close(s_chunk, s_rec, EXACT_TOL, "final state", rng)
    for bos, eos in sequence_bounds(inputs):
        if eos > bos:  # every sequence on its own, so that a short one cannot hide behind a long one
            assert_close(o_chunk[:, bos:eos], o_rec[:, bos:eos], EXACT_TOL, f"o rows [{bos}, {eos})", rng)


@pytest.mark.parametrize("random_state", [False, True], ids=["zero_state", "random_state"])
@pytest.mark.parametrize("chunk_size", [64, 32])
def test_chunked_equals_recurrence_dense(rng, chunk_size, random_state):
    # T = 200: three full chunks of 64 and a partial one of 8.
    inputs = make_inputs(2, 200, 2, 128, 128, beta_dtype=torch.float32, generator=rng, chunk_size=chunk_size)
    check_against_recurrence(inputs, chunk_size, random_state, rng)


@pytest.mark.parametrize("random_state", [False, True], ids=["zero_state", "random_state"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_chunked_equals_recurrence_varlen(rng, cu_dtype, random_state):
    lengths = shuffled_lengths(rng)
    cu = packed_cu_seqlens(lengths, cu_dtype)
    inputs = make_inputs(1, sum(lengths), 2, 128, 128, cu_seqlens=cu, generator=rng)
    check_against_recurrence(inputs, 64, random_state, rng)


def test_naive_recurrence_matches_explicit_matrix_form(rng):
    # The einsum recurrence against S_t = (I - b k k^T) diag(exp g) S_{t-1} + b k v^T written literally.
    inputs = make_inputs(1, 9, 1, 8, 4, generator=rng)
    q, k, v, g, beta = (inputs[n][0, :, 0].to(F64) for n in ("q", "k", "v", "g_raw", "beta"))
    state = torch.randn(8, 4, generator=rng, dtype=F64)
    o_ref, s = [], state.clone()
    for t in range(9):
        s = (torch.eye(8, dtype=F64) - beta[t] * torch.outer(k[t], k[t])) @ torch.diag(torch.exp(g[t])) @ s \
            + beta[t] * torch.outer(k[t], v[t])
        o_ref.append(0.5 * s.T @ q[t])
    o, final = naive_recurrent_kda(inputs["q"], inputs["k"], inputs["v"], inputs["g_raw"], inputs["beta"], 0.5,
                                   initial_state=state.view(1, 1, 8, 4))
    assert_close(o[0, :, 0], torch.stack(o_ref), 1e-14, "o", rng)
    assert_close(final[0, 0], s, 1e-14, "final state", rng)


# ---------------------------------------------------------------------------------------------------------
# Per-element loops, independent of the vectorised code


def naive_pieces(inputs: dict, gk: torch.Tensor, scale: float, chunk_size: int) -> dict:
    """Aqk, L, W, U, KG, QG by explicit Python loops over sequences, chunks, heads, rows and d."""
    q, k, v, beta = (inputs[n].to(F64) for n in ("q", "k", "v", "beta"))
    batch, tokens, heads, head_k = q.shape
    out = {name: torch.zeros(batch, tokens, heads, chunk_size, dtype=F64) for name in ("Aqk", "L")}
    out.update({name: torch.zeros(batch, tokens, heads, head_k, dtype=F64) for name in ("w", "kg", "qg")})
    out["u"] = torch.zeros_like(v)
    akk = forward_reference(inputs["q"], inputs["k"], inputs["v"], gk, inputs["beta"], scale,
                            cu_seqlens=inputs.get("cu_seqlens"), chunk_size=chunk_size).Akk
    ql, kl, vl, gl, bl, al = (x.tolist() for x in (q, k, v, gk.to(F64), beta, akk))
    for b in range(batch):
        for bos, eos in sequence_bounds(inputs):
            for c0 in range(bos, eos, chunk_size):
                rows = range(c0, min(c0 + chunk_size, eos))
                last = rows[-1]
                for h in range(heads):
                    for i in rows:
                        gi, qi, ki = gl[b][i][h], ql[b][i][h], kl[b][i][h]
                        for j in rows:
                            if j > i:
                                break
                            gj, kj = gl[b][j][h], kl[b][j][h]
                            qk = sum(qi[d] * kj[d] * 2.0 ** (gi[d] - gj[d]) for d in range(head_k))
                            kk = sum(ki[d] * kj[d] * 2.0 ** (gi[d] - gj[d]) for d in range(head_k))
                            out["Aqk"][b, i, h, j - c0] = scale * qk
                            if j < i:
                                out["L"][b, i, h, j - c0] = bl[b][i][h] * kk
                        for d in range(head_k):
                            out["kg"][b, i, h, d] = ki[d] * 2.0 ** (gl[b][last][h][d] - gi[d])
                            out["qg"][b, i, h, d] = qi[d] * 2.0 ** gi[d]
                            out["w"][b, i, h, d] = sum(al[b][i][h][j - c0] * bl[b][j][h] * kl[b][j][h][d]
                                                       * 2.0 ** gl[b][j][h][d] for j in rows if j <= i)
                        for e in range(v.shape[-1]):
                            out["u"][b, i, h, e] = sum(al[b][i][h][j - c0] * bl[b][j][h] * vl[b][j][h][e]
                                                       for j in rows if j <= i)
    return out


def chunk_blocks(x: torch.Tensor, inputs: dict, chunk_size: int):
    """Yield (batch, head, block) with block the square [n, n] part of a chunk of Aqk/Akk/L."""
    for b in range(x.shape[0]):
        for bos, eos in sequence_bounds(inputs):
            for c0 in range(bos, eos, chunk_size):
                n = min(c0 + chunk_size, eos) - c0
                for h in range(x.shape[2]):
                    yield b, h, x[b, c0:c0 + n, h, :n]


@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_reference_matches_per_element_loops(rng, layout):
    chunk_size, head_k = 64, 8
    if layout == "dense":
        inputs = make_inputs(2, 80, 2, head_k, 4, generator=rng)          # chunks of 64 and 16 rows
    else:
        inputs = make_inputs(1, 80, 2, head_k, 4, cu_seqlens=packed_cu_seqlens([3, 67, 10]), generator=rng)
    scale = 0.3
    gk = inputs["gk"]
    ref = forward_reference(inputs["q"], inputs["k"], inputs["v"], gk, inputs["beta"], scale,
                            cu_seqlens=inputs.get("cu_seqlens"), chunk_size=chunk_size, output_qg=True)
    loops = naive_pieces(inputs, gk, scale, chunk_size)
    for name in ("Aqk", "w", "u", "kg", "qg"):
        assert_close(getattr(ref, name), loops[name], LOOP_TOL, name, rng)
    worst = 0.0
    for (_, _, akk), (_, _, strict_l) in zip(chunk_blocks(ref.Akk, inputs, chunk_size),
                                             chunk_blocks(loops["L"], inputs, chunk_size)):
        eye = torch.eye(akk.shape[0], dtype=F64)
        worst = max(worst, (akk @ (eye + strict_l) - eye).abs().max().item())
        worst = max(worst, ((eye + strict_l) @ akk - eye).abs().max().item())
    assert worst <= LOOP_TOL, f"max |Akk (I + L) - I| = {worst:.3e} ({tag(rng)})"


# ---------------------------------------------------------------------------------------------------------
# Structure and precision


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_triangular_structure_is_exact(rng, layout, dtype):
    if layout == "dense":
        inputs = make_inputs(2, 200, 2, generator=rng)
    else:
        inputs = make_inputs(1, 320, 2, cu_seqlens=packed_cu_seqlens(shuffled_lengths(rng)), generator=rng)
    ref = forward_reference(inputs["q"], inputs["k"], inputs["v"], inputs["gk"], inputs["beta"],
                            cu_seqlens=inputs.get("cu_seqlens"), dtype=dtype)
    pos = position_in_chunk(inputs, 64).view(1, -1, 1, 1)
    col = torch.arange(64).view(1, 1, 1, -1)
    # Columns past the row's own position are above the diagonal, or past a partial chunk's last row.
    upper = (col > pos).expand_as(ref.Akk)
    diag = (col == pos).expand_as(ref.Akk)
    assert ref.Akk.dtype == dtype and ref.Aqk.dtype == dtype
    assert (ref.Akk[diag] == 1).all(), f"Akk diagonal is not exactly 1 ({tag(rng)})"
    assert (ref.Akk[upper] == 0).all(), f"Akk upper triangle is not exactly 0 ({tag(rng)})"
    assert (ref.Aqk[upper] == 0).all(), f"Aqk upper triangle is not exactly 0 ({tag(rng)})"
    assert (ref.Aqk[diag] != 0).all(), f"Aqk diagonal (inclusive lower triangle) has zeros ({tag(rng)})"
    for x in ref:
        assert x is None or torch.isfinite(x).all()


@pytest.mark.parametrize("beta_dtype", [torch.bfloat16, torch.float32])
def test_fp32_reference_close_to_fp64(rng, beta_dtype):
    inputs = make_inputs(2, 200, 2, beta_dtype=beta_dtype, generator=rng)
    args = [inputs[n] for n in ("q", "k", "v", "gk", "beta")]
    ref64 = forward_reference(*args, output_qg=True, dtype=torch.float64)
    ref32 = forward_reference(*args, output_qg=True, dtype=torch.float32)
    for name in ForwardOutput._fields:
        assert getattr(ref32, name).dtype == torch.float32
        assert_close(getattr(ref32, name), getattr(ref64, name), FP32_TOL, name, rng)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_varlen_equals_per_sequence_dense_runs(rng, cu_dtype, dtype):
    lengths = shuffled_lengths(rng)
    inputs = make_inputs(1, sum(lengths), 2, cu_seqlens=packed_cu_seqlens(lengths, cu_dtype), generator=rng)
    args = [inputs[n] for n in ("q", "k", "v", "gk", "beta")]
    packed = forward_reference(*args, cu_seqlens=inputs["cu_seqlens"], output_qg=True, dtype=dtype)
    for bos, eos in sequence_bounds(inputs):
        alone = forward_reference(*(x[:, bos:eos] for x in args), output_qg=True, dtype=dtype)
        for name in ForwardOutput._fields:
            assert torch.equal(getattr(packed, name)[:, bos:eos], getattr(alone, name)), \
                f"{name} of the sequence [{bos}, {eos}) differs from its dense run ({tag(rng)})"


def test_equal_length_batch_equals_packed(rng):
    # Three sequences of 150 rows: as a B=3 batch (gate cumsum restarts per row of the batch) and packed.
    dense = make_inputs(3, 150, 2, generator=rng)
    args = [dense[n] for n in ("q", "k", "v", "gk", "beta")]
    packed_args = [x.reshape(1, 450, *x.shape[2:]) for x in args]
    cu = packed_cu_seqlens([150, 150, 150])
    a = forward_reference(*args, output_qg=True)
    b = forward_reference(*packed_args, cu_seqlens=cu, output_qg=True)
    for name in ForwardOutput._fields:
        assert torch.equal(getattr(a, name).reshape(getattr(b, name).shape), getattr(b, name)), name


def test_shapes_dtypes_and_defaults(rng):
    inputs = make_inputs(2, 70, 3, 64, 32, generator=rng)
    args = [inputs[n] for n in ("q", "k", "v", "gk", "beta")]
    ref = forward_reference(*args)
    assert ref.qg is None
    assert ref.Aqk.shape == ref.Akk.shape == (2, 70, 3, 64)
    assert ref.w.shape == ref.kg.shape == (2, 70, 3, 64)
    assert ref.u.shape == (2, 70, 3, 32)
    assert all(x.dtype == F64 and x.is_contiguous() for x in ref if x is not None)
    explicit = forward_reference(*args, 64 ** -0.5, output_qg=True)
    assert torch.equal(explicit.Aqk, ref.Aqk) and explicit.qg.shape == (2, 70, 3, 64)
    ref32 = forward_reference(*args, chunk_size=32)
    assert ref32.Aqk.shape == (2, 70, 3, 32)
    with pytest.raises(ValueError, match="batch size must be 1"):
        forward_reference(*args, cu_seqlens=packed_cu_seqlens([35, 35]))


# ---------------------------------------------------------------------------------------------------------
# make_inputs and relative_error


@pytest.mark.parametrize("lower_bound", [-5.0, -1.0])
def test_make_inputs_gate_restarts_and_bound(rng, lower_bound):
    lengths = [5, 65, 130]
    cu = packed_cu_seqlens(lengths, torch.int64)
    for inputs in (make_inputs(2, 200, 2, 64, 32, lower_bound=lower_bound, generator=rng),
                   make_inputs(1, 200, 2, 64, 32, cu_seqlens=cu, lower_bound=lower_bound, generator=rng)):
        g_raw, gk = inputs["g_raw"], inputs["gk"]
        assert gk.dtype == g_raw.dtype == torch.float32
        assert gk.shape == g_raw.shape == inputs["q"].shape
        assert inputs["q"].dtype == inputs["k"].dtype == inputs["v"].dtype == torch.bfloat16
        assert inputs["beta"].dtype == torch.bfloat16 and inputs["beta"].shape == inputs["q"].shape[:3]
        assert all(x.is_contiguous() for x in inputs.values())
        norms = torch.linalg.vector_norm(inputs["k"].to(F64), dim=-1)
        assert ((norms - 1).abs() < 1e-2).all()
        assert (g_raw >= lower_bound).all() and (g_raw < 0).all(), tag(rng)
        assert (gk <= 0).all()
        pos = position_in_chunk(inputs, 64)
        starts = (pos == 0).nonzero().flatten().tolist()
        expected_starts = [0, 64, 128, 192] if "cu_seqlens" not in inputs else [0, 5, 69, 70, 134, 198]
        assert starts == expected_starts
        # A chunk or sequence start holds the single-term sum; every other row adds one step to the previous.
        assert torch.equal(gk[:, starts], g_raw[:, starts] * RCP_LN2), tag(rng)
        inner = (pos != 0).nonzero().flatten()
        step = gk[:, inner] - gk[:, inner - 1]
        assert torch.allclose(step, g_raw[:, inner] * RCP_LN2, rtol=0, atol=1e-3), tag(rng)
        assert (step >= lower_bound * RCP_LN2 - 1e-3).all() and (step <= 1e-3).all(), tag(rng)
        assert not torch.equal(gk[:, inner], g_raw[:, inner] * RCP_LN2)
    # The same seed reproduces the same inputs.
    first, again = (make_inputs(1, 10, 1, generator=torch.Generator().manual_seed(7)) for _ in range(2))
    assert all(torch.equal(first[name], again[name]) for name in first)


def test_make_inputs_beta_dtype(rng):
    inputs = make_inputs(1, 3, 1, beta_dtype=torch.float32, generator=rng)
    assert inputs["beta"].dtype == torch.float32 and ((inputs["beta"] > 0) & (inputs["beta"] < 1)).all()


def test_relative_error():
    ref = torch.tensor([3.0, 4.0])
    assert relative_error(ref, ref) == 0.0
    assert relative_error(torch.tensor([3.0, 5.0]), ref) == pytest.approx(0.2)
    assert math.isnan(relative_error(torch.tensor([math.nan, 4.0]), ref))
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_error(ref.to(torch.bfloat16), ref.double()) == 0.0


def test_reference_does_not_import_the_api():
    # The reference checks the API; importing it from the API would tie the two (kdajit.outputs is the leaf).
    tree = ast.parse(Path(reference.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert not {m for m in imported if m and m.startswith(("kdajit.api", "kdajit.cache", "kdajit.compiler"))}
    tree = ast.parse(Path(outputs.__file__).read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("kdajit")]
    assert ForwardOutput is kdajit.ForwardOutput is kdajit.api.ForwardOutput is outputs.ForwardOutput


def test_grouped_value_heads_use_query_head_h_over_group(rng):
    """Value head h of a grouped call (HV = 3H) reads q, k of head h // 3 (FLA's mapping, not h % H)."""
    H, group = 2, 3
    x = make_inputs(1, 100, H, 16, 16, value_heads=H * group, generator=rng)
    grouped = forward_reference(x["q"], x["k"], x["v"], x["gk"], x["beta"], 0.3, output_qg=True)
    assert grouped.Aqk.shape == (1, 100, H * group, 64) and grouped.w.shape == x["gk"].shape
    for h in range(H * group):
        alone = forward_reference(x["q"][:, :, h // group, None], x["k"][:, :, h // group, None],
                                  x["v"][:, :, h, None], x["gk"][:, :, h, None], x["beta"][:, :, h, None], 0.3,
                                  output_qg=True)
        for name, piece in alone._asdict().items():
            assert torch.equal(getattr(grouped, name)[:, :, h, None], piece), (name, h)
    with pytest.raises(ValueError, match="multiple of H"):
        forward_reference(x["q"], x["k"], x["v"][:, :, :5], x["gk"][:, :, :5], x["beta"][:, :, :5])
