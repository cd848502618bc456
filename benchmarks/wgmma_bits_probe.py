"""Do warpgroup MMA (wgmma) and the W / U products' warp MMA (mma.sync) give the same bits?

    python benchmarks/wgmma_bits_probe.py --export DIR      # compile (no GPU: CUTE_DSL_ARCH=sm_90a)
    python benchmarks/wgmma_bits_probe.py --objects DIR     # run on the GPU: compare, and time both

The fused kernel multiplies W = Akk @ Kp and U = Akk @ Vp with `mma.sync.m16n8k16` (bf16 in, fp32 accumulate,
k-steps of 16 in ascending order: tile_recompute.product). A wgmma route (one warpgroup, m64n128k16, operands
read from the same swizzled shared tiles by descriptor) may only replace it if every output keeps its bits
(docs/numerics.md). This probe computes C = A @ B both ways from the same shared tiles (A: 64 x 64 in
`RecomputeLayouts.akk`, B: the (d, j) tile of `RecomputeLayouts.kp`, K = 128) and writes both fp32 accumulators;
the host compares them bit for bit over many tiles whose values span wide exponent ranges (so that the
products' alignment and the accumulator's rounding are exercised), and times one launch of each route.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHUNK, HEAD = 64, 128
ROUTES = ("sync", "wgmma", "wgmma-canon")


def probe_class():
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    from cutlass.memory import SmemAllocator
    from cutlass.tensor_utils import LayoutEnum

    from kdajit.templates.common import make_struct
    from kdajit.templates.tile_recompute import (RecomputeLayouts, b_operand_copy, load_akk_fragments,
                                                 make_recompute_mma, product_sums)

    class ProductProbe:
        """C[n] = A[n] @ B[n] (A [n, 64, 64], B [n, 64, 128] bf16; C fp32) by one route, one CTA per n."""

        def __init__(self, route: str):
            self.route = route

        def fake_args(self):
            n = cute.sym_int()
            tiles = lambda dtype, cols: make_fake_compact_tensor(dtype, (n, CHUNK, cols), stride_order=(2, 1, 0),
                                                                 assumed_align=16)
            return (tiles(cutlass.BFloat16, CHUNK), tiles(cutlass.BFloat16, HEAD), tiles(cutlass.Float32, HEAD),
                    make_fake_stream(use_tvm_ffi_env_stream=True))

        @cute.jit
        def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, stream: cuda.CUstream):
            layouts = RecomputeLayouts(CHUNK, HEAD, HEAD)
            if cutlass.const_expr(self.route == "sync"):
                tiled_mma = make_recompute_mma(CHUNK, cutlass.BFloat16)
            else:
                tiled_mma = sm90_utils.make_trivial_tiled_mma(
                    cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.MN, cutlass.Float32,
                    (1, 1, 1), tiler_mn=(64, HEAD))
            a_layout, b_layout = layouts.akk, layouts.kp
            if cutlass.const_expr(self.route == "wgmma-canon"):  # CUTLASS's own layouts for these operands
                tile = (CHUNK, HEAD, CHUNK)
                a_layout = cute.slice_(sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, cutlass.BFloat16, 1),
                                       (None, None, 0))
                b_layout = cute.slice_(sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, tile, cutlass.BFloat16, 1),
                                       (None, None, 0))
            self.kernel(mA, mB, mC, tiled_mma, a_layout, b_layout).launch(
                grid=(mA.shape[0], 1, 1), block=(128, 1, 1), stream=stream)

        @cute.kernel
        def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, tiled_mma: cute.TiledMma,
                   sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout):
            tidx, _, _ = cute.arch.thread_idx()
            n, _, _ = cute.arch.block_idx()
            S = cute.struct
            smem = SmemAllocator().allocate(make_struct("ProbeSmem", [
                ("a", S.Align[S.MemRange[cutlass.BFloat16, CHUNK * CHUNK], 1024]),
                ("b", S.Align[S.MemRange[cutlass.BFloat16, HEAD * CHUNK], 1024]),
            ]))
            if cutlass.const_expr(self.route == "wgmma-canon"):
                sA = smem.a.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
                sB = smem.b.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
            else:
                # The kernels' views: the layouts' swizzle acts on element offsets (Swizzle<3, 3, 3> of 16-bit
                # elements: 16-byte groups XOR the 128-byte row index mod 8, the 128-byte swizzle).
                sA = smem.a.get_tensor(sA_layout)
                sB = smem.b.get_tensor(sB_layout)  # (d, j)
            gA = mA[n, None, None]
            gB = mB[n, None, None]
            gC = mC[n, None, None]
            for e in cutlass.range(tidx, CHUNK * CHUNK, 128, unroll=1):
                sA[e // CHUNK, e % CHUNK] = gA[e // CHUNK, e % CHUNK]
            for e in cutlass.range(tidx, CHUNK * HEAD, 128, unroll=1):
                sB[e % HEAD, e // HEAD] = gB[e // HEAD, e % HEAD]
            if cutlass.const_expr(self.route == "sync"):
                # tile_recompute.product's own sums, before its bf16 rounding and staging: the raw fp32 values
                cute.arch.sync_threads()
                acc = product_sums(tiled_mma, b_operand_copy(tiled_mma, cutlass.BFloat16),
                                   load_akk_fragments(tiled_mma, sA, tidx), sB, gC, tidx)
                cute.autovec_copy(acc, tiled_mma.get_slice(tidx).partition_C(gC))
            else:
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()
                # The same bytes seen the way a wgmma descriptor needs them: the swizzle on the pointer, where it
                # acts on byte addresses (Swizzle<3, 4, 3>: the same 128-byte swizzle), over the same outer layout.
                if cutlass.const_expr(self.route == "wgmma"):
                    sA = smem.a.get_tensor(sA_layout.outer, swizzle=cute.make_swizzle(3, 4, 3))
                    sB = smem.b.get_tensor(sB_layout.outer, swizzle=cute.make_swizzle(3, 4, 3))
                thr = tiled_mma.get_slice(tidx)
                tCrA = tiled_mma.make_fragment_A(thr.partition_A(sA))
                tCrB = tiled_mma.make_fragment_B(thr.partition_B(sB))
                tCgC = thr.partition_C(gC)
                acc = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
                # +0 + the first step's sum, as the warp MMA's zeroed accumulator (a first step without the
                # accumulator could give -0 where the warp MMA gives +0)
                acc.fill(0.0)
                tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.fence()
                for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
                    cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                cute.autovec_copy(acc, tCgC)

    return ProductProbe


def export(directory: str) -> None:
    from kdajit import compiler

    os.makedirs(directory, exist_ok=True)
    cls = probe_class()
    for route in ROUTES:
        compiled = compiler.compile_template(cls(route), "sm_90a")
        compiler.export_object(compiled, os.path.join(directory, f"product-{route}.o"))
        print(f"{route}: compiled in {compiled.kdajit_compile_s:.1f} s", flush=True)


def operands(n: int, seed: int, spread: float):
    """A, B with entries N(0, 1) * 2^U(-spread, spread), rounded to bf16; one row in eight of A exactly zero
    past its diagonal (Akk's lower-triangular shape)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    scaled = lambda *shape: (torch.randn(*shape, device="cuda", generator=gen)
                             * torch.exp2((torch.rand(*shape, device="cuda", generator=gen) * 2 - 1) * spread))
    a = scaled(n, CHUNK, CHUNK)
    a[:, ::8] = torch.tril(a[:, ::8])
    return a.to(torch.bfloat16).contiguous(), scaled(n, CHUNK, HEAD).to(torch.bfloat16).contiguous()


def run(directory: str, tiles: int) -> int:
    import torch
    import triton.testing

    from kdajit import compiler

    fns = {r: compiler.load_object(os.path.join(directory, f"product-{r}.o")) for r in ROUTES}
    worst = 0
    for seed, spread in ((1, 0.0), (2, 4.0), (3, 12.0), (4, 24.0)):
        a, b = operands(tiles, seed, spread)
        outs = {}
        for route, fn in fns.items():
            c = torch.full((tiles, CHUNK, HEAD), float("nan"), device="cuda")
            fn(a, b, c)
            outs[route] = c
        torch.cuda.synchronize()
        ref = a.double() @ b.double()
        base = outs["sync"].view(torch.int32)
        differ = {r: int((o.view(torch.int32) != base).sum()) for r, o in outs.items() if r != "sync"}
        nans = {r: int(o.isnan().sum()) for r, o in outs.items()}
        err = {r: float(((o.double() - ref).abs().max() / ref.abs().max())) for r, o in outs.items()}
        print(f"spread 2^+-{spread:g}, {tiles} tiles: fp32 outputs differing from sync's (of {base.numel()}) "
              f"{differ}; NaN left {nans}; max error / max |C| {err}", flush=True)
        worst = max(worst, sum(differ.values()) + sum(nans.values()))
    for route, fn in fns.items():
        ms = triton.testing.do_bench(lambda: fn(a, b, c), warmup=20, rep=100, return_mode="median")
        print(f"{route}: {ms:.3f} ms for {tiles} tiles (load + product + fp32 store)", flush=True)
    print("same bits" if worst == 0 else "DIFFERENT BITS", flush=True)
    return 0 if worst == 0 else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", metavar="DIR", help="compile every route (ROUTES) to object files in DIR and exit")
    parser.add_argument("--objects", metavar="DIR", help="run the routes exported to DIR")
    parser.add_argument("--tiles", type=int, default=16384)
    args = parser.parse_args(argv)
    if args.export:
        export(args.export)
        return 0
    if args.objects:
        return run(args.objects, args.tiles)
    parser.error("give --export DIR or --objects DIR")


if __name__ == "__main__":
    sys.exit(main())
