"""Akk = (I + L)^-1 for one (chunk, head) tile per CTA: fp32 blocked inverse, tensor-core merges.

Math. L is the strictly lower fp32 workspace written by the intra kernel ([B, T, H, C], column =
position in the chunk). For a tile with v = valid_rows rows, Akk is the inverse of I + L[:v, :v]:
unit lower triangular, exactly 1.0 on the diagonal and exactly +0.0 above it, rounded once (RN) to
the key's io dtype (bf16 or fp16). Every column of every valid row is written; rows >= v are
neither read nor written. Columns j >= v of a valid row i < v lie above the diagonal, so they are 0.

Arithmetic order (this fixes the bits; docs/numerics.md repeats it). X = Akk in fp32, by blocks of 16 rows:
1. Each 16 x 16 diagonal block X[b, b] = (I + L[b, b])^-1 by column forward substitution: column j,
       x_j = 1,  x_i = 0 (i < j),  x_i = -acc_ij (i > j), with a zero of either sign stored as +0.0,
       acc_ij = fma(L[i,i-1], x_{i-1}, ... fma(L[i,j+1], x_{j+1}, L[i,j] * x_j) ...)
   one fp32 chain per (i, j) in ascending s = j .. i-1 inside the block: `mul.rn.f32` for the first term,
   then `fma.rn.f32` for each further term.
2. Doubling merges, S = 16 then 32: for each pair of inverted S-row diagonal blocks, rows a..a+S-1 and
   u = a+S..a+2S-1,
       T = L[u, a] X[a, a],   X[u, a] = -(X[u, u] T),  a zero as +0.0,
   each product by 16 x 8 output tiles (`tile_inverse.tf32_product`): on the tensor cores, per k-step of 8
   (ascending) one `mma.sync m16n8k8 tf32` into one fp32 accumulator from +0, on operands rounded to TF32
   by `cvt.rna.tf32.f32` (to nearest, ties away from zero). T's column tile n
   sums the k-steps n .. S/8 - 1 (the steps before lie above X[a, a]'s diagonal: all +0 terms); X[u, a]'s
   row tile m (rows 16m ..) the k-steps 0 .. 2m + 1 (the later ones lie above X[u, u]'s diagonal).
   X[a.., a..] and X[u.., u..] are the unrounded fp32 results of the earlier steps.
Each Akk element is rounded to the io dtype once (cvt.rn). Signed zeros: every exact-zero result is stored as
+0.0, so no bit depends on how a compiler treats the sign of a zero.
Causality:
- Rows >= v of L are replaced by 0 in shared memory. Row i < v reads L[i, :i], earlier rows of X, and T rows
  of its own 16-row tile and earlier: the later rows of its own tile enter as X[u+i, u+k] = +0 times T[k],
  an exact zero for finite values. So the result for valid rows is independent of v: a chunk gives the same
  bits in dense mode, in varlen mode and in any batch, and appending tokens changes no earlier row.
- A non-finite L row (a non-finite input) reaches the earlier rows of its own 16-row block through
  0 x inf = NaN in a merge product; rows of earlier blocks never read it.

Warp roles (4 warps, 128 threads; `KernelConfig.warps` must be 4):
1. all warps: L tile -> smem (rows < v by 16-byte coalesced loads, rows >= v as zeros).
2. warp b: diagonal block b (lanes 0-15 one column each, ~120 FMAs per thread); lanes 16-31 write the +0
   blocks above the diagonal blocks.
3. S = 16: warps 0-1 merge blocks 0 and 1, warps 2-3 blocks 2 and 3, one 16 x 8 tile of T, then of X,
   per warp.
4. S = 32: all warps, two 16 x 8 tiles of T, then of X, per warp (`tile_inverse.pair_tiles`).
   A barrier between T and X and between the steps.
5. all warps: io-dtype tile (staged in smem) -> Akk rows < v with 16-byte stores.
Blocked instead of a whole-tile substitution: the substitution's dependent chain is 64 steps long and
its work sits on one or two warps at a time; here the chains are 16 steps long, and the merges, ~94% of
the multiply-adds, run on the tensor cores (as CUDA-core dot products they were bound by their shared-memory
reads: docs/performance.md).

Shared memory: L 64x64 fp32 with a 4-element row pad (17 KiB) + X 64x64 16-bit (8 KiB) + X00 32x32 fp32
(4 KiB) = 29,696 bytes per CTA; the pad and X00's swizzle (`tile_inverse.l_tile_layout`, `x00_layout`) spread
the merges' fragment reads over the banks. The fp32 X rows 0..31 live in X00; rows 32..63 and the merge
products T live in L's upper triangle, and the last T in L's upper-left block once nothing reads it
(templates/tile_inverse.py).

Code: steps 2-5 are the per-tile functions of templates/tile_inverse.py, shared with the fused
kernel; this file holds the standalone launch and step 1 (the global L load).

Constraints: chunk 64 or 32 (two diagonal blocks, warps 0-1, then one merge level, S = 16), warps == 4.
Portable (sm_80, sm_90a, sm_100a): plain loads and stores, CUDA-core FMAs and warp-level
`mma.sync` (tf32).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.memory import SmemAllocator

from kdajit.keys import CHUNK_SIZES, AkkInverseKey
from kdajit.templates.common import IO_TYPES, chunk_coords, fake_arguments, grid_shape, make_struct
from kdajit.templates.tile_inverse import (NUM_WARPS, akk_tile_layout, invert_tile, l_tile_elements,
                                           l_tile_layout, make_akk_store_copy, make_l_load_copy, store_akk_rows,
                                           x00_layout)


def inverse_smem_struct(chunk: int, io):
    """The inverse kernel's shared memory: L (fp32), Akk (`io`: bf16 or fp16) and X's unrounded rows
    0 .. C/2-1 (fp32)."""
    S = cute.struct
    return make_struct("InverseSmem", [
        ("l", S.Align[S.MemRange[cutlass.Float32, l_tile_elements(chunk)], 16]),
        ("akk", S.Align[S.MemRange[io, chunk * chunk], 16]),
        ("x00", S.Align[S.MemRange[cutlass.Float32, (chunk // 2) ** 2], 16]),
    ])


def smem_bytes(key) -> int:
    """Shared memory of one CTA of `key`'s kernel (the module docstring states it)."""
    return inverse_smem_struct(key.chunk, IO_TYPES[key.io_dtype]).__sizeof__()


class AkkInverse:
    """Akk = (I + L)^-1 (io dtype) from the fp32 strict-lower L workspace; one (chunk, head) per CTA."""

    def __init__(self, key: AkkInverseKey) -> None:
        self.key = key
        self.chunk = key.chunk
        self.io = IO_TYPES[key.io_dtype]
        self.varlen = key.varlen != "dense"
        self.num_threads = 32 * key.config.warps

    @staticmethod
    def can_implement(key: AkkInverseKey) -> bool:
        return key.chunk in CHUNK_SIZES and key.config.warps == NUM_WARPS and key.io_dtype in IO_TYPES

    def fake_args(self) -> tuple:
        return fake_arguments(self.key)

    @cute.jit
    def __call__(self, mL: cute.Tensor, mAkk: cute.Tensor, mCuSeqlens: cute.Tensor,
                 stream: cuda.CUstream):
        self.kernel(mL, mAkk, mCuSeqlens, make_l_load_copy(self.num_threads, self.chunk),
                    make_akk_store_copy(self.num_threads, self.io, self.chunk)).launch(
            grid=grid_shape(mL, mCuSeqlens, self.chunk, self.varlen), block=(self.num_threads, 1, 1),
            stream=stream)

    @cute.kernel
    def kernel(self, mL: cute.Tensor, mAkk: cute.Tensor, mCuSeqlens: cute.Tensor,
               load_copy: cute.TiledCopy, store_copy: cute.TiledCopy):
        C = self.chunk
        tidx, _, _ = cute.arch.thread_idx()
        _, head, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()

        storage = SmemAllocator().allocate(inverse_smem_struct(C, self.io))
        sL = storage.l.get_tensor(l_tile_layout(C))
        sX = storage.akk.get_tensor(akk_tile_layout(C))
        sX00 = storage.x00.get_tensor(x00_layout(C))

        is_valid, batch, row0, valid_rows = chunk_coords(mCuSeqlens, mL.shape[1],
                                                         C, self.varlen)
        if is_valid:
            gL = cute.local_tile(cute.domain_offset((row0, 0), mL[batch, None, head, None]),
                                 (C, C), (0, 0))
            gAkk = cute.local_tile(cute.domain_offset((row0, 0), mAkk[batch, None, head, None]),
                                   (C, C), (0, 0))
            cTile = cute.make_identity_tensor((C, C))

            # 1. L -> smem, rows >= valid_rows as zeros (never loaded).
            thr_load = load_copy.get_slice(tidx)
            tLgL = thr_load.partition_S(gL)
            tLcL = thr_load.partition_S(cTile)
            tLsL = thr_load.partition_D(sL)
            tLrL = cute.make_rmem_tensor_like(tLsL)
            tLrL.fill(0.0)
            for m in cutlass.range_constexpr(cute.size(tLgL, mode=[1])):
                if tLcL[0, m, 0][0] < valid_rows:
                    cute.copy(load_copy, tLgL[None, m, None], tLrL[None, m, None])
            cute.autovec_copy(tLrL, tLsL)
            cute.arch.sync_threads()

            # 2.-4. The solve; 5. X (io dtype, smem) -> Akk rows < valid_rows.
            invert_tile(sL, sX, sX00, warp_idx, lane)
            cute.arch.sync_threads()
            store_akk_rows(store_copy, sX, gAkk, tidx, valid_rows)
