"""Per-tile device functions of the intra phase: Aqk and L from q, k, g, beta in shared memory.

Shared by `templates/intra.py` (L goes to the global fp32 workspace) and `templates/fused_forward.py`
(L stays in shared memory for the inverse). The math, the block schedule and the arithmetic order
are documented in `templates/intra.py` and docs/numerics.md; every kernel that needs these products
calls exactly this code, so the bits cannot drift apart.

Inputs are [chunk, head_k] shared tiles in the padded row layout of `padded_tile_layout` (q, k in
the io dtype, bf16 or fp16; g fp32) and a [chunk] fp32 beta vector (0 for rows >= valid_rows).
Outputs go to any [chunk, chunk] tensor, global or shared: the block store `store_block` only needs
`partition_C` views of it.

Both kernels fill those tiles the same way too: `loads_of` gives a kernel's load path (TMA boxes, bulk rows or
cp.async, `load_path`); `loads_mbar_fields` (its shared memory), `make_tma_tiles` (host side), `init_tile_loads`,
`issue_tile_loads` and `wait_tile_loads` (device side) are the whole of it.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op

from kdajit.keys import padded_head_dim
from kdajit.templates.common import (IO_TYPES, RN, chunk_rows, global_vec, heads_as_columns, ptx_asm, qk_head, tf32,
                                     tf32x3_gemm, tma_chunk_coords, widened)

SUB = 16        # rows of one sub-block (the MMA M)
MMA_K = 8       # head-dim step of one mma.sync m16n8k8
PAD_BYTES = 16  # extra bytes per shared row: shifts consecutive rows by 4 banks
BULK_GRANULE = 16  # bytes: the address and size unit of cp.async.bulk
TMA_BOX_MAX = 256  # elements: the largest TMA box dimension
# Diagonal-block reference shift of the any-gate path (log2 units): r = g[16a] - DIAG_SHIFT (FAST_SPREAD below). The
# safe-gate path's diagonal blocks take r = g[16a] unshifted, as its off-diagonal blocks do, so one A side serves a
# row block's every column block (WARP_GROUPS): under the safe gate (per-token log-gate >= -5, i.e. >= -5/ln 2 = -7.21
# in log2) a 16-row block spans at most 15 * 7.21 = 108.2, so the A factor 2^(g_i - r) lies in [2^-108.2, 1] and the
# B factor 2^(r - g_j) in [1, 2^108.2].
DIAG_SHIFT = 54.0
# Any gate (`safe_gate=False`): a row i of a diagonal block whose gate drops at most FAST_SPREAD from the block's first
# row in every column (g[16a, d] - g[i, d] <= FAST_SPREAD) takes the shifted reference's factors, multiplied
# as 3xTF32: its A factors lie in [2^(54 - 150), 2^54] and the B factors of its columns j <= i in [2^-54, 2^96], so
# no factor over- or underflows (an operand below ~2^-103 has a subnormal lo part: a negligible loss). The other rows,
# and a row with a NaN exponent, take `exact_diagonal`. A row's path depends on rows 16a and i only (causal). CPU
# study: benchmarks/any_gate_numerics.py.
FAST_SPREAD = 150.0

# (row block a, diagonal?, column blocks b) per warp; see templates/intra.py. A diagonal group's last column block is
# a itself (masked, and the zero blocks right of it stored); its other blocks share the A side. Balanced by each
# warp's work per head-dim step (A side ~24 instructions per lane, B side ~16, 4 mma.sync per block): row block 3 is
# split over warps 0 and 1 (its A side computed twice), so the busiest warp has A + 3 B or 2 A + 2 B (~84-88)
# instead of row block 3's A + 4 B (~104). Warp w of both CTAs on an SM shares one SM sub-partition, so the busiest
# warp also bounds the intra phase's throughput there.
WARP_GROUPS = (
    ((3, False, (0, 1, 2)),),
    ((3, True, (3,)), (0, True, (0,))),
    ((2, True, (0, 1, 2)),),
    ((1, True, (0, 1)),),
)
NUM_WARPS = len(WARP_GROUPS)
# The same blocks over 8 warps (the fused kernel's 8-warp configurations). A block's bits do not depend
# on the warp or on the other blocks of its group: each has its own accumulator chain over d, and the
# shared A-side operand of a group is the same value whichever group computes it.
WARP_GROUPS_8 = (
    ((3, False, (0, 1)),),
    ((3, False, (2,)),),
    ((2, False, (0, 1)),),
    ((1, False, (0,)),),
    ((0, True, (0,)),),
    ((1, True, (1,)),),
    ((2, True, (2,)),),
    ((3, True, (3,)),),
)

# The any-gate schedule (safe_gate=False): the diagonal blocks cost more (3xTF32 products, and `exact_diagonal` on the
# CUDA cores for the rows of steep gates), so every warp takes one, beside the off-diagonal groups.
WARP_GROUPS_EXACT = (
    ((3, False, (0, 1, 2)), (0, True, (0,))),
    ((2, False, (0, 1)), (1, True, (1,))),
    ((1, False, (0,)), (2, True, (2,))),
    ((3, True, (3,)),),
)
EXACT_STEP = 4  # head-dim columns per shared load in `exact_diagonal` (16 bytes of g)
# Chunk 32: three blocks, one per warp (either gate path); the 8-warp configurations leave warps 3-7 out.
WARP_GROUPS_32 = (
    ((1, False, (0,)),),
    ((0, True, (0,)),),
    ((1, True, (1,)),),
    (),
)
WARP_GROUPS_32_8 = WARP_GROUPS_32 + ((),) * 4

# Head-dimension steps per iteration of a block's mainloop, by schedule (the same operations in the same order
# either way, so the same bits). Measured on the H200 (docs/performance.md, 2026-12-03): unrolled twice, the
# 4-warp tile config is faster (1.16 against 1.20 ms); unrolled once, the 8-warp one is (1.05 against 1.31 ms),
# with 10 KB less SASS per kernel.
MAINLOOP_UNROLL = {WARP_GROUPS: 2, WARP_GROUPS_8: 1, WARP_GROUPS_EXACT: 2, WARP_GROUPS_32: 2, WARP_GROUPS_32_8: 1}
# `exact_diagonal`'s steps of EXACT_STEP columns per loop iteration, by schedule (any gate; the same operations in the
# same order). In the 8-warp kernel four beat one: tile-w8 1.281 ms against 1.358 (two: 1.323; H200, 2026-12-04).
EXACT_UNROLL = {WARP_GROUPS_8: 4, WARP_GROUPS_EXACT: 2, WARP_GROUPS_32: 2, WARP_GROUPS_32_8: 1}


def warp_schedule(warps: int, safe_gate: bool, chunk: int = 64) -> tuple:
    """The intra blocks' warp schedule of a CTA with `warps` warps: at chunk 64 WARP_GROUPS (4 warps, safe
    gate), WARP_GROUPS_EXACT (4 warps, any gate) or WARP_GROUPS_8 (8 warps, either); at chunk 32
    WARP_GROUPS_32 (4 warps) or WARP_GROUPS_32_8 (8 warps), either gate."""
    if chunk == 32:
        return WARP_GROUPS_32_8 if warps == 8 else WARP_GROUPS_32
    if warps == 8:
        return WARP_GROUPS_8
    return WARP_GROUPS if safe_gate else WARP_GROUPS_EXACT


def padded_pitch(dtype, cols: int) -> int:
    """Row pitch (elements) of a padded shared tile with `cols` columns."""
    return cols + PAD_BYTES * 8 // dtype.width


def padded_tile_layout(dtype, rows: int, cols: int):
    """Row-major [rows, cols] shared layout with a PAD_BYTES row pad (conflict-free fragment reads)."""
    return cute.make_layout((rows, cols), stride=(padded_pitch(dtype, cols), 1))


def make_row_copy(dtype, cols: int, num_threads: int) -> cute.TiledCopy:
    """The thread layout of `load_rows`' copies of a [rows, padded_head_dim(cols)] tile by `num_threads` threads,
    row-major, in `global_vec` pieces: 16 bytes where every row start allows it, else 8 (bf16 at K = 60, 100). Only
    the partition is used: `cp_async_zero_fill` issues each piece (cp.async.cg for 16 bytes, cp.async.ca below)."""
    vec = global_vec(dtype, cols)
    threads_per_row = padded_head_dim(cols) // vec
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(), dtype, num_bits_per_copy=vec * dtype.width)
    thr_layout = cute.make_layout((num_threads // threads_per_row, threads_per_row),
                                  stride=(threads_per_row, 1))
    return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, vec)))


# `load_rows` issues a thread's pieces in a runtime loop, LOAD_ROWS_UNROLL per iteration, where it has more than
# LOAD_ROWS_UNROLLED_MAX of them (K = 100 in a 4-warp CTA: 16), for a smaller load-issue code (the instruction cache:
# the fused a1 kernel -3% at K = 100 on the H100); at most that many stay unrolled (K = 60's 8, where the loop cost 1%).
# docs/performance.md, fifteenth session.
LOAD_ROWS_UNROLLED_MAX = 8
LOAD_ROWS_UNROLL = 2


@cute.jit
def load_rows(tiled_copy: cute.TiledCopy, gX: cute.Tensor, sX: cute.Tensor, cX: cute.Tensor,
              tidx: cutlass.Int32, valid_rows: cutlass.Int32):
    """cp.async the rows < valid_rows of a [chunk, cols] tile into sX, by thread `tidx`'s pieces of `tiled_copy`
    (`make_row_copy`). Every other element of sX is set to +0 by the same copies, which read nothing there
    (`cp_async_zero_fill`): rows >= valid_rows and, where gX has fewer columns than sX (a padded head size), the
    columns past gX's, over which the intra products sum. No branch per piece: a warp's copies of one row are one
    instruction whichever of its lanes fall in the pad."""
    cols = cute.size(gX, mode=[1])
    gX = cute.make_tensor(gX.iterator, cute.make_layout(sX.shape, stride=gX.stride))
    thr_copy = tiled_copy.get_slice(tidx)
    tXgX = thr_copy.partition_S(gX)
    tXsX = thr_copy.partition_D(sX)
    tXcX = thr_copy.partition_S(cX)
    pieces = cute.size(tXgX, mode=[1])
    if cutlass.const_expr(pieces > LOAD_ROWS_UNROLLED_MAX):
        for m in cutlass.range(pieces, unroll=LOAD_ROWS_UNROLL):
            load_piece(tXgX, tXsX, tXcX, m, cols, valid_rows)
    else:
        for m in cutlass.range_constexpr(pieces):
            load_piece(tXgX, tXsX, tXcX, m, cols, valid_rows)


@cute.jit
def load_piece(tXgX: cute.Tensor, tXsX: cute.Tensor, tXcX: cute.Tensor, m, cols: int, valid_rows: cutlass.Int32):
    """`load_rows`' piece m of a thread: its bytes where its row is valid and its column inside gX, else zeros."""
    piece_bytes = cute.size(tXsX, mode=[0]) * tXsX.element_type.width // 8
    row, col = tXcX[0, m, 0]
    src_bytes = cutlass.Int32(0)
    if row < valid_rows:
        if col < cols:
            src_bytes = cutlass.Int32(piece_bytes)
    cp_async_zero_fill(tXsX[None, m, None].iterator, tXgX[None, m, None].iterator, piece_bytes, src_bytes)


@dsl_user_op
def cp_async_zero_fill(dst: cute.Pointer, src: cute.Pointer, piece_bytes: int, src_bytes: cutlass.Int32, *,
                       loc=None, ip=None):
    """One cp.async of `piece_bytes` (4, 8 or 16; 16 bypasses L1) from global `src` to shared `dst` that reads only
    the first `src_bytes` and writes zeros to the rest (`src_bytes` 0: nothing is read, and `src` may point anywhere;
    PTX's src-size operand). The copy joins this thread's next commit group."""
    cache = "cg" if piece_bytes == 16 else "ca"
    ptx_asm(
        None,
        [dst.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip), src.toint(loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
         cutlass.Int32(src_bytes).ir_value(loc=loc, ip=ip)],
        f"cp.async.{cache}.shared.global [$0], [$1], {piece_bytes}, $2;",
        "r,l,r,~{memory}",
        loc=loc,
        ip=ip,
    )


def bulk_loadable(dtype, cols: int) -> bool:
    """Whether `bulk_load_rows` can fill a tile of [.., cols] rows of `dtype`: the tile has no padded columns to
    zero (cols is a HEAD_DIMS size) and a row is a whole number of BULK_GRANULE bytes, so every row of a 16-byte
    aligned [B, T, H, cols] tensor starts on a granule. K = 64, 128, 256; padded sizes (60, 96, 100, ...) keep
    `load_rows`."""
    return padded_head_dim(cols) == cols and cols * dtype.width // 8 % BULK_GRANULE == 0


def bulk_bytes(gX: cute.Tensor) -> int:
    """Bytes one `bulk_load_rows` copy of a row of the [chunk, cols] global tile gX moves (what it counts on its
    mbarrier)."""
    return cute.size(gX, mode=[1]) * gX.element_type.width // 8


@cute.jit
def bulk_load_rows(gX: cute.Tensor, sX: cute.Tensor, mbar_ptr: cute.Pointer, first_row: cutlass.Int32,
                   row_step: cutlass.Constexpr, valid_rows: cutlass.Int32):
    """One cp.async.bulk per row first_row + n row_step < valid_rows of a [chunk, cols] global tile into the same
    row of the padded shared tile sX (`bulk_loadable` rows), each completing its `bulk_bytes` on the mbarrier at
    `mbar_ptr`. For one thread: the caller elects it and has armed the mbarrier for these rows first. Other rows
    stay unwritten (`load_rows` sets them to +0)."""
    dtype = gX.element_type
    cols = cute.size(gX, mode=[1])
    assert cols == cute.size(sX, mode=[1]) and bulk_loadable(dtype, cols), "bulk rows fill whole, unpadded tiles"
    atom = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), dtype, num_bits_per_copy=cols * dtype.width)
    first = gX[first_row, None].iterator
    step = gX.stride[0] * row_step  # elements from one of the thread's rows to the next
    for n in cutlass.range((valid_rows - first_row + row_step - 1) // row_step, unroll=1):
        src = first + step * n
        gRow = cute.make_tensor(cute.make_ptr(dtype, src.toint(), src.memspace, assumed_align=BULK_GRANULE),
                                cute.make_layout(cols))
        cute.copy(atom, gRow, sX[first_row + n * row_step, None], mbar_ptr=mbar_ptr)


@cute.jit
def issue_bulk_rows(tiles: cutlass.Constexpr, mbar_ptr: cute.Pointer, warp_idx: cutlass.Int32,
                    warps: cutlass.Constexpr, valid_rows: cutlass.Int32, arrive: cutlass.Constexpr = True):
    """This warp's share of the bulk row loads of the (global, shared) tile pairs `tiles`: its elected thread arms the
    mbarrier at `mbar_ptr` with the bytes of its rows w, w + warps, ... < valid_rows (w = warp_idx) of every tile,
    arriving unless `arrive` is False (a part whose other part arrives later), then issues their copies
    (`bulk_load_rows`). Every warp of the CTA calls it once per phase (the mbarrier counts `warps` arrivals,
    `init_bulk_mbar`), also with no rows or no tiles (0 bytes). Each warp arms before it issues, so the transaction
    count never runs ahead of the copies, and the phase completes once every warp has arrived and every byte landed."""
    my_rows = (valid_rows - warp_idx + (warps - 1)) // warps
    row_bytes = sum(bulk_bytes(gX) for gX, _ in tiles)
    with cute.arch.elect_one():
        if cutlass.const_expr(arrive):
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_ptr, my_rows * row_bytes)
        else:
            cute.arch.mbarrier_expect_tx(mbar_ptr, my_rows * row_bytes)
        for gX, sX in tiles:
            bulk_load_rows(gX, sX, mbar_ptr, warp_idx, warps, valid_rows)


def tma_loadable(dtype, cols: int) -> bool:
    """Whether `make_tma_tile` can load a tile of [.., cols] rows of `dtype` into its padded shared tile: a
    `bulk_loadable` row whose padded pitch fits one TMA box (K = 64, 128; not 256)."""
    return bulk_loadable(dtype, cols) and padded_pitch(dtype, cols) <= TMA_BOX_MAX


def load_path(arch: str, io, head_k: int) -> str:
    """How a kernel for `arch` loads its q, k (`io`, 16-bit) and g (fp32) tiles of head size `head_k`: "tma" (one TMA
    box per tile, `issue_tma_tiles`) where both padded pitches fit a box (K = 64, 128); "bulk" (one cp.async.bulk per
    row, `issue_bulk_rows`) at the other unpadded sizes (K = 256); "cp.async" (`load_rows`) on sm_80 and at padded
    sizes (60, 96, 100, ...). Both mbarrier paths need sm_90 on."""
    if arch == "sm_80" or not bulk_loadable(io, head_k):
        return "cp.async"
    if tma_loadable(io, head_k) and tma_loadable(cutlass.Float32, head_k):
        return "tma"
    return "bulk"


def loads_of(key) -> str:
    """How the kernel of `key` (intra or fused) loads its q, k, g tiles: `load_path` of its arch, io dtype and head
    size, "tma", "bulk" or "cp.async"."""
    return load_path(key.arch, IO_TYPES[key.io_dtype], key.head_k)


def loads_mbar_fields(path: str) -> list:
    """The shared-memory struct fields (`common.make_struct`) that the tile loads of `path` (`loads_of`) need:
    `loads_mbar`, the mbarrier that the "tma" and "bulk" loads complete on (`init_tile_loads`); none for
    "cp.async"."""
    return [("loads_mbar", cute.struct.Align[cute.struct.MemRange[cutlass.Int64, 1], 8])] * (path != "cp.async")


def make_tma_tile(mX: cute.Tensor, chunk: int):
    """(TMA atom, TMA coordinate tensor) that load one (chunk, head) tile of the contiguous [B, T, H, D] tensor mX
    straight into its padded shared tile (`padded_tile_layout`) with one instruction (`issue_tma_tiles`). The box is
    chunk rows of padded_pitch(dtype, D) columns of mX viewed as [T, H * D, B] (host side: the descriptor is built at
    launch): each row's D columns, then the pad's from the next head's row start (or zeros past the last head).
    Nothing reads a tile's row pad, so those columns only cost the read."""
    cols = cute.size(mX, mode=[3])
    assert tma_loadable(mX.element_type, cols), f"no TMA tile of {cols} {mX.element_type} columns"
    pitch = padded_pitch(mX.element_type, cols)
    box = cute.make_layout((chunk, pitch), stride=(pitch, 1))
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), heads_as_columns(mX), box, (chunk, pitch))


@cute.jit
def issue_tma_tiles(pieces: cutlass.Constexpr, mbar_ptr: cute.Pointer, batch: cutlass.Int32, row0: cutlass.Int32,
                    arrive: cutlass.Constexpr = True, warp: cutlass.Int32 = None):
    """The TMA loads of `pieces`, ((atom, coordinate tensor) of `make_tma_tile`, padded shared tile sX, head) each:
    rows row0 .. row0 + chunk - 1 of that head of batch `batch` into sX, rows and pad (past the tensor's end, TMA
    writes zeros). Warp 0 arms the mbarrier at `mbar_ptr` with every box's bytes (arriving unless `arrive` is False,
    `issue_bulk_rows`' convention; the mbarrier counts one arrival, `init_bulk_mbar(.., 1)`) and issues them; the
    other warps do nothing. Every row is loaded: rows >= valid_rows hold the next sequence's rows or zeros, which
    nothing stores (as the +0 rows of `load_rows`). `warp`: this warp's index among the warps that load the tile
    (warp-uniform; None: the CTA's warp index)."""
    if cutlass.const_expr(warp is None):
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if warp == 0:
        box_bytes = 0
        for (atom, _), sX, _ in pieces:
            box_bytes += cute.size(sX, mode=[0]) * sX.stride[0] * sX.element_type.width // 8
        with cute.arch.elect_one():
            if cutlass.const_expr(arrive):
                cute.arch.mbarrier_arrive_and_expect_tx(mbar_ptr, box_bytes)
            else:
                cute.arch.mbarrier_expect_tx(mbar_ptr, box_bytes)
        for (atom, tiles), sX, head in pieces:
            rows = cute.size(sX, mode=[0])
            pitch = sX.stride[0]
            sBox = cute.make_tensor(sX.iterator, cute.make_layout((rows, pitch), stride=(pitch, 1)))
            gBox = cute.local_tile(tma_chunk_coords(tiles, batch, head, row0, cute.size(sX, mode=[1])),
                                   (rows, pitch), (0, 0))
            tXs, tXg = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sBox, 0, 2),
                                             cute.group_modes(gBox, 0, 2))
            cute.copy(atom, tXg, tXs, tma_bar_ptr=mbar_ptr)


@cute.jit
def init_bulk_mbar(mbar_ptr: cute.Pointer, arrivals: cutlass.Constexpr):
    """Initialize the bulk loads' mbarrier at `mbar_ptr` for `arrivals` arrivals per phase (the CTA's warps for
    `issue_bulk_rows`, 1 for `issue_tma_tiles`) and make it visible to the CTA (a CTA barrier); every thread calls
    it."""
    if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(mbar_ptr, arrivals)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()


def make_tma_tiles(mQ: cute.Tensor, mK: cute.Tensor, mG: cute.Tensor, chunk: int, path: str):
    """The `make_tma_tile`s of q, k and g for `issue_tile_loads` on the "tma" path (host side); None on the
    others."""
    if path != "tma":
        return None
    return make_tma_tile(mQ, chunk), make_tma_tile(mK, chunk), make_tma_tile(mG, chunk)


def init_tile_loads(storage, path: str, warps: int):
    """Set up the tile loads of `path` in a CTA of `warps` warps whose shared memory `storage` has the
    `loads_mbar_fields` of `path`: on the mbarrier paths, `init_bulk_mbar` for one arrival per phase ("tma",
    `issue_tma_tiles`) or one per warp ("bulk", `issue_bulk_rows`); every thread calls it. Returns the mbarrier's
    pointer (the `mbar_ptr` of `issue_tile_loads` and `wait_tile_loads`), or None for "cp.async" (nothing to set
    up)."""
    mbar_ptr = loads_mbar(storage, path)
    if mbar_ptr is not None:
        init_bulk_mbar(mbar_ptr, 1 if path == "tma" else warps)
    return mbar_ptr


def loads_mbar(storage, path: str):
    """The pointer of the loads' mbarrier in `storage` (`loads_mbar_fields` of `path`), None for "cp.async"."""
    return None if path == "cp.async" else storage.loads_mbar.data_ptr()


@cute.jit
def issue_tile_loads(path: cutlass.Constexpr, mbar_ptr: cutlass.Constexpr, tma_tiles: cutlass.Constexpr,
                     row_copies: cutlass.Constexpr, tensors: cutlass.Constexpr, tiles: cutlass.Constexpr,
                     batch: cutlass.Int32, head: cutlass.Int32, row0: cutlass.Int32, valid_rows: cutlass.Int32,
                     tidx: cutlass.Int32, warps: cutlass.Constexpr, parts: cutlass.Constexpr = "all",
                     loads: cutlass.Constexpr = True, warp: cutlass.Int32 = None):
    """Issue, without waiting, the loads of one tile's q, k, g rows row0 .. row0 + chunk - 1 of batch `batch`, value
    head `head` (q, k at its `qk_head`) from `tensors` = (mQ, mK, mG) into the padded shared tiles `tiles` = (sQ,
    sK, sG), by `path` (`loads_of`): "tma", one box per tile (`issue_tma_tiles` with `tma_tiles`, `make_tma_tiles`);
    "bulk", one copy per row < valid_rows (`issue_bulk_rows`, the CTA's `warps` warps); "cp.async", rows <
    valid_rows (`load_rows` by thread `tidx` with `row_copies` = (q and k's, g's `make_row_copy`), then one commit
    group). The mbarrier paths complete on `mbar_ptr` (`init_tile_loads`); `wait_tile_loads` waits for any path.
    Every thread of the warps that compute the tile calls it (`tidx` their index; the CTA's but in the fused kernel's
    `FusedConfig.pingpong`, whose groups pass `warp`).

    `parts`: "all", or a tile's loads in two calls: "q" (q only; on the mbarrier paths it adds its bytes without
    arriving), then "rest" (k and g, arriving). `loads` False (the fused kernel's phase variants without loads): no
    copies, but the same arrival (with 0 bytes) or commit group, so that the wait still completes. `warp`: the TMA
    path's `issue_tma_tiles` warp (None: the CTA's warp index; `tidx` is then the CTA's thread index too)."""
    mQ, mK, mG = tensors
    sQ, sK, sG = tiles
    chunk = cute.size(sQ, mode=[0])
    gQ = chunk_rows(mQ, batch, qk_head(head, mQ, mG), row0, chunk)
    gK = chunk_rows(mK, batch, qk_head(head, mK, mG), row0, chunk)
    gG = chunk_rows(mG, batch, head, row0, chunk)
    copy_q = cutlass.const_expr(loads and parts != "rest")
    copy_kg = cutlass.const_expr(loads and parts != "q")
    if cutlass.const_expr(path == "tma"):
        tma_q, tma_k, tma_g = tma_tiles
        q_head = qk_head(head, mQ, mG)
        pieces = [(tma_q, sQ, q_head)] * copy_q + [(tma_k, sK, q_head), (tma_g, sG, head)] * copy_kg
        issue_tma_tiles(pieces, mbar_ptr, batch, row0, arrive=parts != "q", warp=warp)
    elif cutlass.const_expr(path == "bulk"):
        row_tiles = [(gQ, sQ)] * copy_q + [(gK, sK), (gG, sG)] * copy_kg
        issue_bulk_rows(row_tiles, mbar_ptr, cute.arch.make_warp_uniform(cute.arch.warp_idx()), warps, valid_rows,
                        arrive=parts != "q")
    else:
        copy_qk, copy_g = row_copies
        cTile = cute.make_identity_tensor(sQ.shape)
        if cutlass.const_expr(copy_q):
            load_rows(copy_qk, gQ, sQ, cTile, tidx, valid_rows)
        if cutlass.const_expr(copy_kg):
            load_rows(copy_qk, gK, sK, cTile, tidx, valid_rows)
            load_rows(copy_g, gG, sG, cTile, tidx, valid_rows)
        cute.arch.cp_async_commit_group()


@cute.jit
def wait_tile_loads(path: cutlass.Constexpr, mbar_ptr: cutlass.Constexpr, phase: cutlass.Int32):
    """Wait for the tile loads that `issue_tile_loads` issued by `path`: on the mbarrier paths until phase `phase`
    of the mbarrier at `mbar_ptr` completes (every warp's bytes landed), with cp.async until this thread's commit
    groups have landed. The caller then synchronizes the CTA before any thread reads the tiles."""
    if cutlass.const_expr(path != "cp.async"):
        cute.arch.mbarrier_wait(mbar_ptr, phase)
    else:
        cute.arch.cp_async_wait_group(0)


@cute.jit
def load_beta(mBeta: cute.Tensor, sBeta: cute.Tensor, batch: cutlass.Int32, row0: cutlass.Int32,
              head: cutlass.Int32, tidx: cutlass.Int32, valid_rows: cutlass.Int32,
              chunk: cutlass.Constexpr):
    """beta of the chunk -> sBeta as fp32 (exact), 0 for rows >= valid_rows; threads < chunk."""
    if tidx < chunk:
        sBeta[tidx] = beta_row(mBeta[batch, row0 + min(tidx, valid_rows - 1), head], tidx, valid_rows)


@cute.jit
def beta_row(value, row: cutlass.Int32, valid_rows: cutlass.Int32) -> cutlass.Float32:
    """A chunk row's beta (bf16 or fp32, read from a row clamped into the chunk) as fp32 (exact), 0
    for rows >= valid_rows. Separate from the load so that a kernel can convert long after issuing it."""
    beta = cutlass.Float32(0.0)
    if row < valid_rows:
        beta = cutlass.Float32(value)
    return beta


@cute.jit
def intra_tile(tiled_mma: cute.TiledMma, sQ: cute.Tensor, sK: cute.Tensor, sG: cute.Tensor,
               sBeta: cute.Tensor, dAqk: cute.Tensor, dL: cute.Tensor, warp_idx: cutlass.Int32,
               lane: cutlass.Int32, valid_rows: cutlass.Int32, scale: cutlass.Float32, head_k: cutlass.Constexpr,
               schedule: cutlass.Constexpr = WARP_GROUPS, safe_gate: cutlass.Constexpr = True,
               unroll: cutlass.Constexpr = 0):
    """All blocks of one tile, warp w running its static list schedule[w] (`warp_schedule`).

    dAqk, dL: [chunk, chunk] destinations (global or shared) of Aqk (io dtype) and L (fp32); rows
    >= valid_rows are not written. `head_k`: the true head size K; the products sum over the tiles' first
    `summed_cols(head_k)` columns only. `safe_gate`: diagonal blocks as TF32 products of the row block's
    factors, as the off-diagonal blocks (True), or, for any gate (False), as 3xTF32 products of shifted factors
    (DIAG_SHIFT) in the rows within FAST_SPREAD and fp32 sums of per-pair exponentials in the others
    (`exact_rows`). `unroll`: head-dim steps per mainloop iteration (0: the schedule's MAINLOOP_UNROLL; the
    same operations in the same order either way). The caller synchronizes before and after.
    """
    cols = summed_cols(head_k)
    if cutlass.const_expr(cols < cute.size(sQ, mode=[1])):
        sQ, sK, sG = [cute.make_tensor(s.iterator, cute.make_layout((cute.size(s, mode=[0]), cols), stride=s.stride))
                      for s in (sQ, sK, sG)]
    # One copy of the code per kind of group (`group_kinds`), its blocks chosen at run time by warp:
    # smaller code than a copy per group (the instruction caches are a budget, docs/performance.md).
    for diagonal, width, instances in group_kinds(schedule):
        exact = diagonal and not safe_gate
        count = warp_lookup(warp_idx, {w: len(groups) for w, groups in instances.items()})
        for j in cutlass.range(count, unroll=1):
            a = instance_lookup(warp_idx, j, instances, lambda group: group[0])
            col_blocks = [instance_lookup(warp_idx, j, instances, lambda group, n=n: group[1][n])
                          for n in range(width)]
            if SUB * a < valid_rows:
                row_block_group(tiled_mma, sQ, sK, sG, sBeta, dAqk, dL, lane, valid_rows, scale,
                                a, diagonal, col_blocks, unroll or MAINLOOP_UNROLL[schedule],
                                exact and EXACT_UNROLL[schedule])


def summed_cols(head_k: int) -> int:
    """Head-dim columns the intra products sum over: K rounded up to the MMA step (MMA_K, a multiple of EXACT_STEP).
    A padded tile's columns K .. are +0 in q, k and g, so a sum over more of them would add only exact zeros: the
    same bits at more cost (K = 100: 104 columns of the 128-column tile)."""
    return -(-head_k // MMA_K) * MMA_K


def group_kinds(schedule) -> list:
    """A schedule's groups by kind, (diagonal, number of column blocks, {warp: [(a, col_blocks), ...]}), in
    each warp's order (a block's bits do not depend on which warp computes it, or when)."""
    kinds: dict = {}
    for w, groups in enumerate(schedule):
        for a, diagonal, col_blocks in groups:
            kinds.setdefault((diagonal, len(col_blocks)), {}).setdefault(w, []).append((a, col_blocks))
    return [(diagonal, width, instances) for (diagonal, width), instances in kinds.items()]


def warp_lookup(warp_idx: cutlass.Int32, table: dict) -> cutlass.Int32:
    """table[warp_idx] (0 for a warp not in it), as a chain of selects."""
    value = cutlass.Int32(0)
    for w, entry in table.items():
        value = cutlass.select_(warp_idx == w, cutlass.Int32(entry), value)
    return value


def instance_lookup(warp_idx: cutlass.Int32, j: cutlass.Int32, instances: dict, field) -> cutlass.Int32:
    """field(instances[warp_idx][j]), as a chain of selects."""
    value = cutlass.Int32(0)
    for w, groups in instances.items():
        for i, group in enumerate(groups):
            value = cutlass.select_((warp_idx == w) & (j == i), cutlass.Int32(field(group)), value)
    return value


@cute.jit
def row_block_group(tiled_mma: cute.TiledMma, sQ: cute.Tensor, sK: cute.Tensor, sG: cute.Tensor,
                    sBeta: cute.Tensor, dAqk: cute.Tensor, dL: cute.Tensor, lane: cutlass.Int32,
                    valid_rows: cutlass.Int32, scale: cutlass.Float32, a: cutlass.Int32,
                    diagonal: cutlass.Constexpr, col_blocks: list, unroll: cutlass.Constexpr,
                    exact_unroll: cutlass.Constexpr = 0):
    """Blocks (a, b) for b in col_blocks (run-time block indices), all with one reference row g[16a]; when
    `diagonal`, the last column block is a itself (masked to the triangle), and the zero blocks b > a are stored
    too. `unroll`: mainloop steps per iteration (MAINLOOP_UNROLL). `exact_unroll` (the diagonal block alone, of the
    any-gate path; 0 elsewhere): the reference is shifted by DIAG_SHIFT, the mainloop multiplies as 3xTF32, and the
    rows past FAST_SPREAD take their sums from `exact_diagonal` (EXACT_UNROLL steps per iteration) instead; the
    epilogue is the same."""
    head_k = cute.size(sQ, mode=[1])
    row_blocks = cute.size(sQ, mode=[0]) // SUB
    thr_mma = tiled_mma.get_slice(lane)
    sub = (SUB, head_k)

    # The mainloop's views of the tiles in MMA step order (`mma_step_order`); `exact_diagonal` reads the tiles as
    # they are. g[16a, d] for every (row, d) of a 16-row block: a stride-0 view of the block's first row.
    pQ, pK, pG = mma_step_order(sQ), mma_step_order(sK), mma_step_order(sG)
    sRef = cute.make_tensor(cute.domain_offset((SUB * a, 0), sG).iterator,
                            cute.make_layout((SUB, pG.shape[1]), stride=(0, pG.stride[1])))

    # A side: rows of block a, shared by every column block of the group.
    tAsQ = thr_mma.partition_A(cute.local_tile(pQ, sub, (a, 0)))
    tAsK = thr_mma.partition_A(cute.local_tile(pK, sub, (a, 0)))
    tAsG = thr_mma.partition_A(cute.local_tile(pG, sub, (a, 0)))
    tAsRef = thr_mma.partition_A(sRef)
    rQA = cute.make_rmem_tensor(tAsG[None, None, 0].shape, cutlass.Float32)
    rKA = cute.make_rmem_tensor(tAsG[None, None, 0].shape, cutlass.Float32)

    # B side: per column block, the columns (k rows) of block b with the same reference.
    tBsK = [thr_mma.partition_B(cute.local_tile(pK, sub, (b, 0))) for b in col_blocks]
    tBsG = [thr_mma.partition_B(cute.local_tile(pG, sub, (b, 0))) for b in col_blocks]
    tBsRef = thr_mma.partition_B(sRef)
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
    # Rows >= valid_rows of the shared tiles hold +0 (cp.async loads), whatever was there (bulk rows) or the next
    # sequence's rows or zeros (TMA loads) and enter the products unmasked: an A row i only reaches output row i, which
    # is not stored, and a B column j >= valid_rows only reaches output column j > i of a valid row i, in a diagonal
    # block, where the epilogue's select puts 0.
    exact = cutlass.const_expr(exact_unroll > 0)
    assert not exact or (diagonal and len(col_blocks) == 1), "the exact path takes a diagonal block alone"
    rArgMin = cute.make_rmem_tensor(tAsG[None, None, 0].shape, cutlass.Float32)  # exact: min over d of A's exponent
    rArgMin.fill(DIAG_SHIFT)
    for kk in cutlass.range(head_k // MMA_K, unroll=unroll):
        refA = tAsRef[None, None, kk].load()
        refB = tBsRef[None, None, kk].load()
        if cutlass.const_expr(exact):
            refA = refA - cutlass.Float32(DIAG_SHIFT)
            refB = refB - cutlass.Float32(DIAG_SHIFT)
        argA = tAsG[None, None, kk].load() - refA
        if cutlass.const_expr(exact):
            rArgMin.store(sticky_min(argA, rArgMin.load(), cute.where))
        gateA = cute.math.exp2(argA, fastmath=True)
        rQA.store(widened(tAsQ[None, None, kk]) * gateA)
        rKA.store(widened(tAsK[None, None, kk]) * gateA)
        for n in cutlass.range_constexpr(len(col_blocks)):
            gateB = cute.math.exp2(refB - tBsG[n][None, None, kk].load(), fastmath=True)
            rKB.store(widened(tBsK[n][None, None, kk]) * gateB)
            if cutlass.const_expr(exact):
                tf32x3_gemm(tiled_mma, accQK[n], rQA, rKB)
                tf32x3_gemm(tiled_mma, accKK[n], rKA, rKB)
            else:
                cute.gemm(tiled_mma, accQK[n], tf32(rQA), tf32(rKB), accQK[n])
                cute.gemm(tiled_mma, accKK[n], tf32(rKA), tf32(rKB), accKK[n])
    if cutlass.const_expr(exact):
        exact_rows(sQ, sK, sG, a, tiled_mma, cC, rArgMin, accQK[0], accKK[0], exact_unroll)

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
        if cutlass.const_expr(diagonal and n == len(col_blocks) - 1):
            keepQK = cute.make_rmem_tensor(cC.shape, cutlass.Boolean)
            keepKK = cute.make_rmem_tensor(cC.shape, cutlass.Boolean)
            for v in cutlass.range_constexpr(cute.size(cC)):
                keepQK[v] = cC[v][1] <= cC[v][0]
                keepKK[v] = cC[v][1] < cC[v][0]
            aqk = cute.where(keepQK.load(), aqk, cutlass.Float32(0.0))
            lkk = cute.where(keepKK.load(), lkk, cutlass.Float32(0.0))
        rAqk = cute.make_rmem_tensor(cC.shape, dAqk.element_type)
        rAqk.store(aqk.to(dAqk.element_type))
        rL = cute.make_rmem_tensor(cC.shape, cutlass.Float32)
        rL.store(lkk)
        store_block(thr_mma, rAqk, dAqk, cC, valid_rows, a, b)
        store_block(thr_mma, rL, dL, cC, valid_rows, a, b)
    if cutlass.const_expr(diagonal):
        rAqkZero = cute.make_rmem_tensor(cC.shape, dAqk.element_type)
        rAqkZero.fill(0.0)
        rLZero = cute.make_rmem_tensor(cC.shape, cutlass.Float32)
        rLZero.fill(0.0)
        for b in cutlass.range_constexpr(1, row_blocks):
            if b > a:
                store_block(thr_mma, rAqkZero, dAqk, cC, valid_rows, a, b)
                store_block(thr_mma, rLZero, dL, cC, valid_rows, a, b)


def sticky_min(x, m, select=cutlass.select_):
    """min(x, m) in which a NaN x wins and a NaN m stays (scalars, or TensorSSA values with `select=cute.where`): a
    NaN exponent makes its row slow (`exact_rows`)."""
    return select((x < m) | (x != x), x, m)


def mma_step_order(t: cute.Tensor) -> cute.Tensor:
    """A [rows, cols] shared tile (row-major) seen with each MMA_K-column step in the TF32 fragments' order: position
    c + 4s of a step holds column 2c + s. A lane's fragment holds positions c and c + 4 of a step (rows r and r + 8 of
    A; one row of B), so its two columns are adjacent in memory and a fragment's `load` reads them in one access."""
    steps = cute.size(t, mode=[1]) // MMA_K
    return cute.make_tensor(t.iterator, cute.make_layout((cute.size(t, mode=[0]), ((4, 2), steps)),
                                                         stride=(t.stride[0], ((2, 1), MMA_K))))


@cute.jit
def exact_rows(sQ: cute.Tensor, sK: cute.Tensor, sG: cute.Tensor, a: cutlass.Int32, tiled_mma: cute.TiledMma,
               cC: cute.Tensor, rArgMin: cute.Tensor, accQK: cute.Tensor, accKK: cute.Tensor,
               unroll: cutlass.Constexpr):
    """Diagonal block (a, a) of the any-gate path, after the 3xTF32 mainloop: replace the sums of the rows past
    FAST_SPREAD (rArgMin: this lane's minimum over its d of A's exponent g[i, d] - g[16a, d] + DIAG_SHIFT, per A
    fragment element; NaN if one was) by `exact_diagonal`'s. The warp runs `exact_diagonal` only when one of its rows
    needs it (rows >= valid_rows, whatever their values say, count too: they are never stored)."""
    f32 = cutlass.Float32
    # (row, d) of rArgMin's elements in lane 0's fragment: the row half of an element is the same in every lane
    cA = tiled_mma.get_slice(0).partition_A(cute.make_identity_tensor((SUB, MMA_K)))[None, None, 0]
    halves = cute.size(cC, mode=[0, 1])  # the accumulator's rows r and r + 8 (A's rows, the same lane)
    slow = []
    any_slow = cutlass.Boolean(False)
    for h in cutlass.range_constexpr(halves):
        row_min = f32(DIAG_SHIFT)
        for v in cutlass.range_constexpr(cute.size(cA)):
            if cutlass.const_expr(cA[v][0] // 8 == h):
                row_min = sticky_min(rArgMin[v], row_min)
        for offset in (1, 2):  # the 4 lanes of a row hold its d's between them
            row_min = sticky_min(cute.arch.shuffle_sync_bfly(row_min, offset=offset), row_min)
        slow.append(cutlass.not_(row_min >= f32(DIAG_SHIFT - FAST_SPREAD)))  # a NaN exponent is slow too
        any_slow = any_slow | slow[h]
    if cute.arch.vote_any_sync(any_slow):
        exQK = cute.make_rmem_tensor(cC.shape, f32)
        exKK = cute.make_rmem_tensor(cC.shape, f32)
        exQK.fill(0.0)
        exKK.fill(0.0)
        exact_diagonal(sQ, sK, sG, a, cC, exQK, exKK, unroll)
        for n in cutlass.range_constexpr(cute.size(cC, mode=[2])):
            for h in cutlass.range_constexpr(halves):
                for e in cutlass.range_constexpr(cute.size(cC, mode=[0, 0])):
                    accQK[(e, h), 0, n] = cutlass.select_(slow[h], exQK[(e, h), 0, n], accQK[(e, h), 0, n])
                    accKK[(e, h), 0, n] = cutlass.select_(slow[h], exKK[(e, h), 0, n], accKK[(e, h), 0, n])


@cute.jit
def exact_diagonal(sQ: cute.Tensor, sK: cute.Tensor, sG: cute.Tensor, a: cutlass.Int32, cC: cute.Tensor,
                   accQK: cute.Tensor, accKK: cute.Tensor, unroll: cutlass.Constexpr):
    """The sums of diagonal block (a, a) for any gate, into accumulator-layout fragments (cC: their (row,
    column) in the block): for each of this lane's (i, j), over d ascending,

        e = 2^(g[i,d] - g[j,d]);  kb = k[j,d] * e;  accQK = fma(q[i,d], kb, accQK);  accKK = fma(k[i,d], kb, accKK)

    in fp32 (exp2 = ex2.approx.ftz, the first fma of a chain from +0). For j <= i the exponent is <= 0 for any
    non-increasing gate, so nothing overflows; row i reads rows <= i only. Fragment elements in the upper
    right 8 x 8 quarter (row half 0, n-tile 1: j > i for every lane) stay +0; the others with j > i hold
    values that the epilogue's mask replaces."""
    f32 = cutlass.Float32
    head_k = cute.size(sQ, mode=[1])
    halves = cute.size(cC, mode=[0, 1])
    ntiles = cute.size(cC, mode=[2])
    # (e, h, n) of every fragment element that can lie on or below the diagonal
    elements = [(e, h, n) for n in range(ntiles) for h in range(halves) for e in range(2) if not (h == 0 and n > 0)]
    rows = [SUB * a + cC[(0, h), 0, 0][0] for h in range(halves)]
    cols = [[SUB * a + cC[(e, 0), 0, n][1] for e in range(2)] for n in range(ntiles)]
    rQ = [cute.make_rmem_tensor((EXACT_STEP,), sQ.element_type) for _ in range(halves)]
    rKi = [cute.make_rmem_tensor((EXACT_STEP,), sK.element_type) for _ in range(halves)]
    rGi = [cute.make_rmem_tensor((EXACT_STEP,), f32) for _ in range(halves)]
    rKj = [[cute.make_rmem_tensor((EXACT_STEP,), sK.element_type) for _ in range(2)] for _ in range(ntiles)]
    rGj = [[cute.make_rmem_tensor((EXACT_STEP,), f32) for _ in range(2)] for _ in range(ntiles)]
    rKB = cute.make_rmem_tensor((EXACT_STEP,), f32)
    for kk in cutlass.range(head_k // EXACT_STEP, unroll=unroll):
        for h in cutlass.range_constexpr(halves):
            cute.autovec_copy(cute.local_tile(sQ[rows[h], None], (EXACT_STEP,), (kk,)), rQ[h])
            cute.autovec_copy(cute.local_tile(sK[rows[h], None], (EXACT_STEP,), (kk,)), rKi[h])
            cute.autovec_copy(cute.local_tile(sG[rows[h], None], (EXACT_STEP,), (kk,)), rGi[h])
        for n in cutlass.range_constexpr(ntiles):
            for e in cutlass.range_constexpr(2):
                cute.autovec_copy(cute.local_tile(sK[cols[n][e], None], (EXACT_STEP,), (kk,)), rKj[n][e])
                cute.autovec_copy(cute.local_tile(sG[cols[n][e], None], (EXACT_STEP,), (kk,)), rGj[n][e])
        qi = [widened(rQ[h]) for h in range(halves)]  # once per row half, not per fragment element
        ki = [widened(rKi[h]) for h in range(halves)]
        for e, h, n in elements:
            gate = cute.math.exp2(rGi[h].load() - rGj[n][e].load(), fastmath=True)
            rKB.store(widened(rKj[n][e]) * gate)
            for d in cutlass.range_constexpr(EXACT_STEP):
                accQK[(e, h), 0, n] = cute.math.fma(qi[h][d], rKB[d], accQK[(e, h), 0, n], rounding=RN)
                accKK[(e, h), 0, n] = cute.math.fma(ki[h][d], rKB[d], accKK[(e, h), 0, n], rounding=RN)


@cute.jit
def store_block(thr_mma: cute.core.ThrMma, rX: cute.Tensor, dX: cute.Tensor, cC: cute.Tensor,
                valid_rows: cutlass.Int32, a: cutlass.Int32, b: cutlass.Int32):
    """Store the (a, b) 16x16 block of a [chunk, chunk] tensor (global or shared) from an
    accumulator-layout fragment; rows >= valid_rows are skipped. Each (row half, n-tile) slice is 2
    consecutive columns: one vector store."""
    tCdX = thr_mma.partition_C(cute.local_tile(dX, (SUB, SUB), (a, b)))
    for h in cutlass.range_constexpr(2):
        if SUB * a + cC[(0, h), 0, 0][0] < valid_rows:
            for n in cutlass.range_constexpr(cute.size(cC, mode=[2])):
                cute.autovec_copy(rX[(None, h), 0, n], tCdX[(None, h), 0, n])
