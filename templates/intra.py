"""KDA intra-chunk products: Aqk and the strict-lower L workspace, one (chunk, head) per CTA.

Math, for rows i, j of one chunk (v = valid rows, i < v), g the chunk-local cumulative log2 gate:

    Aqk[i, j] = scale   * sum_d q[i,d] k[j,d] 2^(g[i,d] - g[j,d])   for j <= i, exactly 0 for j > i  (io)
    L[i, j]   = beta[i] * sum_d k[i,d] k[j,d] 2^(g[i,d] - g[j,d])   for j <  i, exactly 0 for j >= i (fp32)

q, k (and the Aqk output) are in the key's io dtype, bf16 or fp16. Every column of every valid
row is written; rows >= v are never read as data and never written.

Evaluation (FLA's factorisation). The chunk is cut into 16-row blocks a, b in 0..3. Each block pair
b <= a is a TF32 tensor-core product of gated operands with a per-pair reference row r:

    A side (rows of block a):    x_i * 2^(g_i - r)     x = q for Aqk, k for L
    B side (columns of block b): k_j * 2^(r - g_j)
    r = g[16a]                        the row block's first row (safe gate: every block b <= a; for a > b both
                                      factors are <= 1 for a non-increasing gate)
    r = g[16a] - DIAG_SHIFT           for a == b on the any-gate path (safe_gate=False; docs/numerics.md)

Every reference is a row <= every output row it serves and never depends on the chunk's length, so
no row's bits depend on later tokens (causal bit-invariance; docs/numerics.md has the bounds).

Arithmetic order (fixes the bits; see docs/numerics.md):
  - exponent difference in fp32 (g_i - r, r - g_j), 2^x with ex2.approx.ftz.f32, times the exact
    bf16/fp16 -> fp32 value, in fp32; rows >= v (A side) and columns >= v (B side) enter unmasked:
    they reach only output rows >= v (never stored) and columns j > i of diagonal blocks (selected away).
  - the fp32 operand bits feed the TF32 MMA unchanged (no cvt.rna): the tensor core ignores the
    low 13 mantissa bits, as in FLA's Triton kernels and cuLA.
  - mma.sync m16n8k8 tf32 with fp32 accumulate, one accumulator chain per 16x8 output tile over
    d = 0..K-1 in ascending steps of 8; inside a step, k-position c + 4t holds column 2c + t
    (`tile_intra.mma_step_order`).
  - then times scale (Aqk) or beta_i (L, beta as fp32), then the triangular mask (select), then
    RN to the io dtype (Aqk) or stored as fp32 (L).

Warp roles: 4 warps, all loaders, then each warp owns fixed row-block groups (a group shares one
A-side operand, so its exp2 is computed once for all its column blocks). Safe gate: a row block's diagonal block
shares its A side (and comes last in its group, with the zero blocks right of it); row block 3 is split over two
warps so that no warp has more than A + 3 B sides of work per head-dim step (`tile_intra.WARP_GROUPS`):
    warp 0: a=3, b = 0, 1, 2
    warp 1: a=3, b = 3;  a=0, b = 0
    warp 2: a=2, b = 0, 1, 2
    warp 3: a=1, b = 0, 1
Any gate (`tile_intra.WARP_GROUPS_EXACT`): the diagonal blocks, with their own shifted reference, apart from the
off-diagonal groups, one per warp.
A group whose row block has no valid row (16a >= v) is skipped. Gated operands are computed
straight into the MMA fragments from shared q, k, g (CuTe `partition_A/B` views; a stride-0 view
of the reference row gives r per fragment element), so nothing is staged besides the inputs.

Memory: q, k (io) and g (fp32) of the chunk are read once into padded shared tiles (row pitch +16 bytes: the MMA
fragment reads are bank-conflict free) by the same loads as the fused kernel's (`tile_intra.issue_tile_loads`, on
the path of `tile_intra.loads_of`): on sm_90a / sm_100a one TMA box per tile at K = 64, 128 (`issue_tma_tiles`) or one
cp.async.bulk per row at K = 256 (`issue_bulk_rows`), else with 16-byte cp.async; beta goes to a 64-entry fp32
vector. Shared memory 68,992 bytes at K = 128 on sm_90a (with the bulk loads' mbarrier; 68,864 with cp.async).
Output fragments are stored straight to global memory (Aqk 4-byte, L 8-byte vector stores).

Code: the per-tile arithmetic (loads, block products, epilogue, block stores) is in
templates/tile_intra.py, shared with the fused kernel; this file holds the standalone launch only.

Constraints: head_k a keys.HEAD_DIMS size, or a padded one (60, 100: `keys.head_dim_supported`; the shared tiles
then have `keys.padded_head_dim(K)` columns, those past K +0, and the q, k loads are 8-byte pieces where K is
not a multiple of 8), chunk 64 or 32 (blocks a, b in 0..1, WARP_GROUPS_32), 4 warps.
Contiguous [B, T, H, D] tensors; varlen packs sequences on T with B = 1 (see templates/common.py for the
grid and the chunk mapping). Grouped value heads: gk, beta and the outputs have HV heads, q and k H (HV a
multiple of H); value head h reads q, k of head h // (HV / H).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.memory import SmemAllocator

from kdajit.keys import ARCHS, CHUNK_SIZES, VARLEN_MODES, IntraKey, head_dim_supported, padded_head_dim
from kdajit.templates.common import (DTYPES, IO_TYPES, chunk_coords, chunk_rows, fake_arguments, grid_shape,
                                    make_struct, make_tf32_mma)
from kdajit.templates.tile_intra import (NUM_WARPS, init_tile_loads, intra_tile, issue_tile_loads, load_beta,
                                         loads_mbar_fields, loads_of, make_row_copy, make_tma_tiles, padded_pitch,
                                         padded_tile_layout, wait_tile_loads, warp_schedule)


def intra_smem_struct(chunk: int, head_k: int, io, path: str):
    """The intra kernel's shared memory: padded q, k (`io`: bf16 or fp16) and g (fp32) tiles, the
    beta vector and what the tile loads of `path` (`loads_of`) need (`loads_mbar_fields`)."""
    S, f32 = cute.struct, cutlass.Float32
    return make_struct("IntraSmem", [
        ("q", S.Align[S.MemRange[io, chunk * padded_pitch(io, head_k)], 128]),
        ("k", S.Align[S.MemRange[io, chunk * padded_pitch(io, head_k)], 128]),
        ("g", S.Align[S.MemRange[f32, chunk * padded_pitch(f32, head_k)], 128]),
        ("beta", S.Align[S.MemRange[f32, chunk], 16]),
    ] + loads_mbar_fields(path))


def smem_bytes(key) -> int:
    """Shared memory of one CTA of `key`'s kernel (the module docstring states it)."""
    return intra_smem_struct(key.chunk, padded_head_dim(key.head_k), IO_TYPES[key.io_dtype],
                             loads_of(key)).__sizeof__()


class KdaIntra:
    """Aqk (io dtype) and L (fp32 workspace) for one (chunk, head) per CTA; see the module docstring."""

    def __init__(self, key: IntraKey):
        self.key = key
        self.head_k = padded_head_dim(key.head_k)  # the shared tiles' columns (K itself is the tensors' last size)
        self.chunk = key.chunk
        self.io = IO_TYPES[key.io_dtype]
        self.varlen = key.varlen != "dense"
        self.num_threads = 32 * key.config.warps
        self.safe_gate = key.safe_gate
        self.load_path = loads_of(key)  # "tma", "bulk" or "cp.async"

    @staticmethod
    def can_implement(key) -> bool:
        return (isinstance(key, IntraKey) and key.config.warps == NUM_WARPS and head_dim_supported(key.head_k)
                and key.chunk in CHUNK_SIZES and key.beta_dtype in DTYPES and key.varlen in VARLEN_MODES
                and key.io_dtype in IO_TYPES and key.arch in ARCHS and isinstance(key.safe_gate, bool))

    def fake_args(self) -> tuple:
        return fake_arguments(self.key)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mGk: cute.Tensor, mBeta: cute.Tensor,
                 mAqk: cute.Tensor, mL: cute.Tensor, mCuSeqlens: cute.Tensor,
                 scale: cutlass.Float32, stream: cuda.CUstream):
        tiled_mma = make_tf32_mma()
        copy_qk = make_row_copy(self.io, self.key.head_k, self.num_threads)
        copy_g = make_row_copy(cutlass.Float32, self.key.head_k, self.num_threads)
        tma_tiles = make_tma_tiles(mQ, mK, mGk, self.chunk, self.load_path)
        self.kernel(mQ, mK, mGk, mBeta, mAqk, mL, mCuSeqlens, scale, tiled_mma, copy_qk,
                    copy_g, tma_tiles).launch(grid=grid_shape(mGk, mCuSeqlens, self.chunk, self.varlen),
                                   block=(self.num_threads, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor, mBeta: cute.Tensor,
               mAqk: cute.Tensor, mL: cute.Tensor, mCuSeqlens: cute.Tensor,
               scale: cutlass.Float32, tiled_mma: cute.TiledMma, copy_qk: cute.TiledCopy,
               copy_g: cute.TiledCopy, tma_tiles):
        tidx, _, _ = cute.arch.thread_idx()
        _, head, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = tidx % 32
        is_valid, batch, row0, valid_rows = chunk_coords(mCuSeqlens, mQ.shape[1],
                                                         self.chunk, self.varlen)

        storage = SmemAllocator().allocate(intra_smem_struct(self.chunk, self.head_k, self.io, self.load_path))
        f32 = cutlass.Float32
        sQ = storage.q.get_tensor(padded_tile_layout(self.io, self.chunk, self.head_k))
        sK = storage.k.get_tensor(padded_tile_layout(self.io, self.chunk, self.head_k))
        sG = storage.g.get_tensor(padded_tile_layout(f32, self.chunk, self.head_k))
        sBeta = storage.beta.get_tensor(cute.make_layout(self.chunk))
        mbar_ptr = init_tile_loads(storage, self.load_path, self.num_threads // 32)

        if is_valid:
            issue_tile_loads(self.load_path, mbar_ptr, tma_tiles, (copy_qk, copy_g), (mQ, mK, mG), (sQ, sK, sG),
                             batch, head, row0, valid_rows, tidx, self.num_threads // 32)
            load_beta(mBeta, sBeta, batch, row0, head, tidx, valid_rows, self.chunk)
            wait_tile_loads(self.load_path, mbar_ptr, 0)
            cute.arch.sync_threads()

            intra_tile(tiled_mma, sQ, sK, sG, sBeta, chunk_rows(mAqk, batch, head, row0, self.chunk),
                       chunk_rows(mL, batch, head, row0, self.chunk), warp_idx, lane, valid_rows, scale,
                       self.key.head_k, warp_schedule(NUM_WARPS, self.safe_gate, self.chunk), self.safe_gate)
