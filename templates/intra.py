"""KDA intra-chunk products: Aqk and the strict-lower L workspace, one (chunk, head) per CTA.

Math, for rows i, j of one chunk (v = valid rows, i < v), g the chunk-local cumulative log2 gate:

    Aqk[i, j] = scale   * sum_d q[i,d] k[j,d] 2^(g[i,d] - g[j,d])   for j <= i, exactly 0 for j > i  (bf16)
    L[i, j]   = beta[i] * sum_d k[i,d] k[j,d] 2^(g[i,d] - g[j,d])   for j <  i, exactly 0 for j >= i (fp32)

Every column of every valid row is written; rows >= v are never read as data and never written.

Evaluation (FLA's factorisation). The chunk is cut into 16-row blocks a, b in 0..3. Each block pair
b <= a is a TF32 tensor-core product of gated operands with a per-pair reference row r:

    A side (rows of block a):    x_i * 2^(g_i - r)     x = q for Aqk, k for L
    B side (columns of block b): k_j * 2^(r - g_j)
    r = g[16a]                        for a > b (both factors <= 1 for a non-increasing gate)
    r = g[16a] - DIAG_SHIFT           for a == b (the block's first row, shifted by a constant)

Every reference is a row <= every output row it serves and never depends on the chunk's length, so
no row's bits depend on later tokens (causal bit-invariance; docs/numerics.md has the bounds).

Arithmetic order (fixes the bits; see docs/numerics.md):
  - exponent difference in fp32 (g_i - r, r - g_j), 2^x with ex2.approx.ftz.f32, times the exact
    bf16->fp32 value, in fp32; operands of rows >= v (A side) and columns >= v (B side) are
    replaced by 0 with a select.
  - the fp32 operand bits feed the TF32 MMA unchanged (no cvt.rna): the tensor core ignores the
    low 13 mantissa bits, as in FLA's Triton kernels and cuLA.
  - mma.sync m16n8k8 tf32 with fp32 accumulate, one accumulator chain per 16x8 output tile over
    d = 0..K-1 in ascending steps of 8.
  - then times scale (Aqk) or beta_i (L, beta as fp32), then the triangular mask (select), then
    RN to bf16 (Aqk) or stored as fp32 (L).

Warp roles: 4 warps, all loaders, then each warp owns fixed row-block groups (a group shares one
A-side operand, so its exp2 is computed once for all its column blocks):
    warp 0: a=3 off-diagonal, b = 0, 1, 2
    warp 1: a=2 off-diagonal, b = 0, 1;  a=0 diagonal (and the zero blocks right of it)
    warp 2: a=1 off-diagonal, b = 0;     a=1 diagonal (and the zero blocks right of it)
    warp 3: a=2 diagonal (and zeros);    a=3 diagonal
A group whose row block has no valid row (16a >= v) is skipped. Gated operands are computed
straight into the MMA fragments from shared q, k, g (CuTe `partition_A/B` views; a stride-0 view
of the reference row gives r per fragment element), so nothing is staged besides the inputs.

Memory: q, k (bf16) and g (fp32) of the chunk are read once with 16-byte cp.async into padded
shared tiles (row pitch +16 bytes: the MMA fragment reads are bank-conflict free); beta goes to a
64-entry fp32 vector. Shared memory 68,864 bytes. Output fragments are stored straight to global
memory (Aqk 4-byte, L 8-byte vector stores).

Constraints: head_k = 128, chunk = 64, 4 warps. Contiguous [B, T, H, D] tensors; varlen packs
sequences on T with B = 1 (see templates/common.py for the grid and the chunk mapping).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.cute.runtime import make_fake_stream
from cutlass.memory import SmemAllocator

from kdajit.keys import ARCHS, VARLEN_MODES, IntraKey
from kdajit.templates.common import DTYPES, SymbolicShapes, chunk_coords, grid_shape

SUB = 16        # rows of one sub-block (the MMA M)
MMA_K = 8       # head-dim step of one mma.sync m16n8k8
PAD_BYTES = 16  # extra bytes per shared row: shifts consecutive rows by 4 banks
# Diagonal-block reference shift (log2 units). Under the safe gate (per-token log-gate >= -5, i.e.
# >= -5/ln 2 = -7.21 in log2) a 16-row block spans at most 15 * 7.21 = 108.2, so with r = g[16a] - 54
# the A factor 2^(g_i - r) lies in [2^-54.2, 2^54] and the B factor 2^(r - g_j) in [2^-54, 2^54.2].
DIAG_SHIFT = 54.0

# (row block a, diagonal?, column blocks b) per warp; see the module docstring.
WARP_GROUPS = (
    ((3, False, (0, 1, 2)),),
    ((2, False, (0, 1)), (0, True, (0,))),
    ((1, False, (0,)), (1, True, (1,))),
    ((2, True, (2,)), (3, True, (3,))),
)


class KdaIntra:
    """Aqk (bf16) and L (fp32 workspace) for one (chunk, head) per CTA; see the module docstring."""

    def __init__(self, key: IntraKey):
        self.key = key
        self.head_k = key.head_k
        self.chunk = key.chunk
        self.varlen = key.varlen != "dense"
        self.beta_dtype = DTYPES[key.beta_dtype]
        self.num_warps = key.config.warps
        self.num_threads = 32 * self.num_warps
        self.row_blocks = self.chunk // SUB

    @staticmethod
    def can_implement(key) -> bool:
        return (isinstance(key, IntraKey) and key.config.warps == 4 and key.head_k == 128
                and key.chunk == 64 and key.beta_dtype in DTYPES and key.varlen in VARLEN_MODES
                and key.arch in ARCHS)

    def fake_args(self) -> tuple:
        shapes = SymbolicShapes()
        q = shapes.bthd(cutlass.BFloat16, self.head_k)
        k = shapes.bthd(cutlass.BFloat16, self.head_k)
        g = shapes.bthd(cutlass.Float32, self.head_k)
        beta = shapes.bth(self.beta_dtype)
        aqk = shapes.bthd(cutlass.BFloat16, self.chunk)
        workspace_l = shapes.bthd(cutlass.Float32, self.chunk)
        cu_seqlens, chunk_offsets = shapes.seq_vectors(self.key.varlen)
        return (q, k, g, beta, aqk, workspace_l, cu_seqlens, chunk_offsets, cutlass.Float32(1.0),
                make_fake_stream(use_tvm_ffi_env_stream=True))

    def _smem_layout(self, dtype):
        pitch = self.head_k + PAD_BYTES * 8 // dtype.width
        return cute.make_layout((self.chunk, self.head_k), stride=(pitch, 1))

    def _g2s_copy(self, dtype):
        """cp.async 16-byte copies of a [chunk, head_k] tile by all threads, row-major."""
        vec = 128 // dtype.width
        threads_per_row = self.head_k // vec
        atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                                   num_bits_per_copy=128)
        thr_layout = cute.make_layout((self.num_threads // threads_per_row, threads_per_row),
                                      stride=(threads_per_row, 1))
        return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, vec)))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
                 mAqk: cute.Tensor, mL: cute.Tensor, mCuSeqlens: cute.Tensor, mChunkOffsets: cute.Tensor,
                 scale: cutlass.Float32, stream: cuda.CUstream):
        # One warp per tiled MMA: every warp owns whole 16x16 output blocks.
        tiled_mma = cute.make_tiled_mma(warp.MmaTF32Op((SUB, 8, MMA_K)), cute.make_layout((1, 1, 1)))
        copy_qk = self._g2s_copy(cutlass.BFloat16)
        copy_g = self._g2s_copy(cutlass.Float32)
        self.kernel(mQ, mK, mG, mBeta, mAqk, mL, mCuSeqlens, mChunkOffsets, scale, tiled_mma, copy_qk,
                    copy_g).launch(grid=grid_shape(mQ, mCuSeqlens, self.chunk, self.varlen),
                                   block=(self.num_threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
               mAqk: cute.Tensor, mL: cute.Tensor, mCuSeqlens: cute.Tensor, mChunkOffsets: cute.Tensor,
               scale: cutlass.Float32, tiled_mma: cute.TiledMma, copy_qk: cute.TiledCopy,
               copy_g: cute.TiledCopy):
        tidx, _, _ = cute.arch.thread_idx()
        _, head, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        is_valid, batch, row0, valid_rows = chunk_coords(mCuSeqlens, mChunkOffsets, mQ.shape[1],
                                                         self.chunk, self.varlen)

        # ///////////////////////////////////////////////////////////////////////////////
        #  Shared memory
        # ///////////////////////////////////////////////////////////////////////////////
        smem = SmemAllocator()
        sQ = smem.allocate_tensor(cutlass.BFloat16, self._smem_layout(cutlass.BFloat16), 128)
        sK = smem.allocate_tensor(cutlass.BFloat16, self._smem_layout(cutlass.BFloat16), 128)
        sG = smem.allocate_tensor(cutlass.Float32, self._smem_layout(cutlass.Float32), 128)
        sBeta = smem.allocate_tensor(cutlass.Float32, cute.make_layout(self.chunk), 16)

        if is_valid:
            # ///////////////////////////////////////////////////////////////////////////////
            #  Load q, k, g (rows < valid_rows only) and beta
            # ///////////////////////////////////////////////////////////////////////////////
            tile = (self.chunk, self.head_k)
            gQ = cute.local_tile(cute.domain_offset((row0, 0), mQ[batch, None, head, None]), tile, (0, 0))
            gK = cute.local_tile(cute.domain_offset((row0, 0), mK[batch, None, head, None]), tile, (0, 0))
            gG = cute.local_tile(cute.domain_offset((row0, 0), mG[batch, None, head, None]), tile, (0, 0))
            cTile = cute.make_identity_tensor(tile)
            self.load_rows(copy_qk, gQ, sQ, cTile, tidx, valid_rows)
            self.load_rows(copy_qk, gK, sK, cTile, tidx, valid_rows)
            self.load_rows(copy_g, gG, sG, cTile, tidx, valid_rows)
            cute.arch.cp_async_commit_group()
            if tidx < self.chunk:
                beta = cutlass.Float32(0.0)
                if tidx < valid_rows:
                    beta = cutlass.Float32(mBeta[batch, row0 + tidx, head])
                sBeta[tidx] = beta
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()

            # ///////////////////////////////////////////////////////////////////////////////
            #  Block products and epilogue, one static group list per warp
            # ///////////////////////////////////////////////////////////////////////////////
            out_tile = (self.chunk, self.chunk)
            gAqk = cute.local_tile(cute.domain_offset((row0, 0), mAqk[batch, None, head, None]), out_tile,
                                   (0, 0))
            gL = cute.local_tile(cute.domain_offset((row0, 0), mL[batch, None, head, None]), out_tile, (0, 0))
            for w in cutlass.range_constexpr(self.num_warps):
                if warp_idx == w:
                    for group in cutlass.range_constexpr(len(WARP_GROUPS[w])):
                        a, diagonal, col_blocks = WARP_GROUPS[w][group]
                        if SUB * a < valid_rows:
                            self.row_block_group(tiled_mma, sQ, sK, sG, sBeta, gAqk, gL, lane, valid_rows,
                                                 scale, a, diagonal, col_blocks)

    @cute.jit
    def load_rows(self, tiled_copy: cute.TiledCopy, gX: cute.Tensor, sX: cute.Tensor, cX: cute.Tensor,
                  tidx: cutlass.Int32, valid_rows: cutlass.Int32):
        """cp.async the rows < valid_rows of a [chunk, head_k] tile; other rows stay unwritten."""
        thr_copy = tiled_copy.get_slice(tidx)
        tXgX = thr_copy.partition_S(gX)
        tXsX = thr_copy.partition_D(sX)
        tXcX = thr_copy.partition_S(cX)
        for m in cutlass.range_constexpr(cute.size(tXgX, mode=[1])):
            if tXcX[0, m, 0][0] < valid_rows:
                cute.copy(tiled_copy, tXgX[None, m, None], tXsX[None, m, None])

    @cute.jit
    def row_block_group(self, tiled_mma: cute.TiledMma, sQ: cute.Tensor, sK: cute.Tensor, sG: cute.Tensor,
                        sBeta: cute.Tensor, gAqk: cute.Tensor, gL: cute.Tensor, lane: cutlass.Int32,
                        valid_rows: cutlass.Int32, scale: cutlass.Float32, a: cutlass.Constexpr,
                        diagonal: cutlass.Constexpr, col_blocks: cutlass.Constexpr):
        """Blocks (a, b) for b in col_blocks, all with one reference row; also the zero blocks b > a
        when `diagonal` (then col_blocks == (a,))."""
        thr_mma = tiled_mma.get_slice(lane)
        sub = (SUB, self.head_k)

        # g[16a, d] for every (row, d) of a 16-row block: a stride-0 view of the block's first row.
        sRef = cute.make_tensor(cute.domain_offset((SUB * a, 0), sG).iterator,
                                cute.make_layout(sub, stride=(0, 1)))
        cSub = cute.make_identity_tensor(sub)

        # A side: rows of block a, shared by every column block of the group.
        tAsQ = thr_mma.partition_A(cute.local_tile(sQ, sub, (a, 0)))
        tAsK = thr_mma.partition_A(cute.local_tile(sK, sub, (a, 0)))
        tAsG = thr_mma.partition_A(cute.local_tile(sG, sub, (a, 0)))
        tAsRef = thr_mma.partition_A(sRef)
        tAcA = thr_mma.partition_A(cSub)
        rowValid = cute.make_rmem_tensor(tAcA[None, None, 0].shape, cutlass.Boolean)
        for v in cutlass.range_constexpr(cute.size(rowValid)):
            rowValid[v] = SUB * a + tAcA[None, None, 0][v][0] < valid_rows
        rQA = cute.make_rmem_tensor(tAsG[None, None, 0].shape, cutlass.Float32)
        rKA = cute.make_rmem_tensor(tAsG[None, None, 0].shape, cutlass.Float32)

        # B side: per column block, the columns (k rows) of block b with the same reference.
        tBsK = [thr_mma.partition_B(cute.local_tile(sK, sub, (b, 0))) for b in col_blocks]
        tBsG = [thr_mma.partition_B(cute.local_tile(sG, sub, (b, 0))) for b in col_blocks]
        tBsRef = thr_mma.partition_B(sRef)
        tBcB = thr_mma.partition_B(cSub)
        colValid = [cute.make_rmem_tensor(tBcB[None, None, 0].shape, cutlass.Boolean) for _ in col_blocks]
        for n in cutlass.range_constexpr(len(col_blocks)):
            for v in cutlass.range_constexpr(cute.size(colValid[n])):
                colValid[n][v] = SUB * col_blocks[n] + tBcB[None, None, 0][v][0] < valid_rows
        rKB = cute.make_rmem_tensor(tBsG[0][None, None, 0].shape, cutlass.Float32)

        cC = thr_mma.partition_C(cute.make_identity_tensor((SUB, SUB)))
        accQK = [cute.make_rmem_tensor(cC.shape, cutlass.Float32) for _ in col_blocks]
        accKK = [cute.make_rmem_tensor(cC.shape, cutlass.Float32) for _ in col_blocks]
        for n in cutlass.range_constexpr(len(col_blocks)):
            accQK[n].fill(0.0)
            accKK[n].fill(0.0)

        # ///////////////////////////////////////////////////////////////////////////////
        #  MAINLOOP: one accumulator chain per 16x8 tile over d, ascending
        # ///////////////////////////////////////////////////////////////////////////////
        for kk in cutlass.range(self.head_k // MMA_K, unroll=2):
            refA = tAsRef[None, None, kk].load()
            refB = tBsRef[None, None, kk].load()
            if cutlass.const_expr(diagonal):
                refA = refA - cutlass.Float32(DIAG_SHIFT)
                refB = refB - cutlass.Float32(DIAG_SHIFT)
            gateA = cute.math.exp2(tAsG[None, None, kk].load() - refA, fastmath=True)
            rQA.store(cute.where(rowValid.load(), tAsQ[None, None, kk].load().to(cutlass.Float32) * gateA,
                                 cutlass.Float32(0.0)))
            rKA.store(cute.where(rowValid.load(), tAsK[None, None, kk].load().to(cutlass.Float32) * gateA,
                                 cutlass.Float32(0.0)))
            for n in cutlass.range_constexpr(len(col_blocks)):
                gateB = cute.math.exp2(refB - tBsG[n][None, None, kk].load(), fastmath=True)
                rKB.store(cute.where(colValid[n].load(),
                                     tBsK[n][None, None, kk].load().to(cutlass.Float32) * gateB,
                                     cutlass.Float32(0.0)))
                tf32KB = cute.recast_tensor(rKB, cutlass.TFloat32)
                cute.gemm(tiled_mma, accQK[n], cute.recast_tensor(rQA, cutlass.TFloat32), tf32KB, accQK[n])
                cute.gemm(tiled_mma, accKK[n], cute.recast_tensor(rKA, cutlass.TFloat32), tf32KB, accKK[n])

        # ///////////////////////////////////////////////////////////////////////////////
        #  EPILOG: scale / beta, mask, cast, store rows < valid_rows
        # ///////////////////////////////////////////////////////////////////////////////
        rBeta = cute.make_rmem_tensor(cC.shape, cutlass.Float32)
        for v in cutlass.range_constexpr(cute.size(rBeta)):
            rBeta[v] = sBeta[SUB * a + cC[v][0]]
        for n in cutlass.range_constexpr(len(col_blocks)):
            b = col_blocks[n]
            aqk = accQK[n].load() * scale
            lkk = accKK[n].load() * rBeta.load()
            if cutlass.const_expr(diagonal):
                keepQK = cute.make_rmem_tensor(cC.shape, cutlass.Boolean)
                keepKK = cute.make_rmem_tensor(cC.shape, cutlass.Boolean)
                for v in cutlass.range_constexpr(cute.size(cC)):
                    keepQK[v] = cC[v][1] <= cC[v][0]
                    keepKK[v] = cC[v][1] < cC[v][0]
                aqk = cute.where(keepQK.load(), aqk, cutlass.Float32(0.0))
                lkk = cute.where(keepKK.load(), lkk, cutlass.Float32(0.0))
            rAqk = cute.make_rmem_tensor(cC.shape, cutlass.BFloat16)
            rAqk.store(aqk.to(cutlass.BFloat16))
            rL = cute.make_rmem_tensor(cC.shape, cutlass.Float32)
            rL.store(lkk)
            self.store_block(thr_mma, rAqk, gAqk, rL, gL, cC, valid_rows, a, b)
        if cutlass.const_expr(diagonal):
            rAqkZero = cute.make_rmem_tensor(cC.shape, cutlass.BFloat16)
            rAqkZero.fill(0.0)
            rLZero = cute.make_rmem_tensor(cC.shape, cutlass.Float32)
            rLZero.fill(0.0)
            for b in cutlass.range_constexpr(a + 1, self.row_blocks):
                self.store_block(thr_mma, rAqkZero, gAqk, rLZero, gL, cC, valid_rows, a, b)

    @cute.jit
    def store_block(self, thr_mma: cute.core.ThrMma, rAqk: cute.Tensor, gAqk: cute.Tensor, rL: cute.Tensor,
                    gL: cute.Tensor, cC: cute.Tensor, valid_rows: cutlass.Int32, a: cutlass.Constexpr,
                    b: cutlass.Constexpr):
        """Store the (a, b) 16x16 block of Aqk and L from accumulator-layout fragments; rows >= valid_rows
        are skipped. Each (row half, n-tile) slice is 2 consecutive columns: one vector store."""
        tCgAqk = thr_mma.partition_C(cute.local_tile(gAqk, (SUB, SUB), (a, b)))
        tCgL = thr_mma.partition_C(cute.local_tile(gL, (SUB, SUB), (a, b)))
        for h in cutlass.range_constexpr(2):
            if SUB * a + cC[(0, h), 0, 0][0] < valid_rows:
                for n in cutlass.range_constexpr(cute.size(cC, mode=[2])):
                    cute.autovec_copy(rAqk[(None, h), 0, n], tCgAqk[(None, h), 0, n])
                    cute.autovec_copy(rL[(None, h), 0, n], tCgL[(None, h), 0, n])
