"""Per-tile device functions of the inverse: Akk = (I + L)^-1 from an fp32 L tile in shared memory.

Shared by `templates/akk_inverse.py` (L loaded from the global workspace) and
`templates/fused_forward.py` (L written to shared memory by the intra phase). The method, the warp
roles and the arithmetic order are documented in `templates/akk_inverse.py` and docs/numerics.md.

Shared tensors (row-major; sL padded, sX00 swizzled: `l_tile_layout`, `x00_layout`): sL [C, C] fp32 with rows
>= valid_rows zero; its lower triangle
is read-only, its upper triangle (never L data) holds the unrounded X rows of the lower half and the
merge products, and the last merge's product reuses the top half's L (`fp32_x`, `product_view`);
sX [C, C] in the io dtype (bf16 or fp16), the result; sX00 [C/2, C/2] fp32, the unrounded X rows of
the upper half. 4 warps, 128 threads.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from kdajit.templates.common import RN, TF32_MMA_SHAPE, make_tf32_mma, sync_group, tf32, tf32_round

_PANEL = 4  # columns per panel: one 16-byte shared load of 4 fp32 L values per row
BLOCK = 16  # rows of the diagonal blocks inverted by forward substitution
NUM_WARPS = 4
MMA_M, MMA_N, MMA_K = TF32_MMA_SHAPE  # the merges' output tile (16 x 8) and k-step (8)
L_PAD = 4  # fp32 elements after each row of the L tile (`l_tile_layout`)


def l_tile_layout(chunk: int):
    """The fp32 L tile: row-major with L_PAD extra elements per row, so that the merges' A-fragment reads (8
    rows x 4 columns) hit 32 different banks and their B-fragment reads (4 rows x 8 columns) 16."""
    return cute.make_layout((chunk, chunk), stride=(chunk + L_PAD, 1))


def l_tile_elements(chunk: int) -> int:
    """fp32 elements of the L tile's buffer."""
    return chunk * (chunk + L_PAD)


def akk_tile_layout(chunk: int):
    """The result tile sX (io dtype)."""
    return cute.make_layout((chunk, chunk), stride=(chunk, 1))


def x00_layout(chunk: int):
    """The fp32 upper-left block X00, [C/2, C/2] row-major and swizzled (no room for a pad in the fused kernel):
    the 4-element (16-byte) group of a column is XORed with the row mod 8, which spreads the merges' fragment
    reads over banks as L's pad does. 16-byte row segments stay contiguous. Accessed by coordinates only
    (`block_view` and `resolve` shift indices, never the tensor)."""
    half = chunk // 2
    return cute.make_composed_layout(cute.make_swizzle(3, 2, half.bit_length() - 3), 0,
                                     cute.make_layout((half, half), stride=(half, 1)))


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
    #    each); lanes 16-31 write the zeros above the diagonal blocks, a row each. Every warp runs one copy of the
    #    substitution, on its block chosen at run time; the halves keep their fp32 X rows in buffers of
    #    different layouts (`fp32_x`), so only those stores choose at run time (`_Either`): smaller code.
    per_half = blocks // 2
    if warp_idx < blocks and lane < BLOCK:  # one copy of the substitution: each half's fp32 rows by `_Either`
        d = warp_idx * BLOCK
        upper = warp_idx < per_half
        forward_substitute(block_view(sL, d, d), block_view(sX, d, d),
                           _Either(upper, block_view(fp32_x(sL, sX00, 0), d, d),
                                   block_view(fp32_x(sL, sX00, per_half * BLOCK), d, d)), lane,
                           [None] * BLOCK, 0, BLOCK, True)
    for b in cutlass.range_constexpr(blocks):
        if warp_idx == b:
            if lane >= BLOCK:
                zero_upper_blocks(sX, zero_tasks(C)[b::blocks], lane - BLOCK)
    sync_group(group)

    # 3.-4. Doubling merges: for each pair of size-S diagonal blocks (rows a.., then u = a + S..),
    #    T = L[u, a] X[a, a], then X[u, a] = -(X[u, u] T); S = 16, 32. Each is a set of 16 x 8 tiles
    #    (`pair_tiles`), one TF32 tensor-core product each, operands rounded to nearest (`tf32_product`).
    for level in cutlass.range_constexpr(merge_levels(C)):
        S = BLOCK << level
        pairs = C // (2 * S)
        warps_per_pair = NUM_WARPS // pairs
        pair_warp = warp_idx % warps_per_pair
        for p in cutlass.range_constexpr(pairs):
            if warp_idx // warps_per_pair == p:
                if pair_warp < S // MMA_N:
                    left_product(sL, sX00, 2 * p * S, S, pair_warp, lane)
        sync_group(group)
        for p in cutlass.range_constexpr(pairs):
            if warp_idx // warps_per_pair == p:
                if pair_warp < S // MMA_N:
                    right_product(sL, sX, sX00, 2 * p * S, S, pair_warp, lane)
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

    @property
    def element_type(self):
        return self.base.element_type

    def __getitem__(self, rc):
        return self.base[rc[0] - self.row0, rc[1] - self.col0]

    def __setitem__(self, rc, value) -> None:
        self.base[rc[0] - self.row0, rc[1] - self.col0] = value


class _Either:
    """A store-only view: v[r, c] = x writes first[r, c] where `cond` (run time) holds, else second[r, c]."""

    def __init__(self, cond, first, second) -> None:
        self.cond, self.first, self.second = cond, first, second

    def __setitem__(self, rc, value) -> None:
        store_either(self.cond, *resolve(self.first, *rc), *resolve(self.second, *rc), value)


@cute.jit
def store_either(cond, first: cute.Tensor, first_row, first_col, second: cute.Tensor, second_row, second_col,
                 value: cutlass.Float32):
    """first[first_row, first_col] = value where cond holds, else second[second_row, second_col]."""
    if cond:
        first[first_row, first_col] = value
    else:
        second[second_row, second_col] = value


def block_view(t, row0, col0):
    """v[i, j] = t[row0 + i, col0 + j] (tile coordinates when t is a `_Shifted`); row0, col0 may be run-time.
    A shift of the indices, not of the tensor, so it is right for X00's swizzled layout too."""
    base, row, col = resolve(t, row0, col0)
    return _Shifted(base, -row, -col)


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
    """The BLOCK x BLOCK blocks of the io-dtype X above its diagonal blocks: they must hold +0."""
    blocks = chunk // BLOCK
    return [(r, c) for r in range(blocks) for c in range(r + 1, blocks)]


def zero_upper_blocks(sX, tasks, row):
    """Row `row` of each task's block of sX := +0."""
    for r, c in tasks:
        zero_row_segment(sX, r * BLOCK + row, c * BLOCK, BLOCK)


@cute.jit
def zero_row_segment(sX: cute.Tensor, row: cutlass.Int32, col0: cutlass.Constexpr, cols: cutlass.Constexpr):
    """sX[row, col0 : col0 + cols] := +0 in 16-byte stores (a row of sX is contiguous; col0 and cols are multiples
    of 16 bytes)."""
    per_store = 128 // sX.element_type.width
    rZero = cute.make_rmem_tensor((per_store,), sX.element_type)
    rZero.fill(0.0)
    for part in cutlass.range_constexpr(cols // per_store):
        cute.autovec_copy(rZero, cute.local_tile(sX[row, None], (per_store,), (col0 // per_store + part,)))


def pair_tiles(S: int, warp):
    """The 16 x 8 tiles (m, n) of a pair's S x S products (T and X[u, a]) that the pair's warp `warp`
    (run time) computes: one per 16-row tile m, column tile n = warp for even m and S/8 - 1 - warp for odd
    m, which balances the k-steps of both products (T: S/8 - n, X[u, a]: 2m + 2). Only warps < S/8 have
    tiles (chunk 32 leaves two warps idle); the caller skips the others."""
    return [(m, warp if m % 2 == 0 else S // MMA_N - 1 - warp) for m in range(S // MMA_M)]


def left_product(sL, sX00, a, S, warp, lane):
    """T[i, j] = sum_k L[u+i, a+k] X[a+k, a+j], u = a + S, for this warp's tiles (`pair_tiles`) into
    `product_view`. For column tile n the k-steps before n (k < 8n <= j) multiply X's +0 above its diagonal
    and are left out: the sum runs over k-steps n .. S/8 - 1, ascending."""
    u = a + S
    product = product_view(sL, a, S)
    for m, n in pair_tiles(S, warp):
        acc, coords = tf32_product(lane, *resolve(sL, u + MMA_M * m, a),
                                   *resolve(fp32_x(sL, sX00, a), a, a + MMA_N * n), n, S // MMA_K)
        for v in range(cute.size(coords)):
            product[MMA_M * m + coords[v][0], MMA_N * n + coords[v][1]] = acc[v]


def right_product(sL, sX, sX00, a, S, warp, lane):
    """X[u+i, a+j] = -(sum_k X[u+i, u+k] T[k, j]), u = a + S, a zero as +0, for this warp's tiles: to sX (io
    dtype) and, below the last level, to the fp32 X of the next level (`fp32_x`). Tile m's sum runs over
    the k-steps 0 .. 2m + 1 ascending: the steps above X[u, u]'s diagonal are left out, so a row reads T
    rows of its own 16-row tile and earlier only."""
    u = a + S
    C = cute.size(sL, mode=[0])
    keep = fp32_x(sL, sX00, u) if 2 * S < C else None
    for m, n in pair_tiles(S, warp):
        acc, coords = tf32_product(lane, *resolve(fp32_x(sL, sX00, u), u + MMA_M * m, u),
                                   *resolve(product_view(sL, a, S), 0, MMA_N * n), 0, 2 * m + 2)
        for v in range(cute.size(coords)):
            row, col = u + MMA_M * m + coords[v][0], a + MMA_N * n + coords[v][1]
            x = finalize(acc[v], 0, 0, False)
            sX[row, col] = x.to(sX.element_type)
            if keep is not None:
                keep[row, col] = x


def resolve(t, row: int, col: int):
    """(tensor, row, col): tile coordinates (row, col) of `t` (a tensor or a `_Shifted` view) as
    coordinates of the tensor that holds them."""
    if isinstance(t, _Shifted):
        return t.base, row - t.row0, col - t.col0
    return t, row, col


@cute.jit
def tf32_product(lane: cutlass.Int32, sA: cute.Tensor, a_row: cutlass.Int32, a_col: cutlass.Int32,
                 sB: cute.Tensor, b_row: cutlass.Int32, b_col: cutlass.Int32, step_begin: cutlass.Int32,
                 step_end: cutlass.Int32):
    """One warp's 16 x 8 product sum_k A[i, k] B[k, j] over the k-steps [step_begin, step_end) of 8, with
    A[i, k] = sA[a_row + i, a_col + k] and B[k, j] = sB[b_row + k, b_col + j] (fp32 shared tensors, any
    layout: each fragment element is read at its own coordinate). Returns (the accumulator fragment, its
    (i, j) coordinates).

    Per k-step, ascending, one `mma.sync m16n8k8 tf32` into one fp32 accumulator from +0, on operands rounded to
    TF32 by `cvt.rna.tf32.f32` (`tf32_round`; to nearest, where FLA's Triton merges truncate)."""
    f32 = cutlass.Float32
    tiled_mma = make_tf32_mma()
    thr = tiled_mma.get_slice(lane)
    cA = thr.partition_A(cute.make_identity_tensor((MMA_M, MMA_K)))[None, None, 0]  # (i, k) per element
    cB = thr.partition_B(cute.make_identity_tensor((MMA_N, MMA_K)))[None, None, 0]  # (j, k) per element
    coords = thr.partition_C(cute.make_identity_tensor((MMA_M, MMA_N)))
    acc = cute.make_rmem_tensor(coords.shape, f32)
    acc.fill(0.0)
    rA = cute.make_rmem_tensor(cA.shape, f32)
    rB = cute.make_rmem_tensor(cB.shape, f32)
    for s in cutlass.range(step_begin, step_end, unroll=1):
        k0 = MMA_K * s
        for v in cutlass.range_constexpr(cute.size(cA)):
            rA[v] = sA[a_row + cA[v][0], a_col + k0 + cA[v][1]]
        for v in cutlass.range_constexpr(cute.size(cB)):
            rB[v] = sB[b_row + k0 + cB[v][1], b_col + cB[v][0]]
        tf32_round(rA, rA)
        tf32_round(rB, rB)
        cute.gemm(tiled_mma, acc, tf32(rA), tf32(rB), acc)
    return acc, coords


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
        below = zero - acc  # +0 - acc: -acc, a zero of either sign as +0 (round to nearest)
    if not on_diagonal:
        return below
    on_or_below = cutlass.Float32(cutlass.select_(col == row, cutlass.Float32(1.0), below))
    return cutlass.Float32(cutlass.select_(col > row, zero, on_or_below))
