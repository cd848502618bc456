"""Per-tile device functions of the inverse: Akk = (I + L)^-1 from an fp32 L tile in shared memory.

Shared by `templates/akk_inverse.py` (L loaded from the global workspace) and
`templates/fused_forward.py` (L written to shared memory by the intra phase). The method, the warp
roles and the arithmetic order are documented in `templates/akk_inverse.py` and docs/numerics.md.

Shared tensors (row-major, unpadded): sL [C, C] fp32 with rows >= valid_rows zero; its lower triangle
is read-only, its upper triangle (never L data) holds the unrounded X rows of the lower half and the
merge products, and the last merge's product reuses the top half's L (`fp32_x`, `product_view`);
sX [C, C] in the io dtype (bf16 or fp16), the result; sX00 [C/2, C/2] fp32, the unrounded X rows of
the upper half. 4 warps, 128 threads.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from kdajit.templates.common import RN, sync_group

_PANEL = 4  # columns per panel: one 16-byte shared load of 4 fp32 L values per row
BLOCK = 16  # rows of the diagonal blocks inverted by forward substitution
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


def make_l_load_copy(num_threads: int, chunk: int) -> cute.TiledCopy:
    """16-byte global loads of fp32 L rows: chunk / 4 threads x 4 values per row."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32, num_bits_per_copy=128)
    per_row = chunk // 4
    return cute.make_tiled_copy_tv(atom, cute.make_layout((num_threads // per_row, per_row), stride=(per_row, 1)),
                                   cute.make_layout((1, 4)))


def make_akk_store_copy(num_threads: int, io, chunk: int) -> cute.TiledCopy:
    """16-byte stores of Akk rows (`io`: bf16 or fp16): chunk / 8 threads x 8 values per row."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), io, num_bits_per_copy=128)
    per_row = chunk // 8
    return cute.make_tiled_copy_tv(atom, cute.make_layout((num_threads // per_row, per_row), stride=(per_row, 1)),
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
    the steps (`sync_group`): None, the whole CTA; (id, 128) when other warps run other work meanwhile.
    sL is clobbered: its upper triangle holds fp32 X blocks and products (`fp32_x`, `product_view`)."""
    C = cute.size(sL, mode=[0])
    blocks = C // BLOCK
    # 2. The 16 x 16 diagonal blocks by forward substitution, one warp each (lanes 0-15: one column
    #    each); lanes 16-31 write the zeros above the diagonal blocks. The warps of one half of the tile
    #    run one copy of the substitution, on their block chosen at run time (smaller code: the halves keep
    #    their fp32 X rows in different buffers, `fp32_x`).
    per_half = blocks // 2
    for half in cutlass.range_constexpr(2):
        if warp_idx // per_half == half:
            if lane < BLOCK:
                d = warp_idx * BLOCK
                forward_substitute(block_view(sL, d, d), block_view(sX, d, d),
                                   block_view(fp32_x(sL, sX00, half * per_half * BLOCK), d, d), lane,
                                   [None] * BLOCK, 0, BLOCK, True)
    for b in cutlass.range_constexpr(blocks):
        if warp_idx == b:
            if lane >= BLOCK:
                zero_upper_blocks(sX, sX00, zero_tasks(C)[b::blocks], lane - BLOCK)
    sync_group(group)

    # 3.-4. Doubling merges: for each pair of size-S diagonal blocks (rows a.., then u = a + S..),
    #    T = L[u, a] X[a, a], then X[u, a] = -(X[u, u] T); S = 16, 32.
    for level in cutlass.range_constexpr(merge_levels(C)):
        S = BLOCK << level
        pairs = C // (2 * S)
        warps_per_pair = NUM_WARPS // pairs
        groups = warps_per_pair * (32 // S)
        for p in cutlass.range_constexpr(pairs):
            if warp_idx // warps_per_pair == p:
                a = 2 * p * S
                row_group = (warp_idx % warps_per_pair) * (32 // S) + lane // S
                left_product(sL, fp32_x(sL, sX00, a), product_view(sL, a, S), a, S, groups, row_group, lane % S)
        sync_group(group)
        for p in cutlass.range_constexpr(pairs):
            if warp_idx // warps_per_pair == p:
                a = 2 * p * S
                row_group = (warp_idx % warps_per_pair) * (32 // S) + lane // S
                keep = fp32_x(sL, sX00, a + S) if 2 * S < C else None
                right_product(sX, fp32_x(sL, sX00, a + S), keep, product_view(sL, a, S), a, S, groups,
                              row_group, lane % S)
        if level + 1 < merge_levels(C):
            sync_group(group)


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


class _Shifted:
    """A view t[r, c] = base[r - row0, c - col0] (absolute tile coordinates onto a buffer)."""

    def __init__(self, base, row0: int, col0: int) -> None:
        self.base, self.row0, self.col0 = base, row0, col0

    def __getitem__(self, rc):
        return self.base[rc[0] - self.row0, rc[1] - self.col0]

    def __setitem__(self, rc, value) -> None:
        self.base[rc[0] - self.row0, rc[1] - self.col0] = value


def block_view(t, row0, col0):
    """v[i, j] = t[row0 + i, col0 + j] (tile coordinates when t is a `_Shifted`); row0, col0 may be run-time."""
    if isinstance(t, _Shifted):
        return cute.domain_offset((row0 - t.row0, col0 - t.col0), t.base)
    return cute.domain_offset((row0, col0), t)


def merge_levels(chunk: int) -> int:
    """Doubling merges from BLOCK-row diagonal blocks to the whole tile (2 at chunk 64, 1 at 32)."""
    assert chunk in (32, 64), chunk
    return (chunk // BLOCK).bit_length() - 1


def fp32_x(sL, sX00, row: int):
    """Where the unrounded X rows of the half holding tile row `row` live, in tile coordinates:
    rows < C/2 in sX00; rows >= C/2 (columns >= C/2) in sL's upper-right block, sL[r - C/2, c]."""
    half = cute.size(sL, mode=[0]) // 2
    return sX00 if row < half else _Shifted(sL, half, 0)


def product_view(sL, a: int, S: int):
    """T = L[u, a] X[a, a] of the pair of size-S blocks at rows a (u = a + S), as T[i, j] (i, j < S): in
    sL[a:a+S, u:u+S] (above the diagonal, never L data) below the last level; at the last level
    (S = C/2) in sL[0:S, 0:S], the top half's L, dead once the earlier levels have read it."""
    if 2 * S < cute.size(sL, mode=[0]):
        return _Shifted(sL, -a, -(a + S))
    return sL


def zero_tasks(chunk: int) -> list:
    """The BLOCK x BLOCK blocks above the diagonal blocks that must hold +0: all of io X's upper
    blocks, and fp32 X's upper blocks in the top half (read as X[a, a] by the last level's product)."""
    blocks = chunk // BLOCK
    upper = [(r, c) for r in range(blocks) for c in range(r + 1, blocks)]
    return [("io", r, c) for r, c in upper] + [("fp32", r, c) for r, c in upper if c < blocks // 2]


def zero_upper_blocks(sX, sX00, tasks, col):
    """Column `col` of each task's block := +0."""
    for kind, r, c in tasks:
        target = sX if kind == "io" else sX00
        for s in range(BLOCK):
            target[r * BLOCK + s, c * BLOCK + col] = target.element_type(0.0)


def left_product(sL, x_top, product, a, S, groups, row_group, col):
    """product[i, col] = sum_k L[a+S+i, a+k] X[a+k, a+col] over k = 0 .. S-1 ascending (one fp32 chain;
    the terms k < col multiply X's +0 above the diagonal), for rows i = groups * m + row_group."""
    u = a + S
    x = [x_top[a + k, a + col] for k in range(S)]
    for m in range(S // groups):
        i = groups * m + row_group
        acc = None
        for k in range(S):
            acc = chain_step(acc, sL[u + i, a + k], x[k])
        product[i, col] = acc


def right_product(sX, x_bottom, keep, product, a, S, groups, row_group, col):
    """X[u+i, a+col] = -(sum_k X[u+i, u+k] product[k, col] over k = 0 .. i ascending), u = a + S, a zero
    stored as +0, for rows i = groups * m + row_group: to sX (io dtype) and, when `keep` is given, to
    keep (fp32, read by the next level). The chain runs to the group's last row with the terms k > i
    left out by a select, so a row never reads a later row's product (not even as 0 x inf)."""
    u = a + S
    t = [product[k, col] for k in range(S)]
    for m in range(S // groups):
        i = groups * m + row_group
        acc = None
        for k in range(groups * m + groups):
            term = chain_step(acc, x_bottom[u + i, u + k], t[k])
            acc = term if k <= groups * m else cutlass.Float32(cutlass.select_(i >= k, term, acc))
        x = finalize(acc, col, i, False)
        sX[u + i, a + col] = x.to(sX.element_type)
        if keep is not None:
            keep[u + i, a + col] = x


def chain_step(acc, l_is, x_s):
    """acc + l_is * x_s rounded once; the first term of a chain is the rounded product."""
    if acc is None:
        return cute.math.mul(l_is, x_s, rounding=RN)
    return cute.math.fma(l_is, x_s, acc, rounding=RN)


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
