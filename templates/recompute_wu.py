"""W, U, KG (and QG on request) from Akk: the recompute stage of the KDA forward intra boundary.

One CTA per (chunk, head), 4 warps. For the rows i, j < v (v = valid rows of the chunk), with k, q, v
bf16, g the fp32 log2 gate, beta converted to fp32 (exact for bf16 beta):

    Kp[j] = bf16_RN((k[j] * beta[j]) * 2^g[j])      Vp[j] = bf16_RN(v[j] * beta[j])
    W = bf16_RN(Akk @ Kp)                            U = bf16_RN(Akk @ Vp)
    KG[i] = bf16_RN(k[i] * 2^(g_last - g[i]))        QG[i] = bf16_RN(q[i] * 2^g[i])

g_last is g at row v - 1 of the chunk (per column). 2^x is `ex2.approx.ftz.f32`; the products and the
difference are single IEEE fp32 operations (`mul.f32`, `sub.f32`: round to nearest, no flush; no FMA
is possible in these expressions), and 2^g[j] is one value shared by Kp and QG.

Phases (all 128 threads):
1. Akk rows -> smem `sA` (64x64 bf16, K-major, swizzled), 16-byte loads. Elementwise: thread t owns
   columns 8*(t % 16) .. +7 of rows t // 16 + 8p (p = 0..7); it loads k, g, v (q) with 16-byte loads,
   stores KG (QG) to global with 16-byte stores and Kp, Vp to smem `sKp`, `sVp`, each stored as the
   MMA B operand (N = head dim, K = chunk row), N-major and swizzled.
2. W = Akk @ Kp with bf16 `mma.sync.m16n8k16` (fp32 accumulate): warp w owns output rows
   16w .. 16w+15 and all 128 columns; the chunk dimension is accumulated in one chain, k-steps of 16 in
   ascending order. Operands come from smem by ldmatrix (transposed for B). After a CTA barrier, the
   bf16 result is staged in the (now free) `sKp` buffer as a row-major 64x128 tile, and each warp
   copies its own 16 rows to global with 16-byte stores. U = Akk @ Vp the same way through `sVp`.

Rows >= v are never read as data and never written: their loads are clamped to row v - 1 (a row of this
chunk) and the values are replaced by zero with a select (Akk rows, Kp and Vp rows); their global
stores are predicated off. Akk columns j >= v are zero for valid rows (unit-lower-triangular inverse).
Input loads are `ld.global.nc` (the inputs are read-only for the kernel's lifetime), all unconditional,
so each thread has a group of rows in flight at once; outputs use predicated 16-byte stores.

Constraints: K = V = 128, chunk = 64, 4 warps. Shared memory: 40 KB. No atomics, fixed arithmetic
order: a chunk gives the same bits in dense and varlen mode and in any batch.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warp
from cutlass.cute.runtime import make_fake_stream
from cutlass.memory import SmemAllocator

from kdajit.keys import ARCHS, VARLEN_MODES, RecomputeWUKey
from kdajit.templates.common import DTYPES, SymbolicShapes, chunk_coords, grid_shape

VEC = 8  # columns per thread access: 16 bytes of bf16 (two 16-byte loads for the fp32 gate)


def _row_fragments(rows: int, dtype):
    """A register tensor of `rows` contiguous 8-element vectors (row r is `t[r, None]`)."""
    return cute.make_rmem_tensor(cute.make_layout((rows, VEC), stride=(VEC, 1)), dtype)


@cute.jit
def _store_vec_if(rVec: cute.Tensor, gVec: cute.Tensor, pred: cutlass.Boolean):
    """Store 8 bf16 (16 bytes) to global memory when `pred` holds.

    A predicated `st.global.v4` rather than an `if`: behind a branch, LLVM would sink the loads
    that feed only this store into the branch, one full memory latency per row.
    """
    words = cute.recast_tensor(rVec, cutlass.Int32)
    cute.arch.inline_ptx("st.global.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                         read_only_args=[gVec.iterator, words[0], words[1], words[2], words[3]],
                         predicate=pred)


def _swizzled_layout(shape: tuple, contiguous_mode: int, line: int):
    """A bf16 smem layout of `shape`, tiled from atoms of 8 lines of `line` contiguous elements.

    The lines run along `contiguous_mode`. Swizzle<3, 3, log2(line) - 3> XORs the 16-byte chunk
    index of an element (offset bits 3-5) with its line index mod 8, so the 8 lines of an atom hold
    a given chunk in 8 different bank groups: ldmatrix (plain or transposed), stores of MMA
    accumulator fragments and 16-byte line accesses are all free of bank conflicts.
    """
    if contiguous_mode == 1:
        outer = cute.make_layout((8, line), stride=(line, 1))
    else:
        outer = cute.make_layout((line, 8), stride=(1, line))
    atom = cute.make_composed_layout(cute.make_swizzle(3, 3, line.bit_length() - 4), 0, outer)
    return cute.tile_to_shape(atom, shape, (0, 1))


class RecomputeWU:
    """W, U, KG and (when `key.output_qg`) QG for one (chunk, head) tile per CTA."""

    def __init__(self, key: RecomputeWUKey):
        self.key = key
        self.head_k = key.head_k
        self.head_v = key.head_v
        self.chunk = key.chunk
        self.output_qg = key.output_qg
        self.varlen = key.varlen != "dense"
        self.beta_dtype = DTYPES[key.beta_dtype]
        self.num_threads = 32 * key.config.warps

    @staticmethod
    def can_implement(key) -> bool:
        return (isinstance(key, RecomputeWUKey)
                and key.config.warps == 4
                and key.head_k == 128 and key.head_v == 128
                and key.chunk == 64
                and key.beta_dtype in DTYPES
                and key.varlen in VARLEN_MODES
                and key.arch in ARCHS
                and isinstance(key.output_qg, bool))

    def fake_args(self) -> tuple:
        shapes = SymbolicShapes()
        bf16 = cutlass.BFloat16
        # Without QG, q and qg are never touched: their own sizes let the caller pass small dummies.
        q_shapes = shapes if self.output_qg else SymbolicShapes()
        cu_seqlens, chunk_offsets = shapes.seq_vectors(self.key.varlen)
        return (
            shapes.bthd(bf16, self.head_k),              # mK
            shapes.bthd(bf16, self.head_v),              # mV
            shapes.bth(self.beta_dtype),                 # mBeta
            shapes.bthd(bf16, self.chunk),               # mAkk
            shapes.bthd(cutlass.Float32, self.head_k),   # mG
            q_shapes.bthd(bf16, self.head_k),            # mQ
            shapes.bthd(bf16, self.head_k),              # mW
            shapes.bthd(bf16, self.head_v),              # mU
            shapes.bthd(bf16, self.head_k),              # mKG
            q_shapes.bthd(bf16, self.head_k),            # mQG
            cu_seqlens,
            chunk_offsets,
            make_fake_stream(use_tvm_ffi_env_stream=True),
        )

    @cute.jit
    def __call__(self, mK: cute.Tensor, mV: cute.Tensor, mBeta: cute.Tensor, mAkk: cute.Tensor,
                 mG: cute.Tensor, mQ: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mKG: cute.Tensor,
                 mQG: cute.Tensor, mCuSeqlens: cute.Tensor, mChunkOffsets: cute.Tensor,
                 stream: cuda.CUstream):
        C, K, V = self.chunk, self.head_k, self.head_v
        mma_op = warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (16, 8, 16))
        # 4 warps along M (16 rows each); N = 16 per tile step so that ldmatrix.x4 feeds two n8 MMAs.
        tiled_mma = cute.make_tiled_mma(mma_op, cute.make_layout((self.num_threads // 32, 1, 1)),
                                        permutation_mnk=(C, 16, 16))
        sA_layout = _swizzled_layout((C, C), contiguous_mode=1, line=C)      # Akk (i, j), K-major
        sKp_layout = _swizzled_layout((K, C), contiguous_mode=0, line=64)    # Kp as B: (d, j), N-major
        sVp_layout = _swizzled_layout((V, C), contiguous_mode=0, line=64)    # Vp as B: (d, j), N-major
        sOutW_layout = _swizzled_layout((C, K), contiguous_mode=1, line=K)   # W staging (i, d)
        sOutU_layout = _swizzled_layout((C, V), contiguous_mode=1, line=V)   # U staging (i, d)
        self.kernel(mK, mV, mBeta, mAkk, mG, mQ, mW, mU, mKG, mQG, mCuSeqlens, mChunkOffsets,
                    tiled_mma, sA_layout, sKp_layout, sVp_layout, sOutW_layout, sOutU_layout).launch(
            grid=grid_shape(mK, mCuSeqlens, C, self.varlen),
            block=(self.num_threads, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, mK: cute.Tensor, mV: cute.Tensor, mBeta: cute.Tensor, mAkk: cute.Tensor,
               mG: cute.Tensor, mQ: cute.Tensor, mW: cute.Tensor, mU: cute.Tensor, mKG: cute.Tensor,
               mQG: cute.Tensor, mCuSeqlens: cute.Tensor, mChunkOffsets: cute.Tensor,
               tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout,
               sKp_layout: cute.ComposedLayout, sVp_layout: cute.ComposedLayout,
               sOutW_layout: cute.ComposedLayout, sOutU_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        _, head, _ = cute.arch.block_idx()
        is_valid, batch, row0, valid_rows = chunk_coords(mCuSeqlens, mChunkOffsets, mK.shape[1],
                                                         self.chunk, self.varlen)
        if is_valid:
            # Shared memory: Akk (8 KB), Kp and Vp as B operands (16 KB each), reused for staging.
            smem = SmemAllocator()
            sA = smem.allocate_tensor(cutlass.BFloat16, sA_layout, 16)
            sKp = smem.allocate_tensor(cutlass.BFloat16, sKp_layout, 16)
            sVp = smem.allocate_tensor(cutlass.BFloat16, sVp_layout, 16)
            # The output staging tiles reuse the Kp / Vp buffers once every warp has read them.
            sOutW = cute.make_tensor(sKp.iterator, sOutW_layout)
            sOutU = cute.make_tensor(sVp.iterator, sOutU_layout)

            # Inputs are read-only for the kernel's lifetime: invariant (ld.global.nc) loads.
            ld_bf16 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), cutlass.BFloat16,
                                          num_bits_per_copy=128, invariant=True)
            ld_f32 = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), cutlass.Float32,
                                         num_bits_per_copy=128, invariant=True)
            ld_beta = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), mBeta.element_type,
                                          num_bits_per_copy=mBeta.element_type.width, invariant=True)
            self.stage_operands(mK, mV, mBeta, mAkk, mG, mQ, mKG, mQG, sA, sKp, sVp, batch, head,
                                row0, valid_rows, tidx, ld_bf16, ld_f32, ld_beta)
            cute.arch.sync_threads()

            # W = Akk @ Kp, then U = Akk @ Vp; the Akk fragments are loaded once for both.
            thr_mma = tiled_mma.get_slice(tidx)
            s2r_A = cute.make_tiled_copy_A(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), cutlass.BFloat16), tiled_mma)
            s2r_B = cute.make_tiled_copy_B(
                cute.make_copy_atom(warp.LdMatrix8x8x16bOp(True, 4), cutlass.BFloat16), tiled_mma)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            thr_s2r_A = s2r_A.get_slice(tidx)
            cute.copy(s2r_A, thr_s2r_A.partition_S(sA), thr_s2r_A.retile(tCrA))

            self.product(tiled_mma, thr_mma, s2r_B, tCrA, sKp, sOutW, mW, batch, head, row0,
                         valid_rows, tidx)
            self.product(tiled_mma, thr_mma, s2r_B, tCrA, sVp, sOutU, mU, batch, head, row0,
                         valid_rows, tidx)

    @cute.jit
    def load_akk(self, mAkk: cute.Tensor, batch: cutlass.Int32, head: cutlass.Int32,
                 row0: cutlass.Int32, valid_rows: cutlass.Int32, tidx: cutlass.Int32,
                 ld_bf16: cute.CopyAtom):
        """Akk rows of this chunk -> registers (thread t: 16-byte column tile t % 8 of rows t // 8 + 16p).

        Loads of rows >= valid_rows are clamped to row valid_rows - 1; `store_akk` zeroes them.
        """
        chunks_per_row = self.chunk // VEC
        rows_per_pass = self.num_threads // chunks_per_row
        num_passes = self.chunk // rows_per_pass
        col_tile = tidx % chunks_per_row
        rA = _row_fragments(num_passes, cutlass.BFloat16)
        for p in cutlass.range_constexpr(num_passes):
            row = tidx // chunks_per_row + p * rows_per_pass
            src_row = row0 + min(row, valid_rows - 1)
            cute.copy(ld_bf16, cute.local_tile(mAkk[batch, src_row, head, None], (VEC,), (col_tile,)),
                      rA[p, None])
        return rA

    @cute.jit
    def store_akk(self, rA: cute.Tensor, sA: cute.Tensor, valid_rows: cutlass.Int32,
                  tidx: cutlass.Int32):
        """The rows from `load_akk` -> sA, rows >= valid_rows replaced by zero (select)."""
        chunks_per_row = self.chunk // VEC
        rows_per_pass = self.num_threads // chunks_per_row
        col_tile = tidx % chunks_per_row
        for p in cutlass.range_constexpr(cute.size(rA, mode=[0])):
            row = tidx // chunks_per_row + p * rows_per_pass
            keep = cute.full((VEC,), row < valid_rows, cutlass.Boolean)
            rA[p, None].store(cute.where(keep, rA[p, None].load(), cutlass.BFloat16(0.0)))
            cute.autovec_copy(rA[p, None], cute.local_tile(sA[row, None], (VEC,), (col_tile,)))

    @cute.jit
    def stage_operands(self, mK: cute.Tensor, mV: cute.Tensor, mBeta: cute.Tensor,
                       mAkk: cute.Tensor, mG: cute.Tensor, mQ: cute.Tensor, mKG: cute.Tensor,
                       mQG: cute.Tensor, sA: cute.Tensor, sKp: cute.Tensor, sVp: cute.Tensor,
                       batch: cutlass.Int32, head: cutlass.Int32, row0: cutlass.Int32,
                       valid_rows: cutlass.Int32, tidx: cutlass.Int32, ld_bf16: cute.CopyAtom,
                       ld_f32: cute.CopyAtom, ld_beta: cute.CopyAtom):
        """Akk -> sA; Kp, Vp -> sKp, sVp (B-operand layout (d, j)); KG, QG -> global.

        Thread t owns columns 8 * (t % 16) .. +7 of rows t // 16 + 8p, p = 0..7. The 8 row passes
        run in groups of 2; the loads of group n + 1 are issued before group n is computed and
        stored, and the Akk loads go out with the first group. Every load is unconditional (rows
        past valid_rows are clamped to row valid_rows - 1), so the loads of a group are in flight
        together; the values of those rows are then replaced by zero or never stored.
        """
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        col_tiles = self.head_k // VEC
        rows_per_pass = self.num_threads // col_tiles
        num_passes = self.chunk // rows_per_pass
        group = 2
        col_tile = tidx % col_tiles
        rGlast = cute.make_rmem_tensor((VEC,), f32)
        cute.copy(ld_f32, cute.local_tile(mG[batch, row0 + valid_rows - 1, head, None], (VEC,),
                                          (col_tile,)), rGlast)
        rA = self.load_akk(mAkk, batch, head, row0, valid_rows, tidx, ld_bf16)
        # Per pass: k, v, (q) bf16 and g fp32 for 8 columns, beta for the row.
        rK = _row_fragments(num_passes, bf16)
        rV = _row_fragments(num_passes, bf16)
        rQ = _row_fragments(num_passes, bf16)
        rG = _row_fragments(num_passes, f32)
        rBeta = cute.make_rmem_tensor((num_passes, 1), mBeta.element_type)
        for n in cutlass.range_constexpr(num_passes // group + 1):
            if cutlass.const_expr(n < num_passes // group):
                for p in cutlass.range_constexpr(n * group, (n + 1) * group):
                    src_row = row0 + min(tidx // col_tiles + p * rows_per_pass, valid_rows - 1)
                    cute.copy(ld_bf16, cute.local_tile(mK[batch, src_row, head, None], (VEC,),
                                                       (col_tile,)), rK[p, None])
                    cute.copy(ld_f32, cute.local_tile(mG[batch, src_row, head, None], (VEC,),
                                                      (col_tile,)), rG[p, None])
                    cute.copy(ld_bf16, cute.local_tile(mV[batch, src_row, head, None], (VEC,),
                                                       (col_tile,)), rV[p, None])
                    cute.copy(ld_beta, cute.local_tile(mBeta[batch, None, head], (1,), (src_row,)),
                              rBeta[p, None])
                    if cutlass.const_expr(self.output_qg):
                        cute.copy(ld_bf16, cute.local_tile(mQ[batch, src_row, head, None], (VEC,),
                                                           (col_tile,)), rQ[p, None])
            if cutlass.const_expr(n == 0):
                self.store_akk(rA, sA, valid_rows, tidx)
            else:
                for p in cutlass.range_constexpr((n - 1) * group, n * group):
                    row = tidx // col_tiles + p * rows_per_pass
                    self.gate_row(rK[p, None], rG[p, None], rV[p, None], rQ[p, None],
                                  rBeta[p, 0].to(f32), rGlast, mKG, mQG, sKp, sVp, batch, head,
                                  row0, row, valid_rows, col_tile)

    @cute.jit
    def gate_row(self, rK: cute.Tensor, rG: cute.Tensor, rV: cute.Tensor, rQ: cute.Tensor,
                 beta: cutlass.Float32, rGlast: cute.Tensor, mKG: cute.Tensor, mQG: cute.Tensor,
                 sKp: cute.Tensor, sVp: cute.Tensor, batch: cutlass.Int32, head: cutlass.Int32,
                 row0: cutlass.Int32, row: cutlass.Int32, valid_rows: cutlass.Int32,
                 col_tile: cutlass.Int32):
        """One row's 8 columns: Kp, Vp to smem (zero past valid_rows), KG, QG to global."""
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        is_row_valid = row < valid_rows
        keep = cute.full((VEC,), is_row_valid, cutlass.Boolean)
        k = rK.load().to(f32)
        g = rG.load()
        gate = cute.math.exp2(g, fastmath=True)

        rKp = cute.make_rmem_tensor((VEC,), bf16)
        rKp.store(cute.where(keep, ((k * beta) * gate).to(bf16), bf16(0.0)))
        cute.autovec_copy(rKp, cute.local_tile(sKp[None, row], (VEC,), (col_tile,)))
        rVp = cute.make_rmem_tensor((VEC,), bf16)
        rVp.store(cute.where(keep, (rV.load().to(f32) * beta).to(bf16), bf16(0.0)))
        cute.autovec_copy(rVp, cute.local_tile(sVp[None, row], (VEC,), (col_tile,)))

        rKG = cute.make_rmem_tensor((VEC,), bf16)
        rKG.store((k * cute.math.exp2(rGlast.load() - g, fastmath=True)).to(bf16))
        _store_vec_if(rKG, cute.local_tile(mKG[batch, row0 + row, head, None], (VEC,), (col_tile,)),
                      is_row_valid)
        if cutlass.const_expr(self.output_qg):
            rQG = cute.make_rmem_tensor((VEC,), bf16)
            rQG.store((rQ.load().to(f32) * gate).to(bf16))
            _store_vec_if(rQG, cute.local_tile(mQG[batch, row0 + row, head, None], (VEC,),
                                               (col_tile,)), is_row_valid)

    @cute.jit
    def product(self, tiled_mma: cute.TiledMma, thr_mma: cute.ThrMma, s2r_B: cute.TiledCopy,
                tCrA: cute.Tensor, sB: cute.Tensor, sOut: cute.Tensor, mOut: cute.Tensor,
                batch: cutlass.Int32, head: cutlass.Int32, row0: cutlass.Int32,
                valid_rows: cutlass.Int32, tidx: cutlass.Int32):
        """mOut rows of this chunk = bf16_RN(Akk @ B), staged through sOut (which aliases sB)."""
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        thr_s2r_B = s2r_B.get_slice(tidx)
        tBsB = thr_s2r_B.partition_S(sB)
        tBrB = thr_s2r_B.retile(tCrB)
        acc = tiled_mma.make_fragment_C(thr_mma.partition_C(sOut))
        acc.fill(0.0)
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            cute.copy(s2r_B, tBsB[None, None, kb], tBrB[None, None, kb])
            cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
        rOut = cute.make_rmem_tensor_like(acc, cutlass.BFloat16)
        rOut.store(acc.load().to(cutlass.BFloat16))
        cute.arch.sync_threads()  # every warp has finished reading sB: it becomes the staging tile
        cute.autovec_copy(rOut, thr_mma.partition_C(sOut))
        # Warp w's accumulator rows are 16w .. 16w+15 (MMA atoms 4x1x1 along M), and it copies out
        # exactly those rows: a warp barrier orders the staging.
        cute.arch.sync_warp()

        lane = tidx % 32
        warp_row0 = (tidx // 32) * 16
        col_tiles = cute.size(sOut, mode=[1]) // VEC
        rows_per_pass = 32 // col_tiles
        col_tile = lane % col_tiles
        for p in cutlass.range_constexpr(16 // rows_per_pass):
            row = warp_row0 + lane // col_tiles + p * rows_per_pass
            rRow = cute.make_rmem_tensor((VEC,), cutlass.BFloat16)
            cute.autovec_copy(cute.local_tile(sOut[row, None], (VEC,), (col_tile,)), rRow)
            _store_vec_if(rRow, cute.local_tile(mOut[batch, row0 + row, head, None], (VEC,),
                                                (col_tile,)), row < valid_rows)
