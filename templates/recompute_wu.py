"""W, U, KG (and QG on request) from Akk: the recompute stage of the KDA forward intra boundary.

One CTA per (chunk, head), 4 warps. For the rows i, j < v (v = valid rows of the chunk), with k, q, v
and Akk in the key's io dtype (bf16 or fp16; io_RN below rounds to it), g the fp32 log2 gate, beta
converted to fp32 (exact for bf16 beta):

    Kp[j] = io_RN((k[j] * beta[j]) * 2^g[j])        Vp[j] = io_RN(v[j] * beta[j])
    W = io_RN(Akk @ Kp)                              U = io_RN(Akk @ Vp)
    KG[i] = io_RN(k[i] * 2^(g_last - g[i]))          QG[i] = io_RN(q[i] * 2^g[i])

g_last is g at row v - 1 of the chunk (per column). 2^x is `ex2.approx.ftz.f32`; the products and the
difference are single IEEE fp32 operations (`mul.f32`, `sub.f32`: round to nearest, no flush; no FMA
is possible in these expressions), and 2^g[j] is one value shared by Kp and QG.

Phases (all 128 threads):
1. Akk rows -> smem `sA` (64x64, K-major, swizzled), 16-byte loads. Elementwise: thread t owns
   columns 8*(t % 16) .. +7 of rows t // 16 + 8p (p = 0..7); it loads k, g, v (q) with 16-byte loads,
   stores KG (QG) to global with 16-byte stores and Kp, Vp to smem `sKp`, `sVp`, each stored as the
   MMA B operand (N = head dim, K = chunk row), N-major and swizzled.
2. W = Akk @ Kp with bf16 or fp16 `mma.sync.m16n8k16` (fp32 accumulate): warp w owns output rows
   16w .. 16w+15 and all K columns; the chunk dimension is accumulated in one chain, k-steps of 16 in
   ascending order. Operands come from smem by ldmatrix (transposed for B). After a CTA barrier, the
   rounded result is staged in the (now free) `sKp` buffer as a row-major 64xK tile, and each warp
   copies its own 16 rows to global with 16-byte stores. U = Akk @ Vp the same way through `sVp`.

Rows >= v are never read as data and never written: their loads are clamped to row v - 1 (a row of this
chunk) and the values are replaced by zero with a select (Akk rows, Kp and Vp rows); their global
stores are predicated off. Akk columns j >= v are zero for valid rows (unit-lower-triangular inverse).
Input loads are `ld.global.nc` (the inputs are read-only for the kernel's lifetime), all unconditional,
so each thread has a group of rows in flight at once; outputs use predicated 16-byte stores.

Code: the per-row arithmetic (`gate_row`), the Akk staging and the W/U products are the shared
device functions of templates/tile_recompute.py (also used by the fused kernel); this file holds
the standalone launch and the global-memory loads.

Constraints: K, V keys.HEAD_DIMS sizes or padded ones (60, 100: the shared tiles have `keys.padded_head_dim`
columns; global rows are read and written in `global_vec` pieces, loads past a row's end clamped to its last
piece, stores there predicated off, one 16-byte access where a 16-bit row vector starts 16-byte aligned inside the
row; `load_row_vec`, `store_row_vec_if`) (K != V: Vp is staged after the gate
rows, in v's own rows and columns, `stage_values`), chunk 64 or 32 (warps 0-1 multiply W while 2-3 multiply U),
4 warps. Shared memory at K = V = 128: 40,960 bytes (Akk 8 KiB, Kp and Vp 16 KiB each; the W / U staging tiles reuse
Kp / Vp). No atomics, fixed arithmetic order: a chunk gives the same bits in dense and varlen mode and in
any batch. Grouped value heads: the grid walks the HV value heads; k (and q) are read at head h // (HV / H).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.memory import SmemAllocator

from kdajit.keys import ARCHS, CHUNK_SIZES, VARLEN_MODES, RecomputeWUKey, head_dim_supported, padded_head_dim
from kdajit.templates.common import (DTYPES, IO_TYPES, chunk_coords, chunk_rows, fake_arguments, grid_shape,
                                    make_struct, qk_head)
from kdajit.templates.tile_recompute import (NUM_WARPS, VEC, RecomputeLayouts, gate_row, load_row_vec,
                                             make_recompute_mma, products_w_u, row_fragments,
                                             store_akk, value_row)


def recompute_smem_struct(chunk: int, head_k: int, head_v: int, io):
    """The recompute kernel's shared memory: the swizzled Akk A tile and the Kp, Vp B tiles (`io`:
    bf16 or fp16), 1 KiB aligned for their swizzle."""
    S = cute.struct
    return make_struct("RecomputeSmem", [
        ("akk", S.Align[S.MemRange[io, chunk * chunk], 1024]),
        ("kp", S.Align[S.MemRange[io, head_k * chunk], 1024]),
        ("vp", S.Align[S.MemRange[io, head_v * chunk], 1024]),
    ])


def smem_bytes(key) -> int:
    """Shared memory of one CTA of `key`'s kernel (the module docstring states it)."""
    return recompute_smem_struct(key.chunk, padded_head_dim(key.head_k), padded_head_dim(key.head_v),
                                 IO_TYPES[key.io_dtype]).__sizeof__()


class RecomputeWU:
    """W, U, KG and (when `key.output_qg`) QG for one (chunk, head) tile per CTA."""

    def __init__(self, key: RecomputeWUKey):
        self.key = key
        # The shared tiles' columns: a padded head size (60, 100) gets those of the next HEAD_DIMS size.
        self.head_k = padded_head_dim(key.head_k)
        self.head_v = padded_head_dim(key.head_v)
        self.chunk = key.chunk
        self.io = IO_TYPES[key.io_dtype]
        self.output_qg = key.output_qg
        self.varlen = key.varlen != "dense"
        self.num_threads = 32 * key.config.warps

    @staticmethod
    def can_implement(key) -> bool:
        return (isinstance(key, RecomputeWUKey)
                and key.config.warps == NUM_WARPS
                and head_dim_supported(key.head_k) and head_dim_supported(key.head_v)
                and key.chunk in CHUNK_SIZES
                and key.beta_dtype in DTYPES and key.io_dtype in IO_TYPES
                and key.varlen in VARLEN_MODES
                and key.arch in ARCHS
                and isinstance(key.output_qg, bool))

    def fake_args(self) -> tuple:
        return fake_arguments(self.key)

    @cute.jit
    def __call__(self, mK: cute.Tensor, mV: cute.Tensor, mBeta: cute.Tensor, mAkk: cute.Tensor,
                 mGk: cute.Tensor, mQ: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mKG: cute.Tensor,
                 mQG: cute.Tensor, mCuSeqlens: cute.Tensor,
                 stream: cuda.CUstream):
        layouts = RecomputeLayouts(self.chunk, self.head_k, self.head_v)
        self.kernel(mK, mV, mBeta, mAkk, mGk, mQ, mW, mU, mKG, mQG, mCuSeqlens,
                    make_recompute_mma(self.chunk, self.io), layouts.akk, layouts.kp,
                    layouts.vp, layouts.out_w, layouts.out_u).launch(
            grid=grid_shape(mGk, mCuSeqlens, self.chunk, self.varlen),
            block=(self.num_threads, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, mK: cute.Tensor, mV: cute.Tensor, mBeta: cute.Tensor, mAkk: cute.Tensor,
               mG: cute.Tensor, mQ: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mKG: cute.Tensor,
               mQG: cute.Tensor, mCuSeqlens: cute.Tensor,
               tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout,
               sKp_layout: cute.ComposedLayout, sVp_layout: cute.ComposedLayout,
               sOutW_layout: cute.ComposedLayout, sOutU_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        _, head, _ = cute.arch.block_idx()
        is_valid, batch, row0, valid_rows = chunk_coords(mCuSeqlens, mK.shape[1],
                                                         self.chunk, self.varlen)
        if is_valid:
            storage = SmemAllocator().allocate(recompute_smem_struct(self.chunk, self.head_k, self.head_v,
                                                                     self.io))
            sA = storage.akk.get_tensor(sA_layout)
            sKp = storage.kp.get_tensor(sKp_layout)
            sVp = storage.vp.get_tensor(sVp_layout)
            # The output staging tiles reuse the Kp / Vp buffers once every warp has read them.
            sOutW = storage.kp.get_tensor(sOutW_layout)
            sOutU = storage.vp.get_tensor(sOutU_layout)

            # Inputs are read-only for the kernel's lifetime: invariant (ld.global.nc) loads.
            ld_io = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), self.io, num_bits_per_copy=128, invariant=True)
            ld_beta = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), mBeta.element_type,
                                          num_bits_per_copy=mBeta.element_type.width, invariant=True)
            C = self.chunk
            dKG = chunk_rows(mKG, batch, head, row0, C)
            dQG = dKG  # never written without QG (mQG is then a small dummy)
            if cutlass.const_expr(self.output_qg):
                dQG = chunk_rows(mQG, batch, head, row0, C)
            self.stage_operands(mK, mV, mBeta, mAkk, mG, mQ, dKG, dQG, sA, sKp, sVp, batch, head,
                                qk_head(head, mK, mG), row0, valid_rows, tidx, ld_io, ld_beta)
            cute.arch.sync_threads()

            # W = Akk @ Kp, then U = Akk @ Vp; the Akk fragments are loaded once for both.
            products_w_u(tiled_mma, sA, sKp, sVp, sOutW, sOutU, chunk_rows(mW, batch, head, row0, C),
                         chunk_rows(mU, batch, head, row0, C), valid_rows, tidx)

    @cute.jit
    def load_akk(self, mAkk: cute.Tensor, batch: cutlass.Int32, head: cutlass.Int32,
                 row0: cutlass.Int32, valid_rows: cutlass.Int32, tidx: cutlass.Int32,
                 ld_io: cute.CopyAtom):
        """Akk rows of this chunk -> registers (thread t: 16-byte column tile t % 8 of rows t // 8 + 16p).

        Loads of rows >= valid_rows are clamped to row valid_rows - 1; `store_akk` zeroes them.
        (Global loads; the fused kernel reads the same rows from shared memory.)
        """
        chunks_per_row = self.chunk // VEC
        rows_per_pass = self.num_threads // chunks_per_row
        num_passes = self.chunk // rows_per_pass
        col_tile = tidx % chunks_per_row
        rA = row_fragments(num_passes, self.io)
        for p in cutlass.range_constexpr(num_passes):
            row = tidx // chunks_per_row + p * rows_per_pass
            src_row = row0 + min(row, valid_rows - 1)
            cute.copy(ld_io, cute.local_tile(mAkk[batch, src_row, head, None], (VEC,), (col_tile,)),
                      rA[p, None])
        return rA

    @cute.jit
    def stage_operands(self, mK: cute.Tensor, mV: cute.Tensor, mBeta: cute.Tensor,
                       mAkk: cute.Tensor, mG: cute.Tensor, mQ: cute.Tensor, dKG: cute.Tensor,
                       dQG: cute.Tensor, sA: cute.Tensor, sKp: cute.Tensor, sVp: cute.Tensor,
                       batch: cutlass.Int32, head: cutlass.Int32, head_qk: cutlass.Int32, row0: cutlass.Int32,
                       valid_rows: cutlass.Int32, tidx: cutlass.Int32, ld_io: cute.CopyAtom,
                       ld_beta: cute.CopyAtom):
        """Akk -> sA; Kp, Vp -> sKp, sVp (B-operand layout (d, j)); KG, QG -> dKG, dQG (global). k and q
        are read at head `head_qk` (grouped value heads), everything else at `head`.

        Thread t owns columns 8 * (t % 16) .. +7 of rows t // 16 + 8p, p = 0..7. The 8 row passes
        run in groups of 2; the loads of group n + 1 are issued before group n is computed and
        stored, and the Akk loads go out with the first group. Every load is unconditional (rows
        past valid_rows are clamped to row valid_rows - 1), so the loads of a group are in flight
        together; the values of those rows are then replaced by zero or never stored.
        """
        f32, io = cutlass.Float32, self.io
        col_tiles = self.head_k // VEC
        rows_per_pass = self.num_threads // col_tiles
        num_passes = self.chunk // rows_per_pass
        group = 2
        col_tile = tidx % col_tiles
        same_rows = cutlass.const_expr(self.head_k == self.head_v)  # v loaded with k, in its rows and columns
        rGlast = cute.make_rmem_tensor((VEC,), f32)
        load_row_vec(mG[batch, row0 + valid_rows - 1, head, None], col_tile, rGlast)
        rA = self.load_akk(mAkk, batch, head, row0, valid_rows, tidx, ld_io)
        # Per pass: k, v, (q) in the io dtype and g fp32 for 8 columns, beta for the row.
        rK = row_fragments(num_passes, io)
        rV = row_fragments(num_passes, io)
        rQ = row_fragments(num_passes, io)
        rG = row_fragments(num_passes, f32)
        rBeta = cute.make_rmem_tensor((num_passes, 1), mBeta.element_type)
        for n in cutlass.range_constexpr(num_passes // group + 1):
            if cutlass.const_expr(n < num_passes // group):
                for p in cutlass.range_constexpr(n * group, (n + 1) * group):
                    src_row = row0 + min(tidx // col_tiles + p * rows_per_pass, valid_rows - 1)
                    load_row_vec(mK[batch, src_row, head_qk, None], col_tile, rK[p, None])
                    load_row_vec(mG[batch, src_row, head, None], col_tile, rG[p, None])
                    if cutlass.const_expr(same_rows):
                        load_row_vec(mV[batch, src_row, head, None], col_tile, rV[p, None])
                    cute.copy(ld_beta, cute.local_tile(mBeta[batch, None, head], (1,), (src_row,)),
                              rBeta[p, None])
                    if cutlass.const_expr(self.output_qg):
                        load_row_vec(mQ[batch, src_row, head_qk, None], col_tile, rQ[p, None])
            if cutlass.const_expr(n == 0):
                store_akk(rA, sA, valid_rows, tidx, self.num_threads)
            else:
                for p in cutlass.range_constexpr((n - 1) * group, n * group):
                    row = tidx // col_tiles + p * rows_per_pass
                    gate_row(rK[p, None], rG[p, None], rV[p, None] if same_rows else None, rQ[p, None],
                             rBeta[p, 0].to(f32), rGlast, dKG, dQG, sKp, sVp, row, valid_rows, col_tile,
                             self.output_qg)
        if cutlass.const_expr(not same_rows):
            self.stage_values(mV, mBeta, sVp, batch, head, row0, valid_rows, tidx, ld_beta)

    @cute.jit
    def stage_values(self, mV: cute.Tensor, mBeta: cute.Tensor, sVp: cute.Tensor, batch: cutlass.Int32,
                     head: cutlass.Int32, row0: cutlass.Int32, valid_rows: cutlass.Int32, tidx: cutlass.Int32,
                     ld_beta: cute.CopyAtom):
        """Vp -> sVp when K != V: thread t owns columns 8 * (t % (V / 8)) .. +7 of rows t // (V / 8) + p *
        (128 / (V / 8)); every load is issued (clamped to row valid_rows - 1) before the first is used."""
        col_tiles = self.head_v // VEC
        rows_per_pass = self.num_threads // col_tiles
        num_passes = self.chunk // rows_per_pass
        col_tile = tidx % col_tiles
        rV = row_fragments(num_passes, self.io)
        rBeta = cute.make_rmem_tensor((num_passes, 1), mBeta.element_type)
        for p in cutlass.range_constexpr(num_passes):
            src_row = row0 + min(tidx // col_tiles + p * rows_per_pass, valid_rows - 1)
            load_row_vec(mV[batch, src_row, head, None], col_tile, rV[p, None])
            cute.copy(ld_beta, cute.local_tile(mBeta[batch, None, head], (1,), (src_row,)), rBeta[p, None])
        for p in cutlass.range_constexpr(num_passes):
            value_row(rV[p, None], rBeta[p, 0].to(cutlass.Float32), sVp, tidx // col_tiles + p * rows_per_pass,
                      valid_rows, col_tile)
