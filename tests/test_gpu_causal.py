"""GPU tests of causal bit-invariance: no output row's bits depend on later tokens (docs/numerics.md).

Every row of Aqk, Akk, W, U and QG depends only on the inputs of rows <= it inside its chunk, so
appending tokens to a sequence, or changing any input of later tokens, leaves the earlier rows
bit-identical. KG[i] depends on the chunk's last valid row by definition: it is compared only for
chunks that end before the first changed row. The offsets put the end of the shared prefix at
either side of every 8- and 16-row boundary inside a chunk (1, 7, 8, 9, 15, 16, 17, 63).
"""
import pytest
import torch

import kdajit
from kdajit import reference
from kdajit.outputs import BETA_TORCH_DTYPES as BETA
from test_gpu_forward import INPUTS, poisoned_out, run, seed  # noqa: F401  (seed is a fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

OFFSETS = (1, 7, 8, 9, 15, 16, 17, 63)
CAUSAL_OUTPUTS = ("Aqk", "Akk", "w", "u", "qg")


def assert_rows_equal(a, b, rows_a: slice, rows_b: slice, kg_rows: int, what: str) -> None:
    """Bitwise equality of rows `rows_a` of `a` and `rows_b` of `b` for every causal output, and of
    the first `kg_rows` rows of those ranges for KG."""
    for name in CAUSAL_OUTPUTS + ("kg",):
        x, y = getattr(a, name)[:, rows_a], getattr(b, name)[:, rows_b]
        if name == "kg":
            x, y = x[:, :kg_rows], y[:, :kg_rows]
        if not torch.equal(x.view(torch.int16), y.view(torch.int16)):
            bad = (x.view(torch.int16) != y.view(torch.int16)).nonzero()
            raise AssertionError(f"{what}: {name} differs in {len(bad)} elements, first at "
                                 f"[batch, row, head, col] {bad[0].tolist()}")


def complete_chunk_rows(rows: int, chunk: int = 64) -> int:
    return rows // chunk * chunk


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("beta", ["bf16", "fp32"])
def test_appending_tokens_keeps_earlier_rows(seed, offset, beta):
    prefix = 64 + offset  # one whole chunk, then a partial one ending `offset` rows in
    x = reference.make_inputs(2, prefix + 58, 4, beta_dtype=BETA[beta], device="cuda")
    longer = run(x)
    shorter = run({n: x[n][:, :prefix].contiguous() for n in INPUTS})
    assert_rows_equal(longer, shorter, slice(0, prefix), slice(0, prefix), complete_chunk_rows(prefix),
                      f"dense prefix of {prefix} tokens vs the same tokens followed by 58 more")


@pytest.mark.parametrize("offset", OFFSETS)
def test_appending_tokens_inside_a_varlen_pack(seed, offset):
    before, after, extra = 37, 50, 23
    prefix = offset + 64 * (offset % 2)  # a partial first chunk, or a whole chunk and a partial one
    total = before + prefix + extra + after
    cu_long = torch.tensor([0, before, before + prefix + extra, total], dtype=torch.int32)
    x = reference.make_inputs(1, total, 4, beta_dtype=torch.float32, cu_seqlens=cu_long, device="cuda")
    cu_long = x["cu_seqlens"]
    # The shorter pack: the same tokens with the `extra` rows of the middle sequence left out.
    keep = torch.cat([torch.arange(0, before + prefix), torch.arange(before + prefix + extra, total)]).cuda()
    short_inputs = {n: x[n].index_select(1, keep).contiguous() for n in INPUTS}
    # Chunk-local gates restart at every sequence start, so the kept rows' gk is still valid.
    cu_short = torch.tensor([0, before, before + prefix, total - extra], dtype=torch.int32, device="cuda")
    longer = run(x, cu_long)
    shorter = run(short_inputs, cu_short)
    middle = slice(before, before + prefix)
    assert_rows_equal(longer, shorter, slice(0, before), slice(0, before), before, "sequence before")
    assert_rows_equal(longer, shorter, middle, middle, complete_chunk_rows(prefix),
                      f"varlen prefix of {prefix} tokens vs the same followed by {extra} more")
    assert_rows_equal(longer, shorter, slice(total - after, total), slice(total - extra - after, total - extra),
                      after, "sequence after")


def changed_later_tokens(x: dict, name: str, first: int, generator: torch.Generator) -> dict:
    """A copy of the inputs in which input `name` of every token >= `first` is drawn afresh."""
    fresh = reference.make_inputs(*x["q"].shape[:3], beta_dtype=x["beta"].dtype, device="cuda",
                                  generator=generator)
    y = {n: x[n].clone() for n in INPUTS}
    if name == "gk":  # new per-token gates for the later tokens; earlier rows' cumulative gate is unchanged
        g_raw = x["g_raw"].cpu()
        g_raw[:, first:] = fresh["g_raw"][:, first:].cpu()
        # On the CPU, as make_inputs sums it: the prefix's running sums are the same operations.
        y["gk"] = reference.chunk_local_cumsum(g_raw, 64, scale=reference.RCP_LN2).cuda()
        assert torch.equal(y["gk"][:, :first], x["gk"][:, :first])
    else:
        y[name][:, first:] = fresh[name][:, first:]
    return y


@pytest.mark.parametrize("name", INPUTS)
@pytest.mark.parametrize("offset", OFFSETS)
def test_later_inputs_do_not_change_earlier_rows(seed, name, offset):
    generator = torch.Generator().manual_seed(seed + 1)
    x = reference.make_inputs(1, 128, 4, beta_dtype=torch.float32, device="cuda")
    y = changed_later_tokens(x, name, offset, generator)
    assert not torch.equal(x[name], y[name])
    assert_rows_equal(run(x), run(y), slice(0, offset), slice(0, offset), 0,
                      f"{name} of tokens >= {offset} changed")



def poisoned(x: dict, index) -> dict:
    """A copy of the inputs whose elements at `index` (of each [B, T, H(, D)] tensor) are NaN."""
    y = {n: x[n].clone() for n in INPUTS}
    for n in INPUTS:
        y[n][index] = float("nan")
    return y



def route_outputs(x: dict, cu, output_qg: bool, safe_gate: bool = True) -> list:
    """`forward`'s outputs (Aqk, Akk, w, u, kg and qg with `output_qg`) and the standalone `intra`'s (Aqk, Akk), each
    into NaN-poisoned buffers; NaN inputs make NaN outputs where they reach, so nothing asserts them all written."""
    B, T, H, K = x["gk"].shape
    out = poisoned_out(B, T, H, K, x["v"].shape[-1], qg=output_qg)
    res = kdajit.forward(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, output_qg=output_qg,
                         safe_gate=safe_gate, out=out)
    intra_out = poisoned_out(B, T, H, K, x["v"].shape[-1], qg=False)
    Aqk, Akk = kdajit.intra(x["q"], x["k"], x["gk"], x["beta"], cu_seqlens=cu, safe_gate=safe_gate, out=intra_out)
    torch.cuda.synchronize()
    return [t for t in res if t is not None] + [Aqk, Akk]


def assert_same_where(clean: list, dirty: list, index, what: str) -> None:
    """Every output of the clean run is finite at `index` and bit-identical to the dirty run's there."""
    for i, (a, b) in enumerate(zip(clean, dirty)):
        a, b = a[index], b[index]
        assert not torch.isnan(a).any(), f"output {i} at {what}: not written"
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"output {i} at {what}: reached by NaN inputs"


# (head size, gate path): the any-gate kernels are precompiled at K = 128 only
ISOLATION_CASES = [(64, True), (128, True), (128, False)]


@pytest.mark.parametrize("output_qg", [False, True])
@pytest.mark.parametrize("head_dim, safe_gate", ISOLATION_CASES)
def test_a_nan_sequence_does_not_reach_the_one_before(seed, head_dim, safe_gate, output_qg):
    """The kernels may load a whole chunk of rows, past a sequence's end into the next one's (TMA loads do): those
    rows must reach no output of the sequence before, whatever they hold."""
    lengths = (100, 50)  # the first sequence ends 36 rows into its second chunk
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device="cuda")
    x = reference.make_inputs(1, sum(lengths), 4, head_dim, head_dim, cu_seqlens=cu, device="cuda")
    y = poisoned(x, (slice(None), slice(lengths[0], None)))
    assert_same_where(route_outputs(x, cu, output_qg, safe_gate), route_outputs(y, cu, output_qg, safe_gate),
                      (slice(None), slice(0, lengths[0])), "the sequence before NaN tokens")


@pytest.mark.parametrize("output_qg", [False, True])
@pytest.mark.parametrize("head_dim, safe_gate", ISOLATION_CASES)
def test_a_nan_head_or_batch_does_not_reach_the_others(seed, head_dim, safe_gate, output_qg):
    """Each head reads only its own columns (TMA boxes also read the next head's first columns, into the shared row
    pad that nothing reads) and each batch row only its own tokens; T = 50 is shorter than a chunk."""
    x = reference.make_inputs(2, 50, 4, head_dim, head_dim, device="cuda")
    clean = route_outputs(x, None, output_qg, safe_gate)
    for head in (0, 1, 3):
        assert_same_where(clean, route_outputs(poisoned(x, (slice(None), slice(None), 2)), None, output_qg, safe_gate),
                          (slice(None), slice(None), head), f"head {head} beside a NaN head 2")
    assert_same_where(clean, route_outputs(poisoned(x, (1,)), None, output_qg, safe_gate), (0,),
                      "batch 0 before a NaN batch 1")
