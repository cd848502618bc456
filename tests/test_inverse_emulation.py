"""The inverse's per-tile code (`templates/tile_inverse.invert_tile`) run on the CPU, thread by thread.

`invert_tile` is Python that CuTe DSL traces; its helpers emit straight-line code. Here the undecorated
function runs in 128 Python threads (warp = thread // 32, lane = thread % 32) with numpy stand-ins for the
device operations: fp32 `mul.rn` / `fma.rn` (the exact product in fp64, one rounding to fp32), `select`,
the merges' TF32 tensor-core tile products (`tf32_product`, per lane, operands rounded to nearest), and shared
tensors that log every access per barrier interval. A barrier is a `threading.Barrier`. So the
kernel's own indexing, block placement, merge order and barriers are checked without a GPU:
- accuracy against fp64, at most that of the same code with FLA's truncated TF32 operands, exact +0 above the
  diagonal and exact 1 on it (a misplaced block or product fails);
- no element written by one thread is read or written by another between two barriers (a missing barrier,
  or two steps sharing storage, fails);
- causal bits: rows < v are bit-identical whatever finite values rows >= v hold (a nonzero term of a later row
  fails); with non-finite rows >= v, the rows before v's 16-row block are (a merge product multiplies a later
  row of its own 16-row tile by 0, and 0 x inf is NaN: docs/numerics.md).
The bits are the emulation's (fp64-then-fp32 fma can differ from a hardware fma in rare double roundings);
the GPU tests compare the real kernels' bits across routes.
"""
import contextlib
import threading
import types

import numpy as np
import pytest
import torch

from kdajit import compiler, reference

compiler._cute()  # CuTe DSL with the arch pinned, before the template module imports it
from kdajit.templates import common, tile_inverse  # noqa: E402

CHUNKS = (64, 32)
THREADS = 32 * tile_inverse.NUM_WARPS


class F32:
    """An fp32 register value."""
    __slots__ = ("v",)

    def __init__(self, v):
        self.v = np.float32(v.v if isinstance(v, F32) else v)

    def __sub__(self, other):
        return F32(self.v - other.v)  # fp32 round to nearest

    def to(self, dtype):
        return F32(self.v)  # the io rounding is left out: the tests read the fp32 values


def _fma(a, b, c, rounding=None):
    return F32(np.float32(np.float64(a.v) * np.float64(b.v) + np.float64(c.v)))


def _mul(a, b, rounding=None):
    return F32(np.float32(np.float64(a.v) * np.float64(b.v)))


def tf32_nearest(x: np.float32) -> np.float64:
    """x rounded to TF32 as `cvt.rna.tf32.f32` does (common.tf32_round): to nearest, ties away from zero."""
    if not np.isfinite(x):
        return np.float64(x)
    bits = (np.array([x], np.float32).view(np.uint32) + np.uint32(0x1000)) & np.uint32(common.TF32_BITS)
    return np.float64(bits.view(np.float32)[0])


def tf32_truncated(x: np.float32) -> np.float64:
    """x's TF32 bits (the low 13 mantissa bits cleared): how FLA's merges feed the tensor core."""
    return np.float64((np.array([x], np.float32).view(np.uint32) & np.uint32(common.TF32_BITS)).view(np.float32)[0])


def tile_product(operand=tf32_nearest):
    """tile_inverse.tf32_product for one lane, with TF32 operands made by `operand`: its 4 accumulator elements of
    the m16n8k8 layout (rows lane / 4 and + 8, columns 2 (lane % 4) and + 1), each mma.sync as an exact sum rounded
    once to fp32 (the hardware's internal rounding can differ; the GPU tests compare the real kernels' bits)."""
    def product(lane, sA, a_row, a_col, sB, b_row, b_col, step_begin, step_end):
        assert 0 <= step_begin <= step_end
        g, t = lane // 4, lane % 4
        coords = [(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)]
        acc = []
        for i, j in coords:
            total = np.float32(0.0)
            for s in range(step_begin, step_end):
                total = np.float32(np.float64(total) + sum(operand(sA[a_row + i, a_col + k].v)
                                                           * operand(sB[b_row + k, b_col + j].v)
                                                           for k in range(8 * s, 8 * s + 8)))
            acc.append(F32(total))
        return acc, coords
    return product


def zero_row_segment(sX, row, col0, cols):
    """tile_inverse.zero_row_segment element by element (its 16-byte stores write these elements)."""
    for c in range(col0, col0 + cols):
        sX[row, c] = F32(0.0)


class SharedTile:
    """A shared-memory tensor that records, per barrier interval, which thread wrote and read each element (unless
    `track` is off: the bounds are still checked)."""

    def __init__(self, name: str, values: np.ndarray, state: threading.local, conflicts: list, lock,
                 track: bool = True):
        self.name, self.values, self.shape = name, values, values.shape
        self.state, self.conflicts, self.lock, self.track = state, conflicts, lock, track
        self.accesses: dict = {}
        self.element_type = F32

    def _access(self, r: int, c: int, write: bool) -> None:
        assert 0 <= r < self.shape[0] and 0 <= c < self.shape[1], (self.name, r, c)
        if not self.track:
            return
        thread, interval = self.state.thread, self.state.interval
        with self.lock:
            entry = self.accesses.setdefault((interval, r, c), [None, set()])
            writer, readers = entry
            if writer not in (None, thread) or (write and readers - {thread}):
                self.conflicts.append((self.name, interval, r, c, thread, writer, sorted(readers)))
            if write:
                entry[0] = thread
            else:
                readers.add(thread)

    def __getitem__(self, rc):
        r, c = int(rc[0]), int(rc[1])
        self._access(r, c, False)
        return F32(self.values[r, c])

    def __setitem__(self, rc, value):
        r, c = int(rc[0]), int(rc[1])
        self._access(r, c, True)
        self.values[r, c] = value.v if isinstance(value, F32) else value


@contextlib.contextmanager
def emulated_device(barrier: threading.Barrier, state: threading.local, operand=tf32_nearest):
    """tile_inverse's module globals swapped for the stand-ins (the merges' TF32 operands made by `operand`), restored
    afterwards."""
    def sync_group(group=None):
        barrier.wait()
        state.interval += 1
        barrier.wait()

    stand_ins = {
        "cute": types.SimpleNamespace(size=lambda t, mode=None: len(t) if mode is None else t.shape[mode[0]],
                                      math=types.SimpleNamespace(mul=_mul, fma=_fma)),
        "cutlass": types.SimpleNamespace(range_constexpr=range, Float32=F32,
                                         select_=lambda cond, a, b: a if cond else b),
        "sync_group": sync_group,
        "tf32_product": tile_product(operand),
        "store_either": tile_inverse.store_either.__wrapped__,
        "zero_row_segment": zero_row_segment,
    }
    saved = {name: getattr(tile_inverse, name) for name in stand_ins}
    for name, value in stand_ins.items():
        setattr(tile_inverse, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(tile_inverse, name, value)


def invert(L: np.ndarray, operand=tf32_nearest, track: bool = True) -> tuple[np.ndarray, list]:
    """invert_tile on an fp32 L tile (C x C, C the chunk size), the merges' TF32 operands made by `operand`: (X in
    fp32, the access conflicts found; none looked for without `track`, which saves ~40% of the time where only the
    values matter)."""
    C = L.shape[0]
    state, lock, conflicts = threading.local(), threading.Lock(), []
    sL = SharedTile("sL", L.astype(np.float32).copy(), state, conflicts, lock, track)
    sX = SharedTile("sX", np.full((C, C), np.nan, np.float32), state, conflicts, lock, track)
    sX00 = SharedTile("sX00", np.full((C // 2, C // 2), np.nan, np.float32), state, conflicts, lock, track)
    barrier, errors = threading.Barrier(THREADS), []

    def thread_body(thread: int) -> None:
        state.thread, state.interval = thread, 0
        try:
            with np.errstate(invalid="ignore", over="ignore"):  # the non-finite cases; per thread in numpy 2
                tile_inverse.invert_tile.__wrapped__(sL, sX, sX00, thread // 32, thread % 32)
        except Exception as error:  # noqa: BLE001 - re-raised in the main thread
            errors.append(error)
            barrier.abort()

    with emulated_device(barrier, state, operand):
        threads = [threading.Thread(target=thread_body, args=(n,)) for n in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    return sX.values, conflicts


def l_tile(seed: int, C: int) -> np.ndarray:
    """A strictly lower C x C L tile of realistic inputs: L[i, j] = beta_i sum_d k_id k_jd 2^(g_id - g_jd), in fp64."""
    x = reference.make_inputs(1, C, 1, 128, 128, generator=torch.Generator().manual_seed(seed), lower_bound=-5.0,
                              chunk_size=C)
    k, g, beta = (x[n].double()[0, :, 0] for n in ("k", "gk", "beta"))
    L = beta[:, None] * ((k * torch.exp2(g)) @ (k * torch.exp2(-g)).T)
    return torch.tril(L, -1).float().numpy()


def bits(x: np.ndarray) -> np.ndarray:
    return x.view(np.uint32)


def test_finalize_negates_and_writes_a_zero_of_either_sign_as_plus_zero():
    with emulated_device(threading.Barrier(1), threading.local()):
        below = [tile_inverse.finalize(F32(acc), 0, 1, False).v for acc in (0.0, -0.0, 2.5, -3.0)]
        diagonal = [tile_inverse.finalize(F32(-0.0), col, 1, True).v for col in (0, 1, 2)]  # row 1: below, on, above
    assert bits(np.array(below, np.float32)).tolist()[:2] == [0, 0], "x = -acc must be +0.0 for acc = +-0"
    assert below[2:] == [-2.5, 3.0]
    assert bits(np.array(diagonal, np.float32)).tolist() == [0, bits(np.array([1.0], np.float32))[0], 0]


@pytest.mark.parametrize("C", CHUNKS)
def test_inverse_accurate_exact_structure_and_race_free(C):
    L = l_tile(0, C)
    X, conflicts = invert(L)
    assert conflicts == [], f"elements shared between threads within one barrier interval: {conflicts[:5]}"
    ref = np.linalg.inv(np.eye(C) + L.astype(np.float64))
    err = np.linalg.norm(X - ref) / np.linalg.norm(ref)
    X_truncated, _ = invert(L, tf32_truncated, track=False)  # the same code with FLA's TF32 operands
    err_truncated = np.linalg.norm(X_truncated - ref) / np.linalg.norm(ref)
    assert err < 1e-6 and err <= err_truncated, \
        f"relative fp64 error {err:.3e}, with truncated operands {err_truncated:.3e} (rounded: 1.4e-7 - 4.1e-7)"
    upper = X[np.triu_indices(C, 1)]
    assert np.all(bits(upper) == 0), "every element above the diagonal must be +0.0"
    assert np.all(np.diag(X) == 1.0)


@pytest.mark.parametrize("C", CHUNKS)
def test_inverse_rows_depend_on_earlier_rows_only(C):
    L = l_tile(2, C)
    full, _ = invert(L, track=False)
    # each step and block boundary: diagonal block, S = 16, S = 32 (chunk 64)
    for v in [v for v in (1, 15, 17, 32, 47, 63) if v < C] + ([31] if C == 32 else []):
        zeroed = L.copy()
        zeroed[v:] = 0  # what a chunk with v valid rows leaves in shared memory
        X, _ = invert(zeroed, track=False)
        assert np.array_equal(bits(X[:v]), bits(full[:v])), f"rows < {v} changed when rows >= {v} are zero"
        hostile = L.copy()
        hostile[v, :v] = np.nan  # row v's own L, and row v's column in later rows
        hostile[v + 1:, v] = np.inf
        X, _ = invert(hostile, track=False)
        block = tile_inverse.BLOCK * (v // tile_inverse.BLOCK)  # rows before v's 16-row block
        assert np.array_equal(bits(X[:block]), bits(full[:block])), f"a non-finite row {v} reached rows < {block}"
        assert np.isnan(X[v, :v]).all()
