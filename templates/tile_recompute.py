"""Per-tile device functions of the recompute phase: Kp, Vp, KG, QG per row and W, U = Akk @ (Kp, Vp).

Shared by `templates/recompute_wu.py` (inputs from global memory) and `templates/fused_forward.py`
(inputs already in shared memory). The math and the arithmetic order are documented in
`templates/recompute_wu.py` and docs/numerics.md.

- `gate_row`: one row's 8 columns, from register vectors (wherever they were loaded from): Kp, Vp to
  the shared B-operand tiles (Kp optionally kept in registers, for the fused kernel to store later), KG and QG to
  global. Every output element is computed here only (Kp by `key_product_row`; Vp by `value_row`, which K != V
  calls on rows of v's own layout; KG by `key_gate_row`, which the 8-warp fused kernel calls on other warps than
  Kp's).
- `store_akk`: Akk rows (register vectors) -> the shared A tile, rows >= valid_rows as zero.
- `product`: W or U = io_RN(Akk @ B) with mma.sync m16n8k16 from the shared tiles, staged and
  stored with 16-byte row stores or, given TMA atoms (`make_tma_store_tile`), one TMA box per warp and panel.
Output destinations are [chunk, D] tile views of global tensors (rows of this chunk). Every 16-bit
tensor (k, v, q, Akk, the shared tiles, the outputs) has the key's io dtype, bf16 or fp16; the
functions take it from their tensors' element types.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cutlass_dsl import dsl_user_op

from kdajit.keys import HEAD_DIMS
from kdajit.templates.common import (global_vec, heads_as_columns, ptx_asm, row_piece, sync_group, tma_chunk_coords,
                                     widened)

VEC = 8  # columns per thread access: 16 bytes of bf16 / fp16 (two 16-byte loads for the fp32 gate)
NUM_WARPS = 4


def row_fragments(rows: int, dtype):
    """A register tensor of `rows` contiguous 8-element vectors (row r is `t[r, None]`)."""
    return cute.make_rmem_tensor(cute.make_layout((rows, VEC), stride=(VEC, 1)), dtype)


def swizzled_layout(shape: tuple, contiguous_mode: int, line: int):
    """A 16-bit smem layout of `shape`, tiled from atoms of 8 lines of `line` contiguous elements.

    The lines run along `contiguous_mode`. Swizzle<3, 3, log2(line) - 3> XORs the 16-byte chunk
    index of an element (offset bits 3-5) with its line index mod 8, so the 8 lines of an atom hold
    a given chunk in 8 different bank groups: ldmatrix (plain or transposed), stores of MMA
    accumulator fragments and 16-byte line accesses are all free of bank conflicts. A 32-element
    line (chunk 32's Akk tile) has 4 chunks, and two lines share a 128-byte bank row: Swizzle<2, 3, 3>
    XORs the chunk index (bits 3-4) with the line index / 2 mod 4 (bits 6-7), the same guarantee.
    """
    if contiguous_mode == 1:
        outer = cute.make_layout((8, line), stride=(line, 1))
    else:
        outer = cute.make_layout((line, 8), stride=(1, line))
    swizzle = cute.make_swizzle(3, 3, line.bit_length() - 4) if line >= 64 else cute.make_swizzle(2, 3, 3)
    atom = cute.make_composed_layout(swizzle, 0, outer)
    return cute.tile_to_shape(atom, shape, (0, 1))


class RecomputeLayouts:
    """The shared layouts of the recompute phase for chunk C and head dims K, V."""

    def __init__(self, chunk: int, head_k: int, head_v: int, panels: bool = False):
        self.akk = swizzled_layout((chunk, chunk), contiguous_mode=1, line=chunk)   # Akk (i, j), K-major
        self.kp = swizzled_layout((head_k, chunk), contiguous_mode=0, line=64)      # Kp as B: (d, j)
        self.vp = swizzled_layout((head_v, chunk), contiguous_mode=0, line=64)      # Vp as B: (d, j)
        # W, U staging; `panels`: 64-column panels of the 128-byte swizzle, which a TMA store box reads as they are
        self.out_w = swizzled_layout((chunk, head_k), contiguous_mode=1, line=64 if panels else head_k)
        self.out_u = swizzled_layout((chunk, head_v), contiguous_mode=1, line=64 if panels else head_v)


TMA_BOX = (16, 64)  # one warp's rows x one staging panel's columns
# The panels' Swizzle<3, 3, 3> on 16-bit element offsets, seen on byte addresses: the form a TMA descriptor's 128-byte
# swizzle and a swizzled pointer take (docs/performance.md, twenty-sixth session)
PANEL_SWIZZLE_BYTES = (3, 4, 3)


def make_tma_store_tile(mX: cute.Tensor):
    """(TMA atom, TMA coordinate tensor) that store a warp's 16 rows x 64 columns of an output tile from its
    128-byte-swizzled staging panel (`RecomputeLayouts.out_w`) into the contiguous [B, T, H, D] tensor mX (D a
    multiple of 64: a box never crosses into the next head's columns) viewed as [T, H * D, B] (`heads_as_columns`;
    host side; `FusedConfig.stores` "tma")."""
    cols = cute.size(mX, mode=[3])
    assert cols % TMA_BOX[1] == 0, f"no TMA store boxes of {TMA_BOX[1]} columns in rows of {cols}"
    box = cute.make_composed_layout(cute.make_swizzle(*PANEL_SWIZZLE_BYTES), 0,
                                    cute.make_layout(TMA_BOX, stride=(TMA_BOX[1], 1)))
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), heads_as_columns(mX), box, TMA_BOX)


@cute.jit
def store_warp_rows_tma(tma_out: cutlass.Constexpr, sOut: cute.Tensor, warp_row0: cutlass.Int32):
    """The TMA stores of this warp's 16 staged rows (`make_tma_store_tile`; tma_out = (atom, coordinate tensor of
    the tile's [chunk, D] rows, `tma_chunk_coords`)), one box per 64-column panel, as one bulk group; the caller
    has fenced the staging writes for the async proxy and synchronized the warp."""
    atom, gOut = tma_out
    chunk = cute.size(sOut, mode=[0])
    for p in cutlass.range_constexpr(cute.size(sOut, mode=[1]) // TMA_BOX[1]):
        # panel p's rows are elements p * chunk * 64 .. (p + 1) * chunk * 64 - 1 (`swizzled_layout` tiles the 8-row
        # atoms down the rows first), one 64-element line per row
        base = cute.recast_ptr(sOut.iterator + (p * chunk + warp_row0) * TMA_BOX[1],
                               swizzle_=cute.make_swizzle(*PANEL_SWIZZLE_BYTES))
        sBox = cute.make_tensor(base, cute.make_layout(TMA_BOX, stride=(TMA_BOX[1], 1)))
        gBox = cute.local_tile(gOut, TMA_BOX, (warp_row0 // TMA_BOX[0], p))
        tS, tG = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sBox, 0, 2),
                                       cute.group_modes(gBox, 0, 2))
        cute.copy(atom, tS, tG)
    cute.arch.cp_async_bulk_commit_group()


def product_threads(chunk: int) -> int:
    """Threads that multiply one of W, U: one warp per 16 rows of the chunk (4 warps at 64, 2 at 32)."""
    return 32 * (chunk // 16)


def make_recompute_mma(chunk: int, io) -> cute.TiledMma:
    """mma.sync m16n8k16 on `io` (bf16 or fp16) operands with fp32 accumulate, `product_threads(chunk)`
    threads: warps along M (16 rows each), N = 16 per step (ldmatrix.x4 feeds two n8)."""
    mma_op = warp.MmaF16BF16Op(io, cutlass.Float32, (16, 8, 16))
    return cute.make_tiled_mma(mma_op, cute.make_layout((product_threads(chunk) // 32, 1, 1)),
                               permutation_mnk=(chunk, 16, 16))


@cute.jit
def store_vec_if(rVec: cute.Tensor, gVec: cute.Tensor, pred: cutlass.Boolean):
    """Store 8 or 4 16-bit values (16 or 8 bytes) to global memory at gVec when `pred` holds.

    A predicated `st.global.v4` (`.v2`) rather than an `if`: behind a branch, LLVM would sink the loads
    that feed only this store into the branch, one full memory latency per row.
    """
    words = cute.recast_tensor(rVec, cutlass.Int32)
    count = cute.size(words)
    operands = ", ".join("{$r%d}" % (w + 1) for w in range(count))
    cute.arch.inline_ptx(f"st.global.v{count}.b32 [{{$r0}}], {{{operands}}};",
                         read_only_args=[gVec.iterator, *[words[w] for w in range(count)]], predicate=pred)


@cute.jit
def store_row_vec_if(rVec: cute.Tensor, dRow: cute.Tensor, col_tile: cutlass.Int32, pred: cutlass.Boolean):
    """Store rVec (8 16-bit values) to columns 8 col_tile .. +7 of the global row dRow when `pred` holds: one
    16-byte store where the row has a HEAD_DIMS length; else one 16-byte store where `wide_vec` allows it (8-byte
    pieces: `splits_vec`) and `global_vec` pieces otherwise, each also predicated on lying inside the row (a padded
    head size: the tile's last columns are padding). The same values either way."""
    cols = cute.size(dRow)
    if cutlass.const_expr(cols in HEAD_DIMS):
        store_vec_if(rVec, cute.local_tile(dRow, (VEC,), (col_tile,)), pred)
    else:
        piece = global_vec(dRow.element_type, cols)  # 4 or 8 values: head sizes are multiples of 4
        narrow = pred
        if cutlass.const_expr(splits_vec(dRow.element_type, cols)):
            wide = wide_vec(dRow, col_tile)
            # The pointer claims 8-byte alignment only: a 16-byte claim would let the compiler fold wide_vec's test.
            store_vec_if(rVec, row_piece(dRow, col_tile * VEC, piece), pred & wide)
            narrow = pred & (wide == cutlass.Boolean(False))
        # A piece that starts past the row's end in every column tile (K = 4: columns 4-7) is left out: its
        # predicate would fold to a constant, which an inline PTX guard cannot take.
        for s in cutlass.range_constexpr(min(VEC, cols) // piece):
            col = col_tile * VEC + s * piece
            store_vec_if(cute.local_tile(rVec, (piece,), (s,)), row_piece(dRow, col, piece), narrow & (col < cols))


def splits_vec(dtype, cols: int) -> bool:
    """Whether a row of `cols` 16-bit values moves in 8-byte `global_vec` pieces (K = 4 mod 8 from 12: 60, 100, 252),
    so that a row vector may take one 16-byte access instead of two where `wide_vec` holds. The fp32 gate's row
    vector is 32 bytes (two 16-byte pieces already) and keeps them. Rows under VEC columns (K = 4) keep the pieces:
    there `wide_vec` would fold to a constant, which a predicated asm guard cannot take."""
    return dtype.width * VEC == 128 and global_vec(dtype, cols) * 2 == VEC <= cols


def wide_vec(dRow: cute.Tensor, col_tile: cutlass.Int32) -> cutlass.Boolean:
    """Whether columns VEC col_tile .. +VEC-1 of the global row dRow (8-byte pieces: `splits_vec`) lie inside the row
    and start 16-byte aligned, so that one 16-byte access can move them: a whole tile's rows at once where the row
    stride is a 16-byte multiple (an even head at an even H), every other row at an odd H."""
    col0 = col_tile * VEC
    start = row_piece(dRow, col0, VEC // 2).iterator.toint()
    return (col0 + VEC <= cute.size(dRow)) & ((start & cutlass.Int64(15)) == cutlass.Int64(0))


@dsl_user_op
def load_vec_or_halves(lo_ptr: cute.Pointer, hi_ptr: cute.Pointer, wide: cutlass.Boolean, *, loc=None,
                       ip=None) -> list:
    """Four 32-bit words by invariant loads: 16 bytes from `lo_ptr` when `wide`, else 8 bytes from each of `lo_ptr`
    and `hi_ptr` (predicated in one asm block, so the 16-byte load may name an unaligned pointer when not taken). The
    pointers claim 8-byte alignment only: a 16-byte claim would let the compiler fold `wide_vec`'s test."""
    i32 = cutlass.Int32.mlir_type
    result = ptx_asm(
        llvm.StructType.get_literal([i32] * 4),
        [p.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip) for p in (lo_ptr, hi_ptr)]
        + [cutlass.Int32(wide).ir_value(loc=loc, ip=ip)],
        "{\n\t.reg .pred p;\n\t.reg .b32 w;\n\tmov.b32 w, $6;\n\tsetp.ne.b32 p, w, 0;\n\t"
        "@p ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];\n\t"
        "@!p ld.global.nc.v2.b32 {$0, $1}, [$4];\n\t"
        "@!p ld.global.nc.v2.b32 {$2, $3}, [$5];\n\t}",
        "=r,=r,=r,=r,l,l,r",
        loc=loc,
        ip=ip,
    )
    return [cutlass.Int32(llvm.extractvalue(i32, result, [w], loc=loc, ip=ip)) for w in range(4)]


@cute.jit
def load_row_vec(dRow: cute.Tensor, col_tile: cutlass.Int32, rVec: cute.Tensor):
    """rVec (VEC values) <- columns VEC col_tile .. of the global row dRow, invariant (`ld.global.nc`) loads: 16 bytes
    each where the row has a HEAD_DIMS length or `wide_vec` allows it; else `global_vec` pieces, a piece past the
    row's end loaded from the row's last piece instead (the load stays unconditional; those padding columns reach
    only outputs that are never stored)."""
    dtype = dRow.element_type
    cols = cute.size(dRow)
    if cutlass.const_expr(cols in HEAD_DIMS):
        atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=128, invariant=True)
        cute.copy(atom, cute.local_tile(dRow, (VEC,), (col_tile,)), rVec)
    elif cutlass.const_expr(splits_vec(dtype, cols)):
        col0 = col_tile * VEC
        halves = [row_piece(dRow, min(col0 + s * VEC // 2, cols - VEC // 2), VEC // 2).iterator for s in range(2)]
        words = load_vec_or_halves(halves[0], halves[1], wide_vec(dRow, col_tile))
        rWords = cute.recast_tensor(rVec, cutlass.Int32)
        for w in cutlass.range_constexpr(4):
            rWords[w] = words[w]
    else:
        piece = global_vec(dtype, cols)
        atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=piece * dtype.width,
                                   invariant=True)
        for s in cutlass.range_constexpr(VEC // piece):
            col = min(col_tile * VEC + s * piece, cols - piece)
            cute.copy(atom, row_piece(dRow, col, piece), cute.local_tile(rVec, (piece,), (s,)))


@cute.jit
def zero_unless(rVec: cute.Tensor, keep: cutlass.Boolean):
    """rVec (8 16-bit values) <- +0 unless `keep`: one select per 32-bit word (two values), the same bits as a
    select per value without unpacking the pairs."""
    words = cute.recast_tensor(rVec, cutlass.Int32)
    words.store(cute.where(cute.full((VEC // 2,), keep, cutlass.Boolean), words.load(), cutlass.Int32(0)))


@cute.jit
def store_akk(rA: cute.Tensor, sA: cute.Tensor, valid_rows: cutlass.Int32, tidx: cutlass.Int32,
              num_threads: cutlass.Constexpr):
    """Akk rows in registers (thread t: 16-byte column tile t % 8 of rows t // 8 + 16p) -> sA, rows
    >= valid_rows replaced by zero (select)."""
    chunks_per_row = cute.size(sA, mode=[1]) // VEC
    rows_per_pass = num_threads // chunks_per_row
    col_tile = tidx % chunks_per_row
    for p in cutlass.range_constexpr(cute.size(rA, mode=[0])):
        row = tidx // chunks_per_row + p * rows_per_pass
        zero_unless(rA[p, None], row < valid_rows)
        cute.autovec_copy(rA[p, None], cute.local_tile(sA[row, None], (VEC,), (col_tile,)))


@cute.jit
def value_row(rV: cute.Tensor, beta: cutlass.Float32, sVp: cute.Tensor, row: cutlass.Int32,
              valid_rows: cutlass.Int32, col_tile: cutlass.Int32):
    """One row's 8 columns of Vp = io_RN(v * beta) to smem (zero past valid_rows)."""
    io = sVp.element_type
    rVp = cute.make_rmem_tensor((VEC,), io)
    rVp.store((widened(rV) * beta).to(io))
    zero_unless(rVp, row < valid_rows)
    store_b_row(rVp, sVp, row, col_tile)


@cute.jit
def store_b_row(rVec: cute.Tensor, sB: cute.Tensor, row: cutlass.Int32, col_tile: cutlass.Int32):
    """A row's 8-value register vector -> its columns 8 col_tile .. in the shared B-operand tile sB (Kp or Vp,
    stored (d, j): the row is sB[None, row])."""
    cute.autovec_copy(rVec, cute.local_tile(sB[None, row], (VEC,), (col_tile,)))


@cute.jit
def key_product_row(rK: cute.Tensor, rG: cute.Tensor, beta: cutlass.Float32, row: cutlass.Int32,
                    valid_rows: cutlass.Int32, rKp: cute.Tensor):
    """One row's 8 columns of Kp = io_RN(k * beta * exp2(g)) (io: rKp's element type) -> the register vector rKp,
    zero past valid_rows; returns exp2(g) (QG's gate)."""
    gate = cute.math.exp2(rG.load(), fastmath=True)
    rKp.store(((widened(rK) * beta) * gate).to(rKp.element_type))
    zero_unless(rKp, row < valid_rows)
    return gate


@cute.jit
def gate_row(rK: cute.Tensor, rG: cute.Tensor, rV: cute.Tensor, rQ: cute.Tensor,
             beta: cutlass.Float32, rGlast: cute.Tensor, dKG: cute.Tensor, dQG: cute.Tensor,
             sKp: cute.Tensor, sVp: cute.Tensor, row: cutlass.Int32, valid_rows: cutlass.Int32,
             col_tile: cutlass.Int32, output_qg: cutlass.Constexpr, rKp: cute.Tensor = None):
    """One row's 8 columns: Kp (`key_product_row`) to smem, or, given the register vector `rKp`, into it (the caller
    stores it to sKp later); Vp (`value_row`, unless rV is None: K != V takes v in rows of its own) to smem;
    KG (`key_gate_row`, unless rGlast is None: another thread computes it), QG to global (dKG, dQG: [chunk, K]
    views of this chunk's rows)."""
    io = sKp.element_type
    kp_kept = cutlass.const_expr(rKp is not None)
    if cutlass.const_expr(not kp_kept):
        rKp = cute.make_rmem_tensor((VEC,), io)
    gate = key_product_row(rK, rG, beta, row, valid_rows, rKp)
    if cutlass.const_expr(not kp_kept):
        store_b_row(rKp, sKp, row, col_tile)
    if cutlass.const_expr(rV is not None):
        value_row(rV, beta, sVp, row, valid_rows, col_tile)
    if cutlass.const_expr(rGlast is not None):
        key_gate_row(rK, rG, rGlast, dKG, row, valid_rows, col_tile)
    if cutlass.const_expr(output_qg):
        rQG = cute.make_rmem_tensor((VEC,), io)
        rQG.store((widened(rQ) * gate).to(io))
        store_row_vec_if(rQG, dQG[row, None], col_tile, row < valid_rows)


@cute.jit
def key_gate_row(rK: cute.Tensor, rG: cute.Tensor, rGlast: cute.Tensor, dKG: cute.Tensor, row: cutlass.Int32,
                 valid_rows: cutlass.Int32, col_tile: cutlass.Int32):
    """One row's 8 columns of KG = io_RN(k * exp2(g_last - g)) to global (rows < valid_rows)."""
    rKG = cute.make_rmem_tensor((VEC,), dKG.element_type)
    rKG.store((widened(rK) * cute.math.exp2(rGlast.load() - rG.load(), fastmath=True))
              .to(dKG.element_type))
    store_row_vec_if(rKG, dKG[row, None], col_tile, row < valid_rows)


@cute.jit
def load_akk_fragments(tiled_mma: cute.TiledMma, sA: cute.Tensor, tidx: cutlass.Int32):
    """The A fragments of Akk for this thread (ldmatrix from sA), loaded once for W and U."""
    thr_mma = tiled_mma.get_slice(tidx)
    s2r_A = cute.make_tiled_copy_A(
        cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), sA.element_type), tiled_mma)
    tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
    thr_s2r_A = s2r_A.get_slice(tidx)
    cute.copy(s2r_A, thr_s2r_A.partition_S(sA), thr_s2r_A.retile(tCrA))
    return tCrA


@cute.jit
def products_w_u(tiled_mma: cute.TiledMma, sA: cute.Tensor, sKp: cute.Tensor, sVp: cute.Tensor,
                 sOutW: cute.Tensor, sOutU: cute.Tensor, dW: cute.Tensor, dU: cute.Tensor,
                 valid_rows: cutlass.Int32, tidx: cutlass.Int32, tma_out: cutlass.Constexpr = None,
                 group: cutlass.Constexpr = None):
    """W = Akk @ Kp, then U = Akk @ Vp (sOutW/sOutU alias sKp/sVp) by 4 warps; the caller synchronizes
    before. At chunk 32 (two warps per product) warps 0-1 multiply W while warps 2-3 multiply U, each pair
    on its own named barrier. `tma_out`: None, or W's and U's (atom, coordinate tensor) for `product`'s TMA
    stores (4 warps only). `group`: the 4 warps' barrier at chunk 64 (`sync_group`; None: the whole CTA)."""
    threads = product_threads(cute.size(sA, mode=[0]))
    if cutlass.const_expr(threads == NUM_WARPS * 32):
        tCrA = load_akk_fragments(tiled_mma, sA, tidx)
        s2r_B = b_operand_copy(tiled_mma, sKp.element_type)
        tma_w, tma_u = tma_out if cutlass.const_expr(tma_out is not None) else (None, None)
        product(tiled_mma, s2r_B, tCrA, sKp, sOutW, dW, valid_rows, tidx, group, tma_out=tma_w)
        product(tiled_mma, s2r_B, tCrA, sVp, sOutU, dU, valid_rows, tidx, group, tma_out=tma_u)
    else:
        products_by_groups(tiled_mma, sA, sKp, sVp, sOutW, sOutU, dW, dU, valid_rows, tidx % threads,
                           tidx < threads)


@cute.jit
def product_of_group(tiled_mma: cute.TiledMma, sA: cute.Tensor, sB: cute.Tensor, sOut: cute.Tensor,
                     dOut: cute.Tensor, valid_rows: cutlass.Int32, tidx: cutlass.Int32, group: cutlass.Constexpr):
    """One of W = Akk @ Kp, U = Akk @ Vp by one group of `product_threads` threads (`tidx` its thread index in
    the group, `group` its named barrier) while another group computes the other: the same `product` as
    `products_w_u`."""
    product(tiled_mma, b_operand_copy(tiled_mma, sB.element_type), load_akk_fragments(tiled_mma, sA, tidx), sB,
            sOut, dOut, valid_rows, tidx, group)


# Named barriers of the two product groups (`products_by_groups`); 0 is the CTA barrier.
PRODUCT_BARRIERS = (1, 2)


@cute.jit
def products_by_groups(tiled_mma: cute.TiledMma, sA: cute.Tensor, sKp: cute.Tensor, sVp: cute.Tensor,
                       sOutW: cute.Tensor, sOutU: cute.Tensor, dW: cute.Tensor, dU: cute.Tensor,
                       valid_rows: cutlass.Int32, group_tidx: cutlass.Int32, first_group: cutlass.Boolean,
                       one_copy: cutlass.Constexpr = False):
    """W by the first group of `product_threads` threads while the second multiplies U (`group_tidx`: the thread's
    index in its group), each group on its own named barrier (PRODUCT_BARRIERS). `one_copy` (only where W and U
    have one layout, K == V): both groups run one copy of the code, each picking its tiles, output rows and barrier
    at run time. It pays in the 8-warp kernel at chunk 64 (code size) and costs 4-warp chunk-32 tiles ~7%
    (docs/performance.md), so the callers choose; the products' bits are the same either way."""
    threads = product_threads(cute.size(sA, mode=[0]))
    # K == V itself, not only the padded tile size (K = 100 with V = 128 share the shared tiles' layout, not W's and
    # U's global one)
    cols = cute.size(dW, mode=[1])
    if cutlass.const_expr(one_copy and cols == cute.size(dU, mode=[1])):
        barrier = (cutlass.select_(first_group, PRODUCT_BARRIERS[0], PRODUCT_BARRIERS[1]), threads)
        row_align = global_vec(dW.element_type, cols) * dW.element_type.width // 8  # bytes a row start is aligned to
        product_of_group(tiled_mma, sA, pick_tensor(first_group, sKp, sVp, 1024),
                         pick_tensor(first_group, sOutW, sOutU, 1024), pick_tensor(first_group, dW, dU, row_align),
                         valid_rows, group_tidx, barrier)
    elif first_group:
        product_of_group(tiled_mma, sA, sKp, sOutW, dW, valid_rows, group_tidx, (PRODUCT_BARRIERS[0], threads))
    else:
        product_of_group(tiled_mma, sA, sVp, sOutU, dU, valid_rows, group_tidx, (PRODUCT_BARRIERS[1], threads))


@cute.jit
def pick_tensor(first: cutlass.Boolean, a: cute.Tensor, b: cute.Tensor, align: cutlass.Constexpr) -> cute.Tensor:
    """`a` where `first` holds, else `b` (two tensors of one layout and memory space, bases `align`-byte aligned):
    one tensor whose base is chosen at run time, so that one copy of the code that uses it serves both."""
    base = cutlass.select_(first, a.iterator.toint(), b.iterator.toint())
    return cute.make_tensor(cute.make_ptr(a.element_type, base, a.memspace, assumed_align=align), a.layout)


def b_operand_copy(tiled_mma: cute.TiledMma, dtype) -> cute.TiledCopy:
    """ldmatrix (transposed) of the B operand tiles Kp, Vp."""
    return cute.make_tiled_copy_B(cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), dtype), tiled_mma)


@cute.jit
def product_sums(tiled_mma: cute.TiledMma, s2r_B: cute.TiledCopy, tCrA: cute.Tensor, sB: cute.Tensor,
                 dC: cute.Tensor, tidx: cutlass.Int32) -> cute.Tensor:
    """Thread `tidx`'s fp32 accumulator of Akk @ B (tCrA: its Akk fragments; sB: the shared B tile read by ldmatrix),
    partitioned as `tiled_mma` partitions the [chunk, D] tile dC: +0, then the k-steps of 16 in ascending order
    (docs/numerics.md). `product` rounds and stores it."""
    thr_mma = tiled_mma.get_slice(tidx)
    tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
    thr_s2r_B = s2r_B.get_slice(tidx)
    tBsB = thr_s2r_B.partition_S(sB)
    tBrB = thr_s2r_B.retile(tCrB)
    acc = tiled_mma.make_fragment_C(thr_mma.partition_C(dC))
    acc.fill(0.0)
    for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.copy(s2r_B, tBsB[None, None, kb], tBrB[None, None, kb])
        cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
    return acc


@cute.jit
def product(tiled_mma: cute.TiledMma, s2r_B: cute.TiledCopy, tCrA: cute.Tensor, sB: cute.Tensor,
            sOut: cute.Tensor, dOut: cute.Tensor, valid_rows: cutlass.Int32, tidx: cutlass.Int32,
            group: cutlass.Constexpr = None, tma_out: cutlass.Constexpr = None):
    """dOut rows < valid_rows = io_RN(Akk @ B) (io: dOut's element type), staged through sOut (which aliases sB).
    `group`: the barrier of the warps that read sB (`sync_group`; None: the whole CTA). `tma_out`: None, or
    (atom, coordinate tensor of dOut's rows) of `make_tma_store_tile`: a warp whose 16 rows are all valid stores
    them by TMA (`store_warp_rows_tma`; the caller waits for the bulk group's reads before reusing sOut)."""
    thr_mma = tiled_mma.get_slice(tidx)
    acc = product_sums(tiled_mma, s2r_B, tCrA, sB, sOut, tidx)
    rOut = cute.make_rmem_tensor_like(acc, dOut.element_type)
    rOut.store(acc.load().to(dOut.element_type))
    sync_group(group)  # every warp has finished reading sB: it becomes the staging tile
    cute.autovec_copy(rOut, thr_mma.partition_C(sOut))
    warp_row0 = (tidx // 32) * 16
    if cutlass.const_expr(tma_out is not None):
        if warp_row0 + TMA_BOX[0] <= valid_rows:
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()
            store_warp_rows_tma(tma_out, sOut, warp_row0)
        else:
            cute.arch.sync_warp()
            store_staged_rows(sOut, dOut, valid_rows, tidx, warp_row0)
    else:
        # Warp w's accumulator rows are 16w .. 16w+15 (MMA atoms 4x1x1 along M), and it copies out
        # exactly those rows: a warp barrier orders the staging.
        cute.arch.sync_warp()
        store_staged_rows(sOut, dOut, valid_rows, tidx, warp_row0)


@cute.jit
def store_staged_rows(sOut: cute.Tensor, dOut: cute.Tensor, valid_rows: cutlass.Int32, tidx: cutlass.Int32,
                      warp_row0: cutlass.Int32):
    """This warp's 16 staged rows < valid_rows, from sOut to dOut by 16-byte row pieces."""
    lane = tidx % 32
    col_tiles = cute.size(sOut, mode=[1]) // VEC
    rows_per_pass = 32 // col_tiles
    col_tile = lane % col_tiles
    for p in cutlass.range_constexpr(16 // rows_per_pass):
        row = warp_row0 + lane // col_tiles + p * rows_per_pass
        rRow = cute.make_rmem_tensor((VEC,), dOut.element_type)
        cute.autovec_copy(cute.local_tile(sOut[row, None], (VEC,), (col_tile,)), rRow)
        store_row_vec_if(rRow, dOut[row, None], col_tile, row < valid_rows)
