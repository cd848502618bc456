"""Device helpers shared by every kdajit template: chunk scheduling, fake arguments, shared-memory structs.

Kernels work on (chunk, head) tiles, one per CTA (the fused kernel's persistent configs walk the same
tiles, several per CTA). The tile grid and the tile -> rows mapping are the same for all templates,
so a chunk is always the same rows whichever kernel handles it:

- dense (equal-length batch): grid = (ceil(T / C), HV, B); tile (c, h, b) covers rows
  [C*c, min(C*c + C, T)) of batch b, value head h (grouped value heads: q and k of head
  h // (HV / H), `qk_head`).
- varlen (B == 1, packed with cu_seqlens): grid = (T // C + N, HV, 1). Sequence s owns the tiles
  x = first(s) + c, c = 0 .. ceil(len_s / C) - 1, with first(s) = cu_seqlens[s] // C + s. For sorted
  cu_seqlens first(s + 1) - first(s) = cu[s+1] // C - cu[s] // C + 1 >= ceil(len_s / C), so the tiles
  of different sequences never meet, and first(N - 1) + ceil(len_{N-1} / C) <= T // C + N fits the
  grid. Tile x finds its sequence by binary search over cu_seqlens alone (`chunk_coords`; a persistent CTA
  searches only when its tile leaves the sequence of its previous one, `walk_coords`); the spare tiles (at most
  one per sequence) do nothing. The host passes cu_seqlens as it is: no host synchronisation, no
  device preparation.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warp
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

from kdajit.keys import ALIGN_BY_KIND, VARLEN_MODES

# fp32 arithmetic whose rounding docs/numerics.md fixes (mul.rn / fma.rn: never contracted or reassociated)
RN = cute.math.RoundingMode.NEAREST_EVEN
DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}  # beta
IO_TYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}  # q, k, v and the 16-bit outputs (key.io_dtype)
CU_SEQLENS_DTYPES = {"cu32": cutlass.Int32, "cu64": cutlass.Int64}
TF32_MMA_SHAPE = (16, 8, 8)  # mma.sync m16n8k8 tf32: the intra blocks' products and the inverse's merges
TF32_BITS = 0xFFFFE000  # of an fp32 value: sign, exponent and the 10 mantissa bits a TF32 operand keeps


def make_tf32_mma() -> cute.TiledMma:
    """One warp's `mma.sync m16n8k8` on tf32 operands with fp32 accumulate: every warp owns whole output tiles."""
    return cute.make_tiled_mma(warp.MmaTF32Op(TF32_MMA_SHAPE), cute.make_layout((1, 1, 1)))


@cute.jit
def tf32_split(rX: cute.Tensor, rHi: cute.Tensor, rLo: cute.Tensor):
    """rHi := rX's TF32 bits (the low 13 mantissa bits cleared), rLo := rX - rHi (exact)."""
    bits = cute.recast_tensor(rX, cutlass.Uint32)
    hi_bits = cute.recast_tensor(rHi, cutlass.Uint32)
    for v in cutlass.range_constexpr(cute.size(rX)):
        hi_bits[v] = bits[v] & cutlass.Uint32(TF32_BITS)
    rLo.store(rX.load() - rHi.load())


@cute.jit
def tf32_round(rX: cute.Tensor, rR: cute.Tensor):
    """rR := rX rounded to TF32 (`cvt.rna.tf32.f32`: to nearest, ties away from zero), an fp32 register tensor whose
    bits the tensor core reads as a TF32 operand (`tf32`)."""
    bits = cute.recast_tensor(rR, cutlass.Int32)
    for v in cutlass.range_constexpr(cute.size(rX)):
        bits[v] = cutlass.Int32(cute.arch.cvt_f32_tf32(rX[v]))


@cute.jit
def widened(frag: cute.Tensor) -> cute.TensorSSA:
    """frag (16-bit floats: a shared-memory fragment, or a contiguous register vector) as fp32 values, exactly. Where
    frag is bf16 and its elements pair up at offsets (2m, 2m + 1) from its first element, each pair is read as one
    32-bit word (so that element must be 4-byte aligned: every caller's tiles have even pitches and even column
    offsets) and split by two bit operations, an fp32 being a bf16 with 16 zero bits below. The compiler's own
    conversion takes three instructions per pair (SHF; PRMT, SHF for the upper half), and the kernels convert every
    q and k element they multiply: docs/performance.md, seventeenth session."""
    offsets = [frag.layout(i) for i in range(cute.size(frag))]
    pairs = [(i, offsets.index(o + 1)) for i, o in enumerate(offsets) if o % 2 == 0 and o + 1 in offsets]
    if cutlass.const_expr(frag.element_type != cutlass.BFloat16 or 2 * len(pairs) != len(offsets)):
        return frag.load().to(cutlass.Float32)
    in_registers = cutlass.const_expr(frag.memspace == cute.AddressSpace.rmem)
    if cutlass.const_expr(in_registers):
        assert offsets == list(range(len(offsets))), "a register fragment is read as consecutive words"
        words = cute.recast_tensor(frag, cutlass.Uint32)
    out = cute.make_rmem_tensor(frag.shape, cutlass.Float32)
    bits = cute.recast_tensor(out, cutlass.Uint32)
    for lo, hi in pairs:
        if cutlass.const_expr(in_registers):
            word = words[offsets[lo] // 2]
        else:
            word = cute.make_tensor(cute.recast_ptr(frag.iterator + offsets[lo], dtype=cutlass.Uint32),
                                    cute.make_layout(1))[0]
        bits[lo] = word << 16
        bits[hi] = word & cutlass.Uint32(0xFFFF0000)
    return out.load()


def tf32(t):
    """An fp32 register tensor as the tensor core's TF32 operand (same bits)."""
    return cute.recast_tensor(t, cutlass.TFloat32)


@cute.jit
def tf32x3_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, rA: cute.Tensor, rB: cute.Tensor):
    """acc += A B for fp32 fragments rA, rB as 3xTF32: each operand x splits exactly into x_hi (its TF32 bits) and
    x_lo = x - x_hi (`tf32_split`), then three `mma.sync` in this order: A_lo B_hi, A_hi B_lo, A_hi B_hi (A_lo B_lo
    is left out; the tensor core reads x_lo's TF32 bits only)."""
    rAhi, rAlo = cute.make_rmem_tensor_like(rA), cute.make_rmem_tensor_like(rA)
    rBhi, rBlo = cute.make_rmem_tensor_like(rB), cute.make_rmem_tensor_like(rB)
    tf32_split(rA, rAhi, rAlo)
    tf32_split(rB, rBhi, rBlo)
    cute.gemm(tiled_mma, acc, tf32(rAlo), tf32(rBhi), acc)
    cute.gemm(tiled_mma, acc, tf32(rAhi), tf32(rBlo), acc)
    cute.gemm(tiled_mma, acc, tf32(rAhi), tf32(rBhi), acc)


class SymbolicShapes:
    """Shared symbolic sizes for one compile: tensors built from one instance are tied together."""

    def __init__(self) -> None:
        self.batch = cute.sym_int()
        self.tokens = cute.sym_int()
        self.heads = cute.sym_int()     # HV: value heads (v, gk, beta and every output)
        self.qk_heads = cute.sym_int()  # H: query / key heads (q, k), HV a multiple of H
        self.seq_bound = cute.sym_int()  # N + 1 in varlen mode; unconstrained (a dummy) when dense

    def bthd(self, dtype, last: int, qk_heads: bool = False):
        """A contiguous [B, T, H, last] tensor (H the q/k head count when `qk_heads`, else HV)."""
        heads = self.qk_heads if qk_heads else self.heads
        return make_fake_compact_tensor(dtype, (self.batch, self.tokens, heads, last),
                                        stride_order=(3, 2, 1, 0), assumed_align=ALIGN_BY_KIND["bthd"])

    def bth(self, dtype):
        """A contiguous [B, T, H] tensor (beta)."""
        return make_fake_compact_tensor(dtype, (self.batch, self.tokens, self.heads),
                                        stride_order=(2, 1, 0), assumed_align=ALIGN_BY_KIND["bth"])

    def seq(self, dtype):
        """A [N + 1] vector (cu_seqlens; dense kernels get a dummy they never read)."""
        return make_fake_compact_tensor(dtype, (self.seq_bound,), assumed_align=ALIGN_BY_KIND["seq"])


def fake_arguments(key) -> tuple:
    """The arguments `cute.compile` traces `key`'s kernel with: one per `key.ARGS` entry, then the stream."""
    assert key.varlen in VARLEN_MODES
    shapes = SymbolicShapes()
    # Without QG, the QG-only tensors are never touched: their own sizes let the caller pass small dummies.
    qg_shapes = shapes if getattr(key, "output_qg", False) else SymbolicShapes()
    dtypes = {"fp32": cutlass.Float32, "int32": cutlass.Int32, "io": IO_TYPES[key.io_dtype],
              "beta": DTYPES.get(getattr(key, "beta_dtype", "")),
              "cu": CU_SEQLENS_DTYPES.get(key.varlen, cutlass.Int32)}
    fakes = []
    for arg in key.ARGS:
        dtype = dtypes[arg.dtype]
        if arg.kind == "bthd":
            fakes.append((qg_shapes if arg.qg_only else shapes).bthd(dtype, getattr(key, arg.last), arg.qk_heads))
        elif arg.kind == "bth":
            fakes.append(shapes.bth(dtype))
        elif arg.kind == "seq":
            fakes.append(shapes.seq(dtype))
        else:
            fakes.append(dtype(1))
    return (*fakes, make_fake_stream(use_tvm_ffi_env_stream=True))


def sync_group(group=None):
    """A barrier: the whole CTA (`__syncthreads`) when `group` is None, else the named barrier `group` =
    (barrier id 1..15, threads): the warps of one warp group, while the others run other work."""
    if group is None:
        cute.arch.sync_threads()
    else:
        cute.arch.barrier(barrier_id=group[0], number_of_threads=group[1])


def ptx_asm(result_type, operands: list, text: str, constraints: str, *, loc=None, ip=None):
    """One inline PTX block that the compiler keeps where it stands (side effects): `operands` are MLIR values
    (`.ir_value()`), `result_type` None for none. The call the templates' `llvm.inline_asm` helpers share (the
    predicated stores use `cute.arch.inline_ptx`)."""
    return llvm.inline_asm(result_type, operands, text, constraints, has_side_effects=True, is_align_stack=False,
                           asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


def make_struct(name: str, fields: list):
    """A `cute.struct` (a shared-memory layout with its byte count as code) from (name, type) pairs."""
    return cute.struct(type(name, (), {"__annotations__": dict(fields)}))


def grid_shape(mG: cute.Tensor, mCuSeqlens: cute.Tensor, chunk: int, varlen: bool):
    """Launch grid for one CTA per (chunk, value head); see the module docstring. `mG`: any [B, T, HV, D]
    tensor (gk)."""
    if cutlass.const_expr(varlen):
        n_seqs = mCuSeqlens.shape[0] - 1
        return (mG.shape[1] // chunk + n_seqs, mG.shape[2], 1)
    return ((mG.shape[1] + chunk - 1) // chunk, mG.shape[2], mG.shape[0])


def qk_head(head, mQK: cute.Tensor, mG: cute.Tensor):
    """The q / k head that value head `head` reads: head // (HV / H), FLA's grouping (HV = mG.shape[2]
    value heads, H = mQK.shape[2] query / key heads, HV a multiple of H; the API checks it)."""
    return head // (mG.shape[2] // mQK.shape[2])


@cute.jit
def chunk_coords(mCuSeqlens: cute.Tensor, seq_len_dense: cutlass.Int32, chunk: cutlass.Constexpr,
                 varlen: cutlass.Constexpr, tile_xz: cutlass.Constexpr = None):
    """Map this CTA (or, with `tile_xz` = (x, z), the tile at grid position (x, *, z)) to its tile.

    Returns (is_valid, batch, row0, valid_rows): the tile covers rows [row0, row0 + valid_rows) of
    batch `batch`; `is_valid` is False for the spare tiles of the varlen grid. `seq_len_dense` is the
    tensors' T (in varlen mode too).

    Varlen rows are clamped so that no cu_seqlens can drive a kernel outside its tensors, also when
    its values were never checked (KDAJIT_VALIDATE=shapes, CUDA-graph capture): every cu_seqlens
    value is clamped into [0, T] (in its own dtype, so int64 values cannot wrap first), a sequence's
    eos is at least its bos, and a tile is valid only for a chunk that holds rows of its (clamped)
    sequence, so 0 <= row0 < row0 + valid_rows <= T and 1 <= valid_rows <= chunk. Bad values give
    garbage outputs, never an out-of-bounds access.
    """
    bidx, _, bidz = cute.arch.block_idx() if cutlass.const_expr(tile_xz is None) else (tile_xz[0], 0, tile_xz[1])
    is_valid = cutlass.Boolean(True)
    batch = cutlass.Int32(bidz)
    row0 = cutlass.Int32(0)
    valid_rows = cutlass.Int32(0)
    if cutlass.const_expr(varlen):
        cu_dtype = mCuSeqlens.element_type
        tokens = cu_dtype(seq_len_dense)
        seq = sequence_of(mCuSeqlens, tokens, chunk, cutlass.Int32(bidx))
        bos_cu = clamped_cu(mCuSeqlens, seq, tokens)
        eos_cu = min(max(cu_dtype(mCuSeqlens[seq + 1]), bos_cu), tokens)
        is_valid, row0, valid_rows = rows_in_sequence(cutlass.Int32(bidx), seq, cutlass.Int32(bos_cu),
                                                      cutlass.Int32(eos_cu), chunk)
    else:
        row0 = cutlass.Int32(bidx) * chunk
        valid_rows = min(seq_len_dense - row0, chunk)
    return is_valid, batch, row0, valid_rows


@cute.jit
def clamped_cu(mCuSeqlens: cute.Tensor, i: cutlass.Int32, tokens):
    """cu_seqlens[i] clamped into [0, T] in its own dtype (`tokens`: T in it), so that int64 values cannot wrap
    before the clamp."""
    cu_dtype = mCuSeqlens.element_type
    return min(max(cu_dtype(mCuSeqlens[i]), cu_dtype(0)), tokens)


@cute.jit
def sequence_of(mCuSeqlens: cute.Tensor, tokens, chunk: cutlass.Constexpr, x: cutlass.Int32) -> cutlass.Int32:
    """The sequence of varlen tile x: the largest s < N with first(s) = clamp(cu_seqlens[s]) // chunk + s <= x, else 0
    (a binary search; `tokens`: T in cu_seqlens' dtype)."""
    lo = cutlass.Int32(0)
    hi = cutlass.Int32(mCuSeqlens.shape[0] - 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if cutlass.Int32(clamped_cu(mCuSeqlens, mid, tokens)) // chunk + mid <= x:
            lo = mid
        else:
            hi = mid
    return lo


@cute.jit
def rows_in_sequence(x: cutlass.Int32, seq: cutlass.Int32, bos: cutlass.Int32, eos: cutlass.Int32,
                     chunk: cutlass.Constexpr):
    """(is_valid, row0, valid_rows) of varlen tile x in sequence `seq` with clamped bounds [bos, eos)."""
    is_valid = cutlass.Boolean(True)
    row0 = cutlass.Int32(0)
    valid_rows = cutlass.Int32(0)
    seq_len = eos - bos
    seq_chunks = seq_len // chunk + min(seq_len % chunk, 1)
    chunk_in_seq = x - (bos // chunk + seq)
    if chunk_in_seq < 0 or chunk_in_seq >= seq_chunks:
        is_valid = cutlass.Boolean(False)
    else:
        row0 = bos + chunk_in_seq * chunk
        valid_rows = min(seq_len - chunk_in_seq * chunk, chunk)
    return is_valid, row0, valid_rows


# A persistent CTA's varlen cursor: (seq, first_next, bos, eos) of the sequence its last tile found, where
# [first(seq), first_next) are the tiles x the binary search maps to seq (for sorted cu_seqlens; first(0) taken as 0,
# first(seq) = bos // chunk + seq above). This one matches none.
SEQ_CURSOR_START = (0, 0, 0, 0)
_NO_NEXT_SEQUENCE = 2**31 - 1


@cute.jit
def walk_coords(mCuSeqlens: cute.Tensor, seq_len_dense: cutlass.Int32, chunk: cutlass.Constexpr, x: cutlass.Int32,
                cursor):
    """`chunk_coords` of varlen tile x for a persistent CTA, with its cursor (`SEQ_CURSOR_START`, then what the
    previous call returned): (is_valid, row0, valid_rows, cursor). A tile of the cursor's sequence reads no
    cu_seqlens value (a CTA's next tile is mostly in the same sequence: the search's dependent loads took a few
    thousand cycles per tile); any other searches as `chunk_coords` does. For sorted cu_seqlens both give every
    tile the same sequence, so the same rows; for unsorted ones the cursor's sequence may differ from the search's,
    with the same clamps (garbage outputs, no access outside the tensors)."""
    seq, first_next, bos, eos = (cutlass.Int32(c) for c in cursor)
    first_lo = cutlass.Int32(0)
    if seq > 0:
        first_lo = bos // chunk + seq
    if x < first_lo or x >= first_next:
        cu_dtype = mCuSeqlens.element_type
        tokens = cu_dtype(seq_len_dense)
        n_seqs = cutlass.Int32(mCuSeqlens.shape[0] - 1)
        seq = sequence_of(mCuSeqlens, tokens, chunk, x)
        bos_cu = clamped_cu(mCuSeqlens, seq, tokens)
        next_cu = clamped_cu(mCuSeqlens, seq + 1, tokens)
        bos = cutlass.Int32(bos_cu)
        eos = cutlass.Int32(max(next_cu, bos_cu))  # = min(max(cu[seq + 1], bos), T), chunk_coords' eos
        first_next = cutlass.Int32(_NO_NEXT_SEQUENCE)
        if seq + 1 < n_seqs:
            first_next = cutlass.Int32(next_cu) // chunk + seq + 1
    is_valid, row0, valid_rows = rows_in_sequence(x, seq, bos, eos, chunk)
    return is_valid, row0, valid_rows, (seq, first_next, bos, eos)

def global_vec(dtype, cols: int) -> int:
    """Elements per global vector access of a [.., cols] row of `dtype`: at most 16 bytes, and dividing `cols`, so
    that every row of a 16-byte aligned tensor starts on an access boundary (K = 60 or 100: 8-byte bf16 pieces)."""
    vec = 128 // dtype.width
    while cols % vec:
        vec //= 2
    return vec


def row_piece(dRow: cute.Tensor, col, elems: int) -> cute.Tensor:
    """`elems` elements of a global row view from column `col` (a multiple of `elems`), as a tensor whose pointer
    is known to be aligned to the piece; no bounds check (callers clamp or predicate)."""
    ptr = dRow.iterator + col
    return cute.make_tensor(cute.make_ptr(dRow.element_type, ptr.toint(), ptr.memspace,
                                          assumed_align=elems * dRow.element_type.width // 8),
                            cute.make_layout(elems))


def heads_as_columns(mX: cute.Tensor) -> cute.Tensor:
    """The contiguous [B, T, H, D] tensor mX viewed as [T, H * D, B]: the global view of the TMA tiles (host side),
    whose coordinate tensors `tma_chunk_coords` indexes."""
    return cute.make_tensor(mX.iterator, cute.make_layout((mX.shape[1], mX.shape[2] * mX.shape[3], mX.shape[0]),
                                                          stride=(mX.stride[1], 1, mX.stride[0])))


def tma_chunk_coords(coords: cute.Tensor, batch, head, row0, cols: int) -> cute.Tensor:
    """A `heads_as_columns` TMA coordinate tensor moved to row row0, column 0 of head `head` (D = `cols`) of batch
    `batch`: coordinates of one chunk's rows, for `cute.local_tile` boxes."""
    return cute.domain_offset((row0, head * cols), coords[None, None, batch])


def chunk_rows(mX: cute.Tensor, batch, head, row0, rows: int) -> cute.Tensor:
    """The [rows, D] view of a [B, T, H, D] tensor's rows row0 .. row0 + rows - 1 of one head."""
    return cute.local_tile(cute.domain_offset((row0, 0), mX[batch, None, head, None]),
                           (rows, mX.shape[3]), (0, 0))
