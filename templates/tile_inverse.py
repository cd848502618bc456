"""Per-tile device functions of the inverse: Akk = (I + L)^-1 from an fp32 L tile in shared memory.

Shared by `templates/akk_inverse.py` (L loaded from the global workspace) and
`templates/fused_forward.py` (L written to shared memory by the intra phase). The method, the warp
roles and the arithmetic order are documented in `templates/akk_inverse.py` and docs/numerics.md.

Shared tensors (row-major, unpadded): sL [C, C] fp32 with rows >= valid_rows zero, read-only
except rows 0..C/4-1, which step 3 reuses as chain-state storage (`chain_states_view`); sX [C, C]
in the io dtype (bf16 or fp16), the result; sX00 [C/2, C/2] fp32, the upper-left block kept
unrounded. 4 warps, 128 threads.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from kdajit.templates.common import sync_group

_RN = cute.math.RoundingMode.NEAREST_EVEN
_PANEL = 4  # columns per panel: one 16-byte shared load of 4 fp32 L values per row
NUM_WARPS = 4


def l_tile_layout(chunk: int):
    """The fp32 L tile (also the layout of the global workspace rows)."""
    return cute.make_layout((chunk, chunk), stride=(chunk, 1))


def akk_tile_layout(chunk: int):
    """The result tile sX (io dtype)."""
    return cute.make_layout((chunk, chunk), stride=(chunk, 1))


def x00_layout(chunk: int):
    """The fp32 upper-left block X00."""
    half = chunk // 2
    return cute.make_layout((half, half), stride=(half, 1))


def chain_states_view(sL: cute.Tensor) -> cute.Tensor:
    """X10 chain states (step 3 -> 4) in L rows 0..C/4-1: after step 2 nothing reads L rows < C/2."""
    half = cute.size(sL, mode=[0]) // 2
    return cute.make_tensor(sL.iterator, cute.make_layout((half, half), stride=(half, 1)))


def make_l_load_copy(num_threads: int) -> cute.TiledCopy:
    """16-byte global loads of fp32 L rows: 16 threads x 4 values per 64-column row."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, cute.make_layout((num_threads // 16, 16), stride=(16, 1)),
                                   cute.make_layout((1, 4)))


def make_akk_store_copy(num_threads: int, io) -> cute.TiledCopy:
    """16-byte stores of Akk rows (`io`: bf16 or fp16): 8 threads x 8 values per 64-column row."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), io, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, cute.make_layout((num_threads // 8, 8), stride=(8, 1)),
                                   cute.make_layout((1, 8)))


@cute.jit
def zero_rows_from(load_copy: cute.TiledCopy, sL: cute.Tensor, tidx: cutlass.Int32,
                   valid_rows: cutlass.Int32):
    """sL rows >= valid_rows := +0 (the state the standalone kernel's L load leaves there)."""
    cTile = cute.make_identity_tensor(sL.shape)
    thr = load_copy.get_slice(tidx)
    tLsL = thr.partition_D(sL)
    tLcL = thr.partition_D(cTile)
    rZero = cute.make_rmem_tensor_like(tLsL[None, 0, None])
    rZero.fill(0.0)
    for m in cutlass.range_constexpr(cute.size(tLsL, mode=[1])):
        if tLcL[0, m, 0][0] >= valid_rows:
            cute.autovec_copy(rZero, tLsL[None, m, None])


@cute.jit
def invert_tile(sL: cute.Tensor, sX: cute.Tensor, sX00: cute.Tensor, warp_idx: cutlass.Int32,
                lane: cutlass.Int32, group: cutlass.Constexpr = None):
    """Steps 2-4 of templates/akk_inverse.py: sX = io((I + sL)^-1), io = sX's element type, by warps 0-3.
    The caller synchronizes before (sL complete) and after (sX complete). `group`: the barrier between
    the steps (`sync_group`): None, the whole CTA; (id, 128) when other warps run other work meanwhile."""
    C = cute.size(sL, mode=[0])
    half = C // 2
    sChain = chain_states_view(sL)
    # 2. Diagonal blocks X00 (kept in fp32 for step 3) and X11; zero upper-right block.
    if warp_idx == 0:
        forward_substitute(sL, sX, sX00, lane, [None] * C, 0, half, True)
    if warp_idx == 1:
        forward_substitute(sL, sX, None, half + lane, [None] * C, half, C, True)
    if warp_idx == 3:
        for s in cutlass.range_constexpr(half):
            sX[s, half + lane] = sX.element_type(0.0)
    sync_group(group)

    # 3. X10 chains over s < half, half / NUM_WARPS rows per warp.
    lower_left_prefix(sL, sX00, sChain, lane, warp_idx)
    sync_group(group)

    # 4. X10: continue those chains over s >= half and finalize.
    if warp_idx == 2:
        acc = [None] * C
        for i in cutlass.range_constexpr(half, C):
            acc[i] = sChain[i - half, lane]
        forward_substitute(sL, sX, None, lane, acc, half, C, False)


@cute.jit
def store_akk_rows(store_copy: cute.TiledCopy, sX: cute.Tensor, gAkk: cute.Tensor, tidx: cutlass.Int32,
                   valid_rows: cutlass.Int32):
    """Step 5: sX -> gAkk rows < valid_rows with 16-byte stores."""
    cTile = cute.make_identity_tensor(sX.shape)
    thr_store = store_copy.get_slice(tidx)
    tSsX = thr_store.partition_S(sX)
    tSgA = thr_store.partition_D(gAkk)
    tScA = thr_store.partition_D(cTile)
    tSrX = cute.make_rmem_tensor_like(tSsX)
    cute.autovec_copy(tSsX, tSrX)
    for m in cutlass.range_constexpr(cute.size(tSgA, mode=[1])):
        if tScA[0, m, 0][0] < valid_rows:
            cute.copy(store_copy, tSrX[None, m, None], tSgA[None, m, None])


# Trace-time helpers: plain Python called from the functions above. They emit straight-line code
# only (no runtime control flow), so their loops are Python loops, unrolled while tracing.

def forward_substitute(sL, sX, sXf, col, acc, begin, end, on_diagonal):
    """Finalize x_s of column `col` for s in [begin, end), advancing the chains of rows < end.

    `acc[i]` is row i's chain state (None before its first term); the chains have consumed
    every s < begin. Right-looking in panels of 4: the panel's own triangle, then 4 steps of
    each lower row with L[i, s0:s0+4] in one broadcast 16-byte load. `on_diagonal`: `col` may
    be >= s (diagonal blocks), so x_s needs the 0 / 1 selects. x_s goes to sX (io dtype) and, when
    `sXf` is given, to sXf[s, col] (fp32).
    """
    for p in range(begin // _PANEL, end // _PANEL):
        s0 = p * _PANEL
        x = [None] * _PANEL
        for k in range(_PANEL):
            s = s0 + k
            x[k] = finalize(acc[s], col, s, on_diagonal)
            sX[s, col] = x[k].to(sX.element_type)
            if sXf is not None:
                sXf[s, col] = x[k]
            for r in range(s + 1, s0 + _PANEL):
                acc[r] = chain_step(acc[r], sL[r, s], x[k])
        for i in range(s0 + _PANEL, end):
            for k in range(_PANEL):
                acc[i] = chain_step(acc[i], sL[i, s0 + k], x[k])


def lower_left_prefix(sL, sX00, sChain, lane, warp_idx):
    """Chains of X10 rows [half + rows * warp_idx, +rows), column `lane`, over s = 0 .. half-1
    (x_s from the fp32 X00), stored to sChain[i - half, lane]; rows = half / NUM_WARPS."""
    half = cute.size(sX00, mode=[0])
    rows = half // NUM_WARPS
    x = [None] * half
    for s in range(half):
        x[s] = sX00[s, lane]
    first = warp_idx * rows
    sL_rows = cute.domain_offset((half + first, 0), sL)
    sChain_rows = cute.domain_offset((first, 0), sChain)
    acc = [None] * rows
    for p in range(half // _PANEL):
        for r in range(rows):
            for k in range(_PANEL):
                s = p * _PANEL + k
                acc[r] = chain_step(acc[r], sL_rows[r, s], x[s])
    for r in range(rows):
        sChain_rows[r, lane] = acc[r]


def chain_step(acc, l_is, x_s):
    """acc + l_is * x_s rounded once; the first term of a chain is the rounded product."""
    if acc is None:
        return cute.math.mul(l_is, x_s, rounding=_RN)
    return cute.math.fma(l_is, x_s, acc, rounding=_RN)


def finalize(acc, col, row, on_diagonal):
    """x_row of column `col`: -acc (a zero as +0.0); on diagonal blocks 1 at col == row and 0
    for col > row."""
    zero = cutlass.Float32(0.0)
    below = zero
    if acc is not None:
        below = cutlass.Float32(cutlass.select_(acc == zero, zero, -acc))
    if not on_diagonal:
        return below
    on_or_below = cutlass.Float32(cutlass.select_(col == row, cutlass.Float32(1.0), below))
    return cutlass.Float32(cutlass.select_(col > row, zero, on_or_below))
