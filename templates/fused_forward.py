"""The whole KDA forward intra stage in one kernel: Aqk, Akk, W, U, KG (and QG) per (chunk, head) tile.

Bitwise equal to the standalone route (intra -> akk_inverse -> recompute_wu) by construction: every
output element is computed by the same device functions (templates/tile_intra.py, tile_inverse.py,
tile_recompute.py) from the same operand values, in the order docs/numerics.md fixes. Only where the
operands live changes: L and Akk never leave the CTA, and k, g are read from HBM once.

Per tile (4 warps, 128 threads; the phases run one after another, separated by barriers of those 4 warps: the CTA's,
or a group's with `FusedConfig.pingpong` below):
1. loads (`load_tile`): q, k (io dtype), g (fp32) rows into padded shared tiles, completing on an mbarrier that
   every thread waits on (`tile_intra.issue_tile_loads`, `wait_tile_loads`, by the path of `tile_intra.loads_of`,
   as in the standalone intra kernel): at K = 64, 128 each tile is one TMA box, rows and row pad, issued by one
   thread (`tile_intra.make_tma_tile`; rows >= v hold the next sequence's rows or zeros); at K = 256 one
   cp.async.bulk per row < v (each warp's elected thread arms the mbarrier with its rows' bytes and issues their
   copies). Padded head sizes (60, 100, ...) load by 16-byte cp.async (8-byte pieces for 16-bit rows at 60 or
   100) whose zero fill writes +0 to the pad columns and rows >= v without reading them (`tile_intra.load_rows`);
   beta into a register, converted to fp32 into a 64-entry shared vector (0 for rows >= v) once the tile's loads
   have landed; v rows by 16-byte `ld.global.nc` (the same pieces) straight into registers (clamped to row v - 1,
   as the standalone recompute does), in flight during phases 2-3.
2. intra (`intra_tile`): Aqk blocks -> global, L blocks -> shared fp32 (rows >= v set to +0: the
   shared state the standalone inverse builds from the workspace).
3. inverse (`invert_tile`): Akk in shared memory (io dtype); rows < v -> global with 16-byte stores (the same
   function as the standalone inverse's last step).
4. recompute: Akk rows -> registers -> the swizzled A tile (rows >= v zero, `store_akk`); per row,
   `gate_row` from k, g, q in shared memory, v in registers and beta from the shared vector: Kp, Vp
   -> shared B tiles, KG (QG) -> global; then W, U (`products_w_u`) -> global, through staging tiles by 16-byte
   row pieces or (`FusedConfig.stores` "tma") by one TMA box per warp and 64-column panel, whose reads the next
   tile's `loads_landed` waits for before anything writes those tiles again.
The standalone recompute reads the rounded Akk that step 3 stores; here the same values come from
shared memory, so the A operand is bit-identical. Rows >= v hold values (clamped, unwritten or loaded) that are
replaced by zero with a select or never stored, exactly as in the standalone kernels.

With 8 warps (`FusedConfig.warps`, no QG, loads_ahead 0; `two_group_tile`) the same phases run on two
groups of 4 warps: the intra blocks are spread over all 8 warps (tile_intra.WARP_GROUPS_8), and group 1
(warps 4-7), whose diagonal blocks are the shorter, then issues its v loads and computes KG while group 0
finishes (on the any-gate path, whose diagonal blocks take per-pair sums in the rows of steep gates, KG waits until
after its Kp and Vp); then group 0 (warps 0-3) runs phase 3 and stages the A tile while group 1 computes Kp and Vp,
writing Kp into q's buffer (q is consumed by then; the work region still holds L); then group 0 multiplies
and stores W while group 1 multiplies and stores U. Each group synchronizes on its own named
barrier; every element still comes from the same device function on the same operands.

With `FusedConfig.pingpong` (persistent, one CTA of 8 warps per SM) the CTA holds two tiles at once: warps 0-3 and
4-7 are two groups, each running `one_group_tile` on its own tiles (group g: tile indices b + g x grid, += 2 x grid) in its
own copy of the shared memory below (two structs, 231,424 B at K = V = 128), synchronizing on its own named barrier
(TILE_BARRIERS) where the 4-warp CTA synchronizes the CTA. That is two 4-warp CTAs in one ("free"); what it adds is
an order between them: the groups take turns at the intra phase ("intra"; TURN_BARRIERS: a group waits for the other
to pass the turn before its intra blocks, and passes it after them), so that one group's tensor-core and exponential
work runs beside the other's inverse (latency-bound) and recompute, instead of both groups meeting in the same phase;
or at the inverse ("inverse"), so that one group's dependent chains run beside the other's intra or recompute.
Both groups make the same number of loop iterations, a tile index past the end or without a tile still passing the
turn (`skip_turn`), so every wait meets its arrival.

Every 16-bit tensor (q, k, v, Akk and the outputs) has the key's io dtype, bf16 or fp16. Grouped value
heads: tiles are (chunk, value head h) of the HV heads of v, gk, beta and the outputs; q and k are read
at head h // (HV / H), as in the standalone kernels.

Shared memory (`fused_smem_struct`, K = V = 128, chunk 64): work region 29,696 B (L fp32 17 KiB with its
row pad, X00 fp32 4 KiB, Akk 8 KiB; after the inverse the same bytes hold the swizzled Akk A tile 8 KiB and
Kp 16 KiB), Vp 16,384 B, q and k 17,408 B each, g 33,792 B, beta 256 B, the loads' mbarrier 8 B: 114,952 B,
115,712 B with the struct's 1 KiB end alignment; two CTAs fit an SM (2 x (115,712 + 1,024 reserved) = 233,472 B,
not a byte to spare: X00 is swizzled rather than padded for that reason).

Scheduling (`FusedConfig`): one tile per CTA on the standalone grid (templates/common.py), or persistent CTAs walking
tile indices with a static stride (tile = blockIdx.x, += gridDim.x), each index mapped to (chunk, head, batch) in the
configured raster order and then to rows as the standalone kernels map them (`chunk_coords`; varlen with 4 warps:
`walk_coords`, which searches cu_seqlens only when a tile leaves the sequence of the CTA's previous tile). With
loads_ahead=0 each warp issues the next tile's loads (its rows; with TMA loads warp 0 all of them) once it has issued
its own W/U stores of the current tile (the q, k, g buffers were last read before the barrier that follows the gate
rows), then waits for them. With loads_ahead=1 the next tile's loads are issued into buffers as soon as the current
tile has finished reading them: q right after the intra phase (when QG is off; with QG, gate_row still reads q), k, g,
v (registers) and beta (a register, written to shared memory once the tile's loads have landed) right after the gate
rows, so they stream in while W and U are multiplied and stored (`FusedConfig.gate_rows` "early", without QG: the gate
rows right after the intra phase, Kp in registers until the inverse frees its buffer, and every load of the next tile
before the inverse; "early-vbuf", without QG and at K = V: Kp and KG right after the intra phase, Kp into Vp's tile,
then k, g and beta before the inverse; Vp after the inverse into the work region's Kp tile, then v). No buffer is
added: a K = 256 tile that leaves no room for a second stage still works, it only
overlaps less.
Sizes are template parameters (chunk, head_k, head_v from the key); the device functions currently
implement chunk 64 and 32 and K, V of keys.HEAD_DIMS sizes or padded ones (`can_implement`; K != V computes Vp
in v's own rows and columns after the gate rows). A padded size (60, 100) runs the tile of
`keys.padded_head_dim(K)` columns: q, k, g columns past K are +0 in shared memory (so every intra product and
gate row sees exact zeros there), global rows are read and written in `global_vec` pieces (8 bytes for 16-bit
rows at K = 60 or 100, 16 for the fp32 g rows) that stop at the row's end; a 16-bit row vector (v's loads, the
W / U / KG / QG stores) that starts 16-byte aligned and ends inside the row takes one 16-byte access instead
(`tile_recompute.wide_vec`).
At K = V = 64 a CTA needs 74,752 B (three fit an SM); at 256, 208,896 B (one).
"""
from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.memory import SmemAllocator

from kdajit.keys import (CHUNK_SIZES, FUSED_ARCHS, FUSED_WARPS, GATE_ROWS, HEAD_DIMS, INTRA_UNROLLS, LOADS_AHEAD,
                         PINGPONG_MODES, RASTER_ORDERS, STORE_PATHS, VARLEN_MODES, FusedForwardKey,
                         head_dim_supported, padded_head_dim)
from kdajit.templates.common import (DTYPES, IO_TYPES, SEQ_CURSOR_START, chunk_coords, chunk_rows, fake_arguments,
                                    grid_shape, make_struct, make_tf32_mma, sync_group, tma_chunk_coords, walk_coords)
from kdajit.templates.tile_intra import (beta_row, init_tile_loads, intra_tile, issue_tile_loads, loads_mbar,
                                         loads_mbar_fields, loads_of, make_row_copy, make_tma_tiles, padded_pitch, padded_tile_layout,
                                         wait_tile_loads, warp_schedule)
from kdajit.templates.tile_inverse import (akk_tile_layout, invert_tile, l_tile_elements, l_tile_layout,
                                           make_akk_store_copy, make_l_load_copy, store_akk_rows, x00_layout,
                                           zero_rows_from)
from kdajit.templates.tile_recompute import (PRODUCT_BARRIERS, VEC, RecomputeLayouts, gate_row, key_gate_row,
                                             load_row_vec, make_recompute_mma, make_tma_store_tile, product_threads,
                                             products_by_groups, products_w_u, row_fragments, store_akk, store_b_row,
                                             value_row)

# 4 warps: the inverse, the gate rows and the W/U products are written for one group of 4 warps (all of
# a 4-warp CTA; in an 8-warp CTA group 0 = warps 0-3 inverts and multiplies W, group 1 = warps 4-7
# computes the gate rows and multiplies U, each group with its own named barrier).
GROUP_THREADS = 128
GROUP_BARRIERS = tuple((barrier, GROUP_THREADS) for barrier in PRODUCT_BARRIERS)
# `FusedConfig.pingpong`: group g's own barrier (its 4 warps) is TILE_BARRIERS[g]; with turns, group g waits at
# TURN_BARRIERS[g] (both groups' 256 threads: g's syncing, the other's arriving) before its intra phase.
TILE_BARRIERS = (3, 4)
TURN_BARRIERS = (5, 6)
TURNS = ("intra", "inverse")  # the `FusedConfig.pingpong` values with turns: the phase the groups take turns at
PHASES = ("loads", "intra", "inverse", "recompute")  # every kernel built from a key runs all of them
SMEM_PER_SM = 233_472          # H100/H200: 228 KiB of shared memory per SM
SMEM_PER_CTA_MAX = 232_448     # 227 KiB usable by one CTA
SMEM_RESERVED_PER_CTA = 1_024  # taken by the system for every resident CTA
# The launch's preferred_smem_carveout (percent). Passing one keeps the DSL from querying the device for its shared
# memory per SM, which a CPU cross-compile has no device for. The value never reaches the driver: it is not in the
# exported object, and kdajit launches through TVM-FFI. The driver picks the carveout for the occupancy (Nsight
# Compute, H100: 168 KB for two 75 KB CTAs, 233 KB for three; docs/performance.md, sixteenth session).
SMEM_CARVEOUT_MAX = 100
# One tile per CTA asks for up to this many resident CTAs, by warps per CTA (4 warps: K = V = 64 fits 3 by
# shared memory, and ptxas then caps registers at 168 per thread, which the tile kernel meets without
# spills; K = 128 fits 2, K = 256 one. 8 warps: 2, a 128-register cap).
TILE_CTAS_PER_SM = {4: 3, 8: 2}
# `gate_rows`' runtime loop over a thread's rows, this many per iteration: it keeps the tile's hot code small enough
# for the instruction cache. H200, a1 at B=2 T=8192 H=64 (2026-12-06; docs/performance.md): K = 128 0.818-0.820 ms
# with 2, 0.823 with 1 (main: its own numerics, unrolled in full, 0.835).
GATE_ROWS_UNROLL = 2


def fused_smem_struct(chunk: int, head_k: int, head_v: int, io, path: str):
    """(Smem, InverseWork, RecomputeWork): the fused kernel's shared memory as `cute.struct`s, with
    16-bit tiles of type `io` (bf16 or fp16) and what the tile loads of `path` (`loads_of`) need
    (`loads_mbar_fields`).

    InverseWork and RecomputeWork are two views of Smem.work (phases 2-3 and phase 4)."""
    S = cute.struct
    f32 = cutlass.Float32
    inverse_work = make_struct("InverseWork", [
        ("l", S.MemRange[f32, l_tile_elements(chunk)]),
        ("x00", S.MemRange[f32, (chunk // 2) ** 2]),
        ("akk", S.MemRange[io, chunk * chunk]),
    ])
    recompute_work = make_struct("RecomputeWork", [
        ("akk", S.Align[S.MemRange[io, chunk * chunk], 1024]),
        ("kp", S.Align[S.MemRange[io, head_k * chunk], 1024]),
    ])
    work_bytes = max(inverse_work.__sizeof__(), recompute_work.__sizeof__())
    smem = make_struct("FusedSmem", [
        ("work", S.Align[S.MemRange[cutlass.Uint8, work_bytes], 1024]),
        ("vp", S.Align[S.MemRange[io, head_v * chunk], 1024]),
        # 1024-aligned: the 8-warp configurations stage Kp (a swizzled tile) here once q is consumed
        ("q", S.Align[S.MemRange[io, chunk * padded_pitch(io, head_k)], 1024]),
        ("k", S.Align[S.MemRange[io, chunk * padded_pitch(io, head_k)], 128]),
        ("g", S.Align[S.MemRange[f32, chunk * padded_pitch(f32, head_k)], 128]),
        ("beta", S.Align[S.MemRange[f32, chunk], 16]),
    ] + loads_mbar_fields(path))
    return smem, inverse_work, recompute_work


def tile_warps(config) -> int:
    """The warps that compute one tile: the CTA's, or with `FusedConfig.pingpong` a group's 4."""
    return 4 if config.pingpong != "off" else config.warps


def smem_bytes(key: FusedForwardKey) -> int:
    """Shared memory of one CTA of `key`'s kernel (the module docstring states it): one tile's struct, or, with
    `FusedConfig.pingpong`, one per group."""
    groups = key.config.warps // tile_warps(key.config)
    return groups * fused_smem_struct(key.chunk, padded_head_dim(key.head_k), padded_head_dim(key.head_v),
                                      IO_TYPES[key.io_dtype], loads_of(key))[0].__sizeof__()


def resident_ctas(key: FusedForwardKey) -> int:
    """The occupancy the launch asks for (`min_blocks_per_mp`, which also caps registers per thread):
    the CTAs of `key`'s kernel an SM holds by shared memory, at most `key.config.ctas_per_sm` for a
    persistent grid (sized for that many) and at most TILE_CTAS_PER_SM for one tile per CTA."""
    return ctas_by_smem(key.config, smem_bytes(key))


def ctas_by_smem(config, smem: int) -> int:
    """`resident_ctas` of a kernel of configuration `config` whose CTA takes `smem` bytes of shared memory."""
    wanted = config.ctas_per_sm if config.persistent else TILE_CTAS_PER_SM[config.warps]
    return min(wanted, SMEM_PER_SM // (smem + SMEM_RESERVED_PER_CTA))


class FusedForward:
    """Aqk, Akk, W, U, KG (and QG when `key.output_qg`) in one launch; see the module docstring."""

    def __init__(self, key: FusedForwardKey):
        self.key = key
        # The shared tiles' columns: a padded head size (60, 100) gets those of the next HEAD_DIMS size.
        self.chunk, self.head_k, self.head_v = key.chunk, padded_head_dim(key.head_k), padded_head_dim(key.head_v)
        self.io = IO_TYPES[key.io_dtype]
        self.output_qg = key.output_qg
        self.safe_gate = key.safe_gate
        self.varlen = key.varlen != "dense"
        self.config = key.config
        self.num_threads = 32 * key.config.warps
        # `FusedConfig.pingpong`: two groups of 4 warps, each with its own tile and shared memory
        self.pingpong = key.config.pingpong != "off"
        self.tile_warps = tile_warps(key.config)
        self.tile_threads = 32 * self.tile_warps
        self.load_path = loads_of(key)  # "tma", "bulk" or "cp.async"
        self.tma_stores = key.config.stores == "tma"  # W and U leave their staging panels by TMA (`product`)
        # Measurement only (benchmarks/fused_phases.py): a kernel that leaves phases out computes
        # garbage and is never built from a key, so it never reaches the cache.
        self.phases = PHASES

    @staticmethod
    def can_implement(key) -> bool:
        if not isinstance(key, FusedForwardKey):
            return False
        cfg = key.config
        fits = (key.chunk in CHUNK_SIZES and head_dim_supported(key.head_k) and head_dim_supported(key.head_v)
                and key.beta_dtype in DTYPES and key.io_dtype in IO_TYPES and key.varlen in VARLEN_MODES
                and key.arch in FUSED_ARCHS
                and isinstance(key.output_qg, bool) and isinstance(key.safe_gate, bool))
        if (not fits or not isinstance(cfg.persistent, bool) or cfg.raster not in RASTER_ORDERS
                or cfg.loads_ahead not in LOADS_AHEAD or cfg.warps not in FUSED_WARPS
                or cfg.gate_rows not in GATE_ROWS or cfg.intra_unroll not in INTRA_UNROLLS
                or cfg.stores not in STORE_PATHS or cfg.pingpong not in PINGPONG_MODES):
            return False
        if not cfg.persistent and cfg != type(cfg)(warps=cfg.warps):  # one tile per CTA: the others do not apply
            return False
        if cfg.pingpong != "off" and (cfg.warps != 8 or cfg.ctas_per_sm != 1 or not cfg.loads_ahead
                                      or key.chunk != 64 or loads_of(key) == "bulk"):
            # two 4-warp groups in one CTA per SM, each loading its next tile ahead (the schedule the probes test);
            # chunk 32's products take named barriers 1-2 across the CTA, and the bulk path arms the loads' mbarrier
            # from the CTA's warps (K = 256, which does not fit twice anyway)
            return False
        if tile_warps(cfg) == 8 and (key.output_qg or cfg.loads_ahead):  # Kp takes q's buffer; no early loads
            return False
        if cfg.gate_rows != "late" and (key.output_qg or not cfg.loads_ahead or tile_warps(cfg) != 4):
            return False  # QG's gate rows read q; without a next tile in flight nothing moves earlier
        if cfg.gate_rows == "early-vbuf" and padded_head_dim(key.head_k) != padded_head_dim(key.head_v):
            return False  # Kp and Vp trade tiles, which needs them of one layout
        if cfg.intra_unroll != 2 and tile_warps(cfg) != 4:
            return False  # the 8-warp schedule's mainloop runs one step per iteration already
        if cfg.stores == "tma" and (tile_warps(cfg) != 4 or key.chunk != 64 or key.head_k not in HEAD_DIMS
                                    or key.head_v not in HEAD_DIMS):
            return False  # TMA boxes of one warp's 16 rows x whole 64-column panels, W and U by all 4 warps
        if not isinstance(cfg.ctas_per_sm, int) or cfg.ctas_per_sm < 1:
            return False
        # A persistent grid is sized for ctas_per_sm resident CTAs, so they must fit; one tile per CTA
        # asks for as many as fit (`resident_ctas`), so a K = 256 tile that fits alone still builds.
        smem = smem_bytes(key)
        return (smem <= SMEM_PER_CTA_MAX and cfg.ctas_per_sm * 32 * cfg.warps <= 2048
                and (not cfg.persistent or ctas_by_smem(cfg, smem) == cfg.ctas_per_sm))

    def fake_args(self) -> tuple:
        return fake_arguments(self.key)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mGk: cute.Tensor,
                 mBeta: cute.Tensor, mAqk: cute.Tensor, mAkk: cute.Tensor, mW: cute.Tensor,
                 mU: cute.Tensor, mKG: cute.Tensor, mQG: cute.Tensor, mCuSeqlens: cute.Tensor,
                 scale: cutlass.Float32, max_ctas: cutlass.Int32,
                 stream: cuda.CUstream):
        f32 = cutlass.Float32
        tiles = grid_shape(mGk, mCuSeqlens, self.chunk, self.varlen)
        grid = tiles
        if cutlass.const_expr(self.config.persistent):
            grid = (min(tiles[0] * tiles[1] * tiles[2], max_ctas), 1, 1)
        layouts = RecomputeLayouts(self.chunk, self.head_k, self.head_v, panels=self.tma_stores)
        smem_struct, inverse_work, recompute_work = fused_smem_struct(self.chunk, self.head_k, self.head_v,
                                                                      self.io, self.load_path)
        self.smem_struct, self.inverse_work, self.recompute_work = smem_struct, inverse_work, recompute_work
        tma_tiles = make_tma_tiles(mQ, mK, mGk, self.chunk, self.load_path)
        tma_stores = (make_tma_store_tile(mW), make_tma_store_tile(mU)) if self.tma_stores else None
        self.kernel(mQ, mK, mV, mGk, mBeta, mAqk, mAkk, mW, mU, mKG, mQG, mCuSeqlens, scale, tma_tiles,
                    tiles[0], make_tf32_mma(), make_row_copy(self.io, self.key.head_k, self.tile_threads),
                    make_row_copy(f32, self.key.head_k, self.tile_threads),
                    make_l_load_copy(self.tile_threads, self.chunk),
                    make_akk_store_copy(GROUP_THREADS, self.io, self.chunk), make_recompute_mma(self.chunk, self.io),
                    tma_stores,
                    layouts.akk, layouts.kp, layouts.vp, layouts.out_w, layouts.out_u).launch(
            grid=grid, block=(self.num_threads, 1, 1), stream=stream,
            min_blocks_per_mp=resident_ctas(self.key), preferred_smem_carveout=SMEM_CARVEOUT_MAX)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
               mBeta: cute.Tensor, mAqk: cute.Tensor, mAkk: cute.Tensor, mW: cute.Tensor,
               mU: cute.Tensor, mKG: cute.Tensor, mQG: cute.Tensor, mCuSeqlens: cute.Tensor,
               scale: cutlass.Float32, tma_tiles, tiles_x: cutlass.Int32,
               intra_mma: cute.TiledMma, copy_qk: cute.TiledCopy, copy_g: cute.TiledCopy,
               l_copy: cute.TiledCopy, akk_store_copy: cute.TiledCopy, wu_mma: cute.TiledMma, tma_stores,
               sA_layout: cute.ComposedLayout, sKp_layout: cute.ComposedLayout,
               sVp_layout: cute.ComposedLayout, sOutW_layout: cute.ComposedLayout,
               sOutU_layout: cute.ComposedLayout):
        C, K = self.chunk, self.head_k
        io, f32 = self.io, cutlass.Float32
        allocator = SmemAllocator()
        storage = allocator.allocate(self.smem_struct)
        group = 0  # `FusedConfig.pingpong`: this warp's group (a run-time value); 0 folds away without it
        if cutlass.const_expr(self.pingpong):
            storages = (storage, allocator.allocate(self.smem_struct))
            for each in storages:
                init_tile_loads(each, self.load_path, self.tile_warps)
            group = self.tile_group()
            base = cutlass.select_(group == 0, storages[0].work.data_ptr().toint(),
                                   storages[1].work.data_ptr().toint())
            storage = self.smem_struct(cute.make_ptr(cutlass.Uint8, base, cute.AddressSpace.smem, assumed_align=1024))
        inv = self.inverse_work(storage.work.data_ptr())
        rec = self.recompute_work(storage.work.data_ptr())
        # 8 warps: group 1 writes Kp while group 0 still inverts in the work region, so Kp (and then the
        # W staging tile) goes to q's buffer, free after the intra phase without QG.
        kp_home = storage.q if cutlass.const_expr(self.tile_warps == 8) else rec.kp
        smem = (
            storage.q.get_tensor(padded_tile_layout(io, C, K)),
            storage.k.get_tensor(padded_tile_layout(io, C, K)),
            storage.g.get_tensor(padded_tile_layout(f32, C, K)),
            storage.beta.get_tensor(cute.make_layout(C)),
            inv.l.get_tensor(l_tile_layout(C)),
            inv.x00.get_tensor(x00_layout(C)),
            inv.akk.get_tensor(akk_tile_layout(C)),
            rec.akk.get_tensor(sA_layout),
            kp_home.get_tensor(sKp_layout),
            storage.vp.get_tensor(sVp_layout),
            # The output staging tiles reuse the Kp / Vp buffers once every warp has read them.
            kp_home.get_tensor(sOutW_layout),
            storage.vp.get_tensor(sOutU_layout),
        )
        # tma_stores: W's and U's `make_tma_store_tile`s with `FusedConfig.stores` "tma", else None
        ops = (intra_mma, copy_qk, copy_g, l_copy, akk_store_copy, wu_mma, tma_stores)
        tensors = (mQ, mK, mV, mG, mBeta, mAqk, mAkk, mW, mU, mKG, mQG, mCuSeqlens)
        # Registers of the tile whose loads are in flight: its v rows and this thread's beta.
        rV = self.row_vectors(self.head_v)
        rBeta = cute.make_rmem_tensor((1,), mBeta.element_type)
        # (the loads' mbarrier, the TMA tiles): `issue_tile_loads`' mbar_ptr and tma_tiles, None where the path has none
        if cutlass.const_expr(self.pingpong):  # initialized above, both groups' by warp 0
            mbar = (loads_mbar(storage, self.load_path), tma_tiles)
        else:
            mbar = (init_tile_loads(storage, self.load_path, self.config.warps), tma_tiles)
        phase = cutlass.Int32(0)  # of the mbarrier phase the next loaded tile completes (bulk loads)
        if cutlass.const_expr(self.config.persistent):
            bidx, _, _ = cute.arch.block_idx()
            gdim, _, _ = cute.arch.grid_dim()
            tiles = tiles_x * mG.shape[2] * mG.shape[0]  # varlen: B == 1
            tile = cutlass.Int32(bidx)
            stride = cutlass.Int32(gdim)
            if cutlass.const_expr(self.pingpong):
                # group g walks tiles b + g x grid, += 2 x grid (so a grid of min(tiles, SMs) keeps every SM busy); both
                # groups make the same iterations (those of group 0's tiles < tiles), so that their turns pair up;
                # group 1's tiles past the end are not valid
                tile = tile + group * stride
                stride = 2 * stride
                if group == 1:
                    self.pass_turn()  # group 0 takes the first turn
            cursor = SEQ_CURSOR_START
            valid, batch, head, row0, rows, cursor = self.tile_at(tensors, tile, tiles, tiles_x, cursor)
            if cutlass.const_expr(self.config.loads_ahead == 0):  # never with pingpong (`can_implement`)
                while tile < tiles:
                    if valid:
                        self.load_tile(tensors, smem, ops, batch, head, row0, rows, rV, rBeta, "all", mbar)
                        self.compute_tile(tensors, smem, ops, scale, batch, head, row0, rows, rV, rBeta, mbar,
                                          phase)
                        phase = phase ^ 1
                    tile = tile + stride
                    valid, batch, head, row0, rows, cursor = self.tile_at(tensors, tile, tiles, tiles_x, cursor)
            else:
                if valid:
                    self.load_tile(tensors, smem, ops, batch, head, row0, rows, rV, rBeta, "all", mbar)
                while self.lead_tile(tile, group, cutlass.Int32(gdim)) < tiles:
                    nxt = tile + stride
                    n_valid, n_batch, n_head, n_row0, n_rows, cursor = self.tile_at(tensors, nxt, tiles, tiles_x,
                                                                                    cursor)
                    if valid:
                        self.compute_tile(tensors, smem, ops, scale, batch, head, row0, rows, rV, rBeta, mbar,
                                          phase, (n_valid, n_batch, n_head, n_row0, n_rows))
                        phase = phase ^ 1
                    else:
                        self.skip_turn()
                        if n_valid:
                            self.load_tile(tensors, smem, ops, n_batch, n_head, n_row0, n_rows, rV, rBeta, "all",
                                           mbar)
                    tile, valid, batch, head, row0, rows = nxt, n_valid, n_batch, n_head, n_row0, n_rows
            if cutlass.const_expr(self.pingpong):
                if group == 0:
                    self.take_turn()  # the turn group 1 passed after its last tile
        else:
            bidx, head, bidz = cute.arch.block_idx()
            valid, batch, row0, rows = chunk_coords(mCuSeqlens, mQ.shape[1], self.chunk,
                                                    self.varlen, (cutlass.Int32(bidx), cutlass.Int32(bidz)))
            if valid:
                self.load_tile(tensors, smem, ops, batch, cutlass.Int32(head), row0, rows, rV, rBeta, "all", mbar)
                self.compute_tile(tensors, smem, ops, scale, batch, cutlass.Int32(head), row0, rows, rV, rBeta, mbar,
                                  phase)
        if cutlass.const_expr(self.tma_stores):
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the staging tiles live until the stores read them

    @cute.jit
    def tile_at(self, tensors: cutlass.Constexpr, tile: cutlass.Int32, tiles: cutlass.Int32,
                tiles_x: cutlass.Int32, cursor):
        """(valid, batch, head, row0, rows, cursor) of persistent tile index `tile` in the configured raster
        order (which of chunk x and head varies fastest); not valid when tile >= tiles. `cursor`: the varlen
        walk's (`common.walk_coords`), returned advanced; unused when dense or with 8 warps on one tile."""
        mG, mCuSeqlens = tensors[3], tensors[11]
        heads = mG.shape[2]
        x = tile % tiles_x
        head = (tile // tiles_x) % heads
        if cutlass.const_expr(self.config.raster == "head"):
            head = tile % heads
            x = (tile // heads) % tiles_x
        z = tile // (tiles_x * heads)
        if cutlass.const_expr(self.varlen and self.tile_warps == 4):  # 8 warps: no registers to keep it (spills)
            valid, row0, rows, cursor = walk_coords(mCuSeqlens, mG.shape[1], self.chunk, x, cursor)
            batch = cutlass.Int32(0)
        else:
            valid, batch, row0, rows = chunk_coords(mCuSeqlens, mG.shape[1], self.chunk, self.varlen,
                                                    (x, min(z, mG.shape[0] - 1)))
        if tile >= tiles:
            valid = cutlass.Boolean(False)
        return valid, batch, head, row0, rows, cursor

    @cute.jit
    def load_tile(self, tensors: cutlass.Constexpr, smem: cutlass.Constexpr, ops: cutlass.Constexpr,
                  batch: cutlass.Int32, head: cutlass.Int32, row0: cutlass.Int32, rows: cutlass.Int32,
                  rV: cute.Tensor, rBeta: cute.Tensor, parts: cutlass.Constexpr, mbar: cutlass.Constexpr):
        """Issue a tile's loads without waiting: q, k, g rows < rows into shared memory (`issue_tile_loads`, by
        `loads_of`'s path; `mbar` = (the loads' mbarrier, the TMA tiles), either None where the path has none), v rows
        into rV, this thread's beta (unconverted) into rBeta. `parts`: "all", "q" (only q: with loads_ahead 1, issued
        first), "rest" (all but q), or "rest" in two calls: "keys" (k, g, beta) then "values" (v). Phase-variant
        kernels without "loads" issue no copies (`issue_tile_loads`' `loads`)."""
        mQ, mK, mV, mG, mBeta = tensors[:5]
        sQ, sK, sG = smem[:3]
        copy_qk, copy_g = ops[1], ops[2]
        tidx, warp_idx, _ = self.thread_ids()
        loads = cutlass.const_expr("loads" in self.phases)
        if cutlass.const_expr(parts != "values"):
            issue_tile_loads(self.load_path, mbar[0], mbar[1], (copy_qk, copy_g), (mQ, mK, mG), (sQ, sK, sG), batch,
                             head, row0, rows, tidx, self.tile_warps, "rest" if parts == "keys" else parts, loads,
                             warp_idx if cutlass.const_expr(self.pingpong) else None)
        # 8 warps: group 1 loads v in two_group_tile
        if cutlass.const_expr(loads and parts in ("all", "rest", "values") and self.tile_warps == 4):
            self.load_v_rows(mV, batch, head, row0, rows, tidx, rV)
        if cutlass.const_expr(loads and parts in ("all", "rest", "keys")):
            # The raw value only: converting it here would wait for the load, and the barrier after
            # the gate rows would make every warp wait with it.
            rBeta[0] = mBeta[batch, row0 + min(tidx % self.chunk, rows - 1), head]

    @cute.jit
    def compute_tile(self, tensors: cutlass.Constexpr, smem: cutlass.Constexpr, ops: cutlass.Constexpr,
                     scale: cutlass.Float32, batch: cutlass.Int32, head: cutlass.Int32, row0: cutlass.Int32,
                     valid_rows: cutlass.Int32, rV: cute.Tensor, rBeta: cute.Tensor, mbar: cutlass.Constexpr,
                     phase: cutlass.Int32, next_tile: cutlass.Constexpr = None):
        """Phases 2-4 of the module docstring for a tile whose loads (`load_tile`) are in flight, by one
        group of 4 warps or, with 8 warps on one tile, by two (`two_group_tile`). `mbar`, `phase`: `load_tile`'s `mbar` and the
        mbarrier phase this tile's loads complete (on the mbarrier paths)."""
        landed = (mbar, phase)
        if cutlass.const_expr(self.tile_warps == 8):
            self.two_group_tile(tensors, smem, ops, scale, batch, head, row0, valid_rows, rV, rBeta, landed)
        else:
            self.one_group_tile(tensors, smem, ops, scale, batch, head, row0, valid_rows, rV, rBeta, landed,
                                next_tile)

    @cute.jit
    def two_group_tile(self, tensors: cutlass.Constexpr, smem: cutlass.Constexpr, ops: cutlass.Constexpr,
                       scale: cutlass.Float32, batch: cutlass.Int32, head: cutlass.Int32, row0: cutlass.Int32,
                       valid_rows: cutlass.Int32, rV: cute.Tensor, rBeta: cute.Tensor, landed: cutlass.Constexpr):
        """Phases 2-4 with 8 warps (no QG): the intra blocks over all 8 warps (WARP_GROUPS_8), after which
        group 1 (warps 4-7) issues its v loads and (safe gate, or chunk 32) computes KG; then group 0 (warps 0-3)
        inverts, stores Akk and stages the A tile while group 1 computes Kp (into q's buffer) and Vp (and then KG
        on the any-gate path at chunk 64); then group 0 multiplies W while group 1 multiplies U. Every element
        comes from the same device function, on the same operands, as in `one_group_tile`."""
        mQ, mK, mV, mG, mBeta, mAqk, mAkk, mW, mU, mKG, mQG, mCuSeqlens = tensors
        sQ, sK, sG, sBeta, sL, sX00, sX, sA, sKp, sVp, sOutW, sOutU = smem
        intra_mma, copy_qk, copy_g, l_copy, akk_store_copy, wu_mma, _ = ops  # no TMA stores with 8 warps
        C = self.chunk
        tidx, warp_idx, lane = self.loads_landed(sBeta, rBeta, valid_rows, *landed)
        group_tidx = tidx % GROUP_THREADS
        first_group = warp_idx < GROUP_THREADS // 32

        if cutlass.const_expr("intra" in self.phases):
            intra_tile(intra_mma, sQ, sK, sG, sBeta, chunk_rows(mAqk, batch, head, row0, C), sL, warp_idx,
                       lane, valid_rows, scale, self.key.head_k, warp_schedule(8, self.safe_gate, C), self.safe_gate)
            zero_rows_from(l_copy, sL, tidx, valid_rows)
        recompute = cutlass.const_expr("recompute" in self.phases)
        # On the safe-gate path group 1's intra blocks (the diagonal ones) are the shorter, and at chunk 32 it has
        # none: its v loads and KG (which reads only k and g) fill the wait for group 0's, off group 0's inverse
        # path. On the any-gate path at chunk 64 its diagonal blocks were the longer ones when every row took the
        # per-pair sums, so KG follows its Kp and Vp there (H200, 2026-12-04: 1.292 against 1.323 ms with
        # EXACT_UNROLL 2; docs/performance.md). Since the fast rows that holds for steep gates only: branch
        # exp/any-kg-early, to be timed.
        kg_early = cutlass.const_expr(self.safe_gate or C == 32)
        dKG = chunk_rows(mKG, batch, head, row0, C)
        if cutlass.const_expr(recompute):
            if not first_group:
                self.load_v_rows(mV, batch, head, row0, valid_rows, group_tidx, rV)
                if cutlass.const_expr(kg_early):
                    self.gate_rows(sK, sG, sQ, sBeta, rV, dKG, mQG, sKp, sVp, batch, head, row0, valid_rows,
                                   group_tidx, "keys")
        cute.arch.sync_threads()  # L complete; q consumed (its buffer becomes Kp)

        if first_group:
            if cutlass.const_expr("inverse" in self.phases):
                invert_tile(sL, sX, sX00, warp_idx, lane, GROUP_BARRIERS[0])
                sync_group(GROUP_BARRIERS[0])
                store_akk_rows(akk_store_copy, sX, chunk_rows(mAkk, batch, head, row0, C), group_tidx, valid_rows)
            if cutlass.const_expr(recompute):
                rA = self.akk_rows_from_smem(sX, group_tidx)
                sync_group(GROUP_BARRIERS[0])  # the group has read sX and sL: the work region is free
                store_akk(rA, sA, valid_rows, group_tidx, GROUP_THREADS)
        else:
            if cutlass.const_expr(recompute):
                self.gate_rows(sK, sG, sQ, sBeta, rV, dKG, mQG, sKp, sVp, batch, head, row0, valid_rows, group_tidx,
                               "operands")
                if cutlass.const_expr(not kg_early):
                    self.gate_rows(sK, sG, sQ, sBeta, rV, dKG, mQG, sKp, sVp, batch, head, row0, valid_rows,
                                   group_tidx, "keys")
        cute.arch.sync_threads()  # the A tile, Kp and Vp complete
        if cutlass.const_expr(recompute):
            threads = product_threads(C)  # of each group: all 4 warps at chunk 64, warps 0-1 / 4-5 at 32
            if cutlass.const_expr(threads == GROUP_THREADS):
                self.group_products(tensors, smem, wu_mma, batch, head, row0, valid_rows, group_tidx, first_group)
            else:
                if group_tidx < threads:
                    self.group_products(tensors, smem, wu_mma, batch, head, row0, valid_rows, group_tidx,
                                        first_group)
        if cutlass.const_expr(self.config.persistent):
            # The next tile's TMA or bulk copies (async proxy) overwrite q's buffer.
            if cutlass.const_expr(self.load_path != "cp.async"):
                cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()  # q's buffer holds the W staging tile until group 0 has stored it

    @cute.jit
    def group_products(self, tensors: cutlass.Constexpr, smem: cutlass.Constexpr, wu_mma: cute.TiledMma,
                       batch: cutlass.Int32, head: cutlass.Int32, row0: cutlass.Int32, valid_rows: cutlass.Int32,
                       group_tidx: cutlass.Int32, first_group: cutlass.Boolean):
        """W by group 0's `product_threads`, U by group 1's (`products_by_groups`)."""
        mW, mU = tensors[7], tensors[8]
        sA, sKp, sVp, sOutW, sOutU = smem[7:]
        C = self.chunk
        products_by_groups(wu_mma, sA, sKp, sVp, sOutW, sOutU, chunk_rows(mW, batch, head, row0, C),
                           chunk_rows(mU, batch, head, row0, C), valid_rows, group_tidx, first_group,
                           one_copy=product_threads(C) == GROUP_THREADS)

    @cute.jit
    def one_group_tile(self, tensors: cutlass.Constexpr, smem: cutlass.Constexpr, ops: cutlass.Constexpr,
                       scale: cutlass.Float32, batch: cutlass.Int32, head: cutlass.Int32, row0: cutlass.Int32,
                       valid_rows: cutlass.Int32, rV: cute.Tensor, rBeta: cute.Tensor, landed: cutlass.Constexpr,
                       next_tile: cutlass.Constexpr = None):
        """Phases 2-4 with 4 warps, each warp in every phase.

        With `next_tile` = (valid, batch, head, row0, rows), the next tile's loads are issued as soon as their buffers
        are free. Without QG: with `gate_rows` "early" (`FusedConfig`) the gate rows run right after the intra phase
        (Kp kept in registers until the inverse frees the work region, `store_kp_rows`), and every load follows them,
        before the inverse; with "early-vbuf" q goes out after the intra phase, then the gate rows put Kp into Vp's
        tile and KG out, and k, g and beta go out before the inverse; Vp (from v in registers) follows the inverse
        into the work region's Kp tile, and v goes out after it; with "late", q goes out after the intra phase and
        the rest after the gate rows of phase 4. With QG (the gate rows read q) every load goes out after the gate
        rows of phase 4."""
        mQ, mK, mV, mG, mBeta, mAqk, mAkk, mW, mU, mKG, mQG, mCuSeqlens = tensors
        sQ, sK, sG, sBeta, sL, sX00, sX, sA, sKp, sVp, sOutW, sOutU = smem
        intra_mma, copy_qk, copy_g, l_copy, akk_store_copy, wu_mma, tma_stores = ops
        C = self.chunk
        ahead = cutlass.const_expr(next_tile is not None)
        gates_early = cutlass.const_expr(ahead and not self.output_qg and self.config.gate_rows == "early")
        # Kp and Vp trade tiles (`can_implement`: one layout): Kp waits in Vp's tile, Vp in the work region's Kp tile
        kp_in_vp = cutlass.const_expr(ahead and not self.output_qg and self.config.gate_rows == "early-vbuf")
        q_early = cutlass.const_expr(ahead and not self.output_qg and not gates_early)
        recompute = cutlass.const_expr("recompute" in self.phases)
        tidx, warp_idx, lane = self.loads_landed(sBeta, rBeta, valid_rows, *landed)
        barrier = self.tile_barrier()  # of the 4 warps: the CTA's, or their group's

        # 2. Intra: Aqk -> global, L -> smem; L rows >= valid_rows := +0.
        self.take_turn("intra")
        if cutlass.const_expr("intra" in self.phases):
            intra_tile(intra_mma, sQ, sK, sG, sBeta, chunk_rows(mAqk, batch, head, row0, C), sL, warp_idx,
                       lane, valid_rows, scale, self.key.head_k, warp_schedule(4, self.safe_gate, C), self.safe_gate,
                       self.config.intra_unroll)
            zero_rows_from(l_copy, sL, tidx, valid_rows)
        self.pass_turn("intra")
        sync_group(barrier)
        if cutlass.const_expr(q_early):
            if next_tile[0]:
                self.load_tile(tensors, smem, ops, *next_tile[1:], rV, rBeta, "q", landed[0])
        if cutlass.const_expr(gates_early):
            # Kp -> registers (the work region still holds L), Vp -> its own tile (free since the tile's start), KG.
            rKp = self.row_vectors(self.head_k)
            if cutlass.const_expr(recompute):
                self.gate_rows(sK, sG, sQ, sBeta, rV, chunk_rows(mKG, batch, head, row0, C), mQG, sKp, sVp,
                               batch, head, row0, valid_rows, tidx, rKp=rKp)
            sync_group(barrier)  # q, k, g, beta and rV are consumed
            if next_tile[0]:
                self.load_tile(tensors, smem, ops, *next_tile[1:], rV, rBeta, "all", landed[0])
        if cutlass.const_expr(kp_in_vp):
            if cutlass.const_expr(recompute):
                self.gate_rows(sK, sG, sQ, sBeta, rV, chunk_rows(mKG, batch, head, row0, C), mQG, sVp, sVp,
                               batch, head, row0, valid_rows, tidx, "gates")
            sync_group(barrier)  # k, g and beta are consumed (rV waits for the inverse)
            if next_tile[0]:
                self.load_tile(tensors, smem, ops, *next_tile[1:], rV, rBeta, "keys", landed[0])

        # 3. Inverse in smem; Akk rows < valid_rows -> global.
        self.take_turn("inverse")
        if cutlass.const_expr("inverse" in self.phases):
            invert_tile(sL, sX, sX00, warp_idx, lane, barrier)
            sync_group(barrier)
            store_akk_rows(akk_store_copy, sX, chunk_rows(mAkk, batch, head, row0, C), tidx, valid_rows)
        self.pass_turn("inverse")

        # 4. Recompute: Akk -> A tile (reusing the L / X bytes), Kp (and, unless the gate rows ran early, Vp, KG,
        # QG), then W, U.
        if cutlass.const_expr(recompute):
            rA = self.akk_rows_from_smem(sX, tidx)
            sync_group(barrier)  # every thread has read sX and sL: the work region is free
            store_akk(rA, sA, valid_rows, tidx, GROUP_THREADS)
            if cutlass.const_expr(gates_early):
                self.store_kp_rows(rKp, sKp, tidx)
            elif cutlass.const_expr(kp_in_vp):
                self.value_rows(rV, sBeta, sKp, valid_rows, tidx)
            else:
                self.gate_rows(sK, sG, sQ, sBeta, rV, chunk_rows(mKG, batch, head, row0, C), mQG, sKp, sVp,
                               batch, head, row0, valid_rows, tidx)
        sync_group(barrier)  # the A tile, Kp and Vp complete; q, k, g, beta and rV are consumed
        if cutlass.const_expr(ahead and not gates_early):
            if next_tile[0]:
                self.load_tile(tensors, smem, ops, *next_tile[1:], rV, rBeta,
                               "values" if kp_in_vp else ("rest" if q_early else "all"), landed[0])
        if cutlass.const_expr(recompute):
            if cutlass.const_expr(kp_in_vp):  # W staged in Kp's tile, U in Vp's, as always
                sKp, sVp, sOutW, sOutU = sVp, sKp, sOutU, sOutW
            tma_out = None
            if cutlass.const_expr(self.tma_stores):
                tma_out = tuple((atom, tma_chunk_coords(coords, batch, head, row0, cute.size(mX, mode=[3])))
                                for (atom, coords), mX in zip(tma_stores, (mW, mU)))
            products_w_u(wu_mma, sA, sKp, sVp, sOutW, sOutU, chunk_rows(mW, batch, head, row0, C),
                         chunk_rows(mU, batch, head, row0, C), valid_rows, tidx, tma_out, barrier)

    @cute.jit
    def loads_landed(self, sBeta: cute.Tensor, rBeta: cute.Tensor, valid_rows: cutlass.Int32, mbar: cutlass.Constexpr,
                     phase: cutlass.Int32):
        """Wait for this tile's loads (`wait_tile_loads`: with `mbar`, `load_tile`'s, on the mbarrier paths those of
        mbarrier phase `phase`) and, with TMA stores, for the last tile's stores to have read their staging tiles;
        convert its beta (rBeta) into sBeta, synchronize the tile's warps (`tile_barrier`); returns (thread index,
        warp index, lane) among them (`thread_ids`)."""
        tidx, warp_idx, lane = self.thread_ids()
        wait_tile_loads(self.load_path, mbar[0], phase)
        if cutlass.const_expr(self.tma_stores):
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # the last tile's staging tiles are read: free again
        if tidx < self.chunk:
            sBeta[tidx] = beta_row(rBeta[0], tidx, valid_rows)
        sync_group(self.tile_barrier())
        return tidx, warp_idx, lane

    def lead_tile(self, tile, group, grid):
        """The persistent walk's loop bound: `tile` itself, or with `FusedConfig.pingpong` group 0's tile of the
        iteration in which this warp's group is at `tile` (both groups make group 0's iterations)."""
        if cutlass.const_expr(not self.pingpong):
            return tile
        return tile - group * grid

    def thread_ids(self):
        """(thread index, warp index, lane) of this thread among the warps that compute its tile: the CTA's, or with
        `FusedConfig.pingpong` its group's."""
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        if cutlass.const_expr(self.pingpong):
            tidx, warp_idx = tidx % self.tile_threads, warp_idx % self.tile_warps
        return tidx, warp_idx, lane

    def tile_group(self):
        """`FusedConfig.pingpong`: this warp's group, 0 (warps 0-3) or 1 (warps 4-7), warp-uniform."""
        return cute.arch.make_warp_uniform(cute.arch.warp_idx()) // self.tile_warps

    def tile_barrier(self):
        """The barrier of the warps that compute this thread's tile (`sync_group`): None, the CTA's; with
        `FusedConfig.pingpong` its group's named barrier (TILE_BARRIERS)."""
        if cutlass.const_expr(not self.pingpong):
            return None
        return (TILE_BARRIERS[0] + self.tile_group(), self.tile_threads)

    def take_turn(self, phase: str = None):
        """With turns (`FusedConfig.pingpong` "intra" or "inverse": TURNS), before the phase the groups take turns at
        (`phase` that one, or None: whichever it is), wait until the other group has passed this group the turn
        (`pass_turn`); nothing otherwise."""
        if cutlass.const_expr(self.config.pingpong in TURNS and phase in (None, self.config.pingpong)):
            cute.arch.barrier(barrier_id=TURN_BARRIERS[0] + self.tile_group(),
                              number_of_threads=2 * self.tile_threads)

    def pass_turn(self, phase: str = None):
        """With turns, after the phase the groups take turns at (`phase` as `take_turn`'s), let the other group take its
        turn; nothing otherwise."""
        if cutlass.const_expr(self.config.pingpong in TURNS and phase in (None, self.config.pingpong)):
            cute.arch.barrier_arrive(barrier_id=TURN_BARRIERS[1] - self.tile_group(),
                                     number_of_threads=2 * self.tile_threads)

    def skip_turn(self):
        """A tile index without a tile (past the end, or a varlen index no sequence has): the turn still goes round,
        so that both groups' turns keep pairing up."""
        self.take_turn()
        self.pass_turn()

    @cute.jit
    def load_v_rows(self, mV: cute.Tensor, batch: cutlass.Int32, head: cutlass.Int32, row0: cutlass.Int32,
                    valid_rows: cutlass.Int32, tidx: cutlass.Int32, rV: cute.Tensor):
        """v of this thread's value rows (t // (V / 8) + p (128 / (V / 8)), columns 8 (t % (V / 8)) ..) -> rV,
        clamped to row valid_rows - 1 as in the standalone recompute; invariant loads (`load_row_vec`), all in
        flight."""
        for p in cutlass.range_constexpr(cute.size(rV, mode=[0])):
            src_row = row0 + min(self.thread_row(self.head_v, tidx, p), valid_rows - 1)
            load_row_vec(mV[batch, src_row, head, None], self.col_tile(self.head_v, tidx), rV[p, None])

    @cute.jit
    def akk_rows_from_smem(self, sX: cute.Tensor, tidx: cutlass.Int32):
        """The Akk rows `store_akk` expects (thread t: column tile t % 8 of rows t // 8 + 16p)."""
        rA = self.row_vectors(self.chunk)
        for p in cutlass.range_constexpr(cute.size(rA, mode=[0])):
            row = self.thread_row(self.chunk, tidx, p)
            cute.autovec_copy(cute.local_tile(sX[row, None], (VEC,), (self.col_tile(self.chunk, tidx),)), rA[p, None])
        return rA

    @cute.jit
    def gate_rows(self, sK: cute.Tensor, sG: cute.Tensor, sQ: cute.Tensor, sBeta: cute.Tensor,
                  rV: cute.Tensor, dKG: cute.Tensor, mQG: cute.Tensor, sKp: cute.Tensor, sVp: cute.Tensor,
                  batch: cutlass.Int32, head: cutlass.Int32, row0: cutlass.Int32,
                  valid_rows: cutlass.Int32, tidx: cutlass.Int32, parts: cutlass.Constexpr = "all",
                  rKp: cute.Tensor = None):
        """`gate_row` for this thread's rows t // (K / 8) + p (128 / (K / 8)), columns 8 (t % (K / 8)) ..,
        operands from smem, in a runtime loop of GATE_ROWS_UNROLL rows per iteration; then Vp from rV (`load_v_rows`'
        rows, in registers, so an unrolled loop). `parts`: "all"; "operands" (Kp, Vp, QG: KG is left to
        `parts="keys"`, on other warps); "keys" (KG only); "gates" (Kp, KG: Vp is left to `value_rows`). `rKp`
        (`row_vectors(K)`): Kp stays there instead of going to sKp (`store_kp_rows` stores it); the loop is then
        unrolled, with Vp in it when K == V."""
        f32, io = cutlass.Float32, self.io
        col_tile = self.col_tile(self.head_k, tidx)
        dQG = dKG  # never written without QG (mQG is then a small dummy)
        if cutlass.const_expr(self.output_qg):
            dQG = chunk_rows(mQG, batch, head, row0, self.chunk)
        rGlast = None
        if cutlass.const_expr(parts != "operands"):
            rGlast = cute.make_rmem_tensor((VEC,), f32)
            cute.autovec_copy(cute.local_tile(sG[valid_rows - 1, None], (VEC,), (col_tile,)), rGlast)
        same_rows = cutlass.const_expr(self.head_k == self.head_v)  # rV holds v in these rows and columns
        operands = (sK, sG, sQ, sBeta, rGlast, dKG, dQG, sKp, sVp, valid_rows, tidx, col_tile, parts)
        if cutlass.const_expr(rKp is not None):  # Kp into registers indexed by p: an unrolled loop, Vp in it
            for p in cutlass.range_constexpr(self.rows_per_thread(self.head_k)):
                self.gate_rows_at(p, operands, rV[p, None] if same_rows else None, rKp[p, None])
        else:
            # Kp, KG and QG read only shared memory and write shared or global memory: a runtime loop keeps the
            # code small (the instruction cache; docs/performance.md); Vp, from registers indexed by p, follows
            # unrolled. Each element's arithmetic is gate_row's either way.
            for p in cutlass.range(self.rows_per_thread(self.head_k), unroll=GATE_ROWS_UNROLL):
                self.gate_rows_at(p, operands, None, None)
        if cutlass.const_expr(parts not in ("keys", "gates") and (rKp is None or not same_rows)):
            self.value_rows(rV, sBeta, sVp, valid_rows, tidx)

    @cute.jit
    def value_rows(self, rV: cute.Tensor, sBeta: cute.Tensor, sVp: cute.Tensor, valid_rows: cutlass.Int32,
                   tidx: cutlass.Int32):
        """Vp (`value_row`) of this thread's value rows (`load_v_rows`' rows, in rV) -> sVp, unrolled."""
        for p in cutlass.range_constexpr(cute.size(rV, mode=[0])):
            row = self.thread_row(self.head_v, tidx, p)
            value_row(rV[p, None], sBeta[row], sVp, row, valid_rows, self.col_tile(self.head_v, tidx))

    @cute.jit
    def gate_rows_at(self, p, operands: cutlass.Constexpr, rVrow: cute.Tensor, rKpRow: cute.Tensor):
        """`gate_rows`' work on this thread's p-th row (p a constant or a runtime index): Kp (into rKpRow when
        given), Vp from rVrow when given, KG, QG, as `gate_rows`' `parts` says."""
        sK, sG, sQ, sBeta, rGlast, dKG, dQG, sKp, sVp, valid_rows, tidx, col_tile, parts = operands
        f32, io = cutlass.Float32, self.io
        rK = cute.make_rmem_tensor((VEC,), io)
        rG = cute.make_rmem_tensor((VEC,), f32)
        rQ = cute.make_rmem_tensor((VEC,), io)
        row = self.thread_row(self.head_k, tidx, p)
        cute.autovec_copy(cute.local_tile(sK[row, None], (VEC,), (col_tile,)), rK)
        cute.autovec_copy(cute.local_tile(sG[row, None], (VEC,), (col_tile,)), rG)
        if cutlass.const_expr(parts == "keys"):
            key_gate_row(rK, rG, rGlast, dKG, row, valid_rows, col_tile)
        else:
            if cutlass.const_expr(self.output_qg):
                cute.autovec_copy(cute.local_tile(sQ[row, None], (VEC,), (col_tile,)), rQ)
            gate_row(rK, rG, rVrow, rQ, sBeta[row], rGlast, dKG, dQG, sKp, sVp, row, valid_rows, col_tile,
                     self.output_qg, rKpRow)

    def thread_row(self, cols: int, tidx: cutlass.Int32, p: int) -> cutlass.Int32:
        """The row of this thread's p-th 8-column vector of a [chunk, cols] tile that the group's 128 threads cover
        row by row: t // (cols / 8) + p (128 / (cols / 8)), at column tile `col_tile` (the layout of `load_v_rows`,
        `gate_rows`, `store_kp_rows` and `akk_rows_from_smem`)."""
        col_tiles = cols // VEC
        return tidx // col_tiles + p * (GROUP_THREADS // col_tiles)

    def col_tile(self, cols: int, tidx: cutlass.Int32) -> cutlass.Int32:
        """The column tile (columns 8 c ..) of this thread's `thread_row` vectors: t % (cols / 8)."""
        return tidx % (cols // VEC)

    def rows_per_thread(self, cols: int) -> int:
        """How many `thread_row` vectors of a [chunk, cols] tile each thread holds."""
        return self.chunk // (GROUP_THREADS // (cols // VEC))

    def row_vectors(self, cols: int) -> cute.Tensor:
        """Registers for this thread's `thread_row` vectors of a [chunk, cols] tile (one 8-value vector per row)."""
        return row_fragments(self.rows_per_thread(cols), self.io)

    @cute.jit
    def store_kp_rows(self, rKp: cute.Tensor, sKp: cute.Tensor, tidx: cutlass.Int32):
        """Kp kept in registers by `gate_rows` (rKp) -> sKp, the rows and columns `gate_row` stores it to."""
        for p in cutlass.range_constexpr(cute.size(rKp, mode=[0])):
            store_b_row(rKp[p, None], sKp, self.thread_row(self.head_k, tidx, p), self.col_tile(self.head_k, tidx))
