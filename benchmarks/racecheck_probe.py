"""Does compute-sanitizer's racecheck understand tile-w8's barrier pattern? A minimal two-group kernel (GPU).

    compute-sanitizer --tool racecheck --error-exitcode 1 python benchmarks/racecheck_probe.py --named on|off

docs/reliability.md records racecheck hazards in the fused kernel's 8-warp configurations between the A-tile
stores of warps 0-3 (`store_akk`) and the A-tile ldmatrix reads of both warp groups (`load_akk_fragments`),
although one CTA-wide `bar.sync 0` that both groups reach separates them in the PTX. This kernel keeps only that
pattern, with the same device functions and layouts: 8 warps; warps 0-3 stage a 64 x 64 A tile (`store_akk`) while
warps 4-7 do not touch it; a CTA barrier; then each group reads the whole tile (`load_akk_fragments`) and writes
its fragments to global memory, which the host checks. `--named on` puts named barriers (ids 1 and 2, 128
threads: tile-w8's `sync_group`) inside each group's branch before the CTA barrier, as tile-w8 has them; `--named
off` leaves them out. The program is race-free by the PTX memory model either way: if racecheck reports a hazard
with `--named on` and none with `off`, the tile-w8 report is the tool's, not the kernel's.
"""
from __future__ import annotations

import argparse
import os
import sys

import cuda.bindings.driver as cuda
import torch

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import from_dlpack
from cutlass.memory import SmemAllocator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kdajit.templates.common import sync_group  # noqa: E402
from kdajit.templates.tile_recompute import (RecomputeLayouts, load_akk_fragments, make_recompute_mma,  # noqa: E402
                                             row_fragments, store_akk)

CHUNK, GROUP = 64, 128
BARRIERS = ((1, GROUP), (2, GROUP))


@cute.kernel
def probe_kernel(mA: cute.Tensor, mOut: cute.Tensor, mma: cute.TiledMma, sA_layout: cute.ComposedLayout,
                 named: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    group_tidx = tidx % GROUP
    sA = SmemAllocator().allocate_tensor(cutlass.BFloat16, sA_layout, 1024)
    if warp_idx < GROUP // 32:
        if cutlass.const_expr(named):
            sync_group(BARRIERS[0])
        rA = row_fragments(CHUNK // (GROUP // (CHUNK // 8)), cutlass.BFloat16)
        for p in cutlass.range_constexpr(cute.size(rA, mode=[0])):
            row = group_tidx // (CHUNK // 8) + p * (GROUP // (CHUNK // 8))
            cute.autovec_copy(cute.local_tile(mA[row, None], (8,), (group_tidx % (CHUNK // 8),)), rA[p, None])
        if cutlass.const_expr(named):
            sync_group(BARRIERS[0])
        store_akk(rA, sA, CHUNK, group_tidx, GROUP)
    else:
        if cutlass.const_expr(named):
            sync_group(BARRIERS[1])
    cute.arch.sync_threads()
    frags = load_akk_fragments(mma, sA, group_tidx)
    values = frags.load()
    for i in cutlass.range_constexpr(cute.size(frags)):
        mOut[tidx, i] = values[i]


@cute.jit
def probe(mA: cute.Tensor, mOut: cute.Tensor, named: cutlass.Constexpr, stream: cuda.CUstream):
    mma = make_recompute_mma(CHUNK, GROUP, cutlass.BFloat16)
    probe_kernel(mA, mOut, mma, RecomputeLayouts(CHUNK, 128, 128).akk, named).launch(
        grid=(1, 1, 1), block=(2 * GROUP, 1, 1), stream=stream)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--named", choices=("on", "off"), default="on")
    args = parser.parse_args(argv)
    a = torch.randn(CHUNK, CHUNK, device="cuda").bfloat16()
    per_thread = CHUNK * CHUNK // GROUP  # every thread of a group holds a 1/128 share of the tile's fragments
    out = torch.full((2 * GROUP, per_thread), float("nan"), device="cuda").bfloat16()
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    fn = cute.compile(probe, from_dlpack(a), from_dlpack(out), args.named == "on", stream)
    fn(from_dlpack(a), from_dlpack(out), stream)
    torch.cuda.synchronize()
    # Both groups read the same fragments; each group's fragments hold every element of the tile once.
    same = torch.equal(out[:GROUP], out[GROUP:])
    complete = torch.equal(out[:GROUP].float().flatten().sort().values, a.float().flatten().sort().values)
    print(f"named barriers {args.named}: groups agree {same}, fragments hold the tile {complete}")
    return 0 if same and complete else 1


if __name__ == "__main__":
    sys.exit(main())
