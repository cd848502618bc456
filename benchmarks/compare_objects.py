"""Are two builds of the fused kernel bit-identical? Run each pair of exported full kernels on the same inputs.

    python benchmarks/compare_objects.py DIR_A DIR_B --kv 100 [--gate any] [--varlen] [--reference CONFIG]     (GPU)

DIR_A and DIR_B hold objects written by `benchmarks/fused_phases.py --export` (e.g. one from an earlier commit's
tree through `benchmarks/other_tree.py`, one from this tree); every `CONFIG.all.o` (the whole kernel) present in
both is launched on the same random inputs of each of SHAPES (B=2, T=1000 with a ragged last chunk, H=8; and
B=1, T=50, H=1: a tile smaller than a chunk in rows and a single head; safe gates, or with `--gate any` FLA's
logsigmoid x 10 gates, a quarter of them exactly 0), each into outputs poisoned with NaN, and every output is
compared bit for bit. With `--varlen` the objects are cu32 kernels (`fused_phases.py --export --varlen`), run on
VARLEN_SHAPES instead: packed sequences with empty, 1-token and partial ones, and packs long enough that a
persistent CTA walks many tiles of one sequence and crosses many sequences. For a change meant to keep the bits (docs/numerics.md) whose PTX differs, so
that comparing PTX on the CPU cannot settle it. With `--reference CONFIG`, every object of DIR_B is compared with
DIR_A's `CONFIG.all.o` instead (a configuration DIR_A's tree cannot build, against one it can). Exit status 1 if
any output differs.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

OUTPUTS = ("Aqk", "Akk", "w", "u", "kg")
SHAPES = ((2, 1000, 8), (1, 50, 1))  # (B, T, H)
VARLEN_SHAPES = (([1, 15, 63, 0, 64, 65, 500, 1000], 8), ("packed", 8), ("packed", 32))  # (lengths, H)


def shape_inputs(kv: int, any_gate: bool, shape: tuple) -> tuple:
    """(inputs, cu_seqlens or None, label): seed-0 inputs on the GPU of `shape`, (B, T, H) or (lengths, H) for packed
    sequences (cu32; "packed": bench_forward's 32 lengths in 1..4096)."""
    import torch

    from bench_forward import packed_cu_seqlens, packed_lengths
    from kdajit import reference

    cu = None
    if len(shape) == 2:
        lengths = packed_lengths() if shape[0] == "packed" else shape[0]
        B, T, H = 1, sum(lengths), shape[1]
        cu = packed_cu_seqlens(lengths)
        label = f"{len(lengths)} seqs, T={T}, H={H}"
    else:
        B, T, H = shape
        label = f"{shape}"
    gen = torch.Generator().manual_seed(0)
    x = reference.make_inputs(B, T, H, kv, kv, beta_dtype=torch.bfloat16, device="cuda", generator=gen,
                              gate_scale=10.0 if any_gate else None, gate_zeros=0.25 if any_gate else 0.0,
                              cu_seqlens=cu)
    return x, cu, label


def run_object(path: str, kv: int, x: dict, cu) -> list:
    """The five outputs of one exported fused kernel (bf16, no QG, chunk 64) on `shape_inputs`' inputs, written into
    outputs poisoned with NaN."""
    import torch

    from fused_phases import config_of, max_ctas
    from kdajit import api, compiler

    B, T, H = x["gk"].shape[:3]
    outs = [torch.full((B, T, H, d), float("nan"), dtype=torch.bfloat16, device="cuda") for d in (64, 64, kv, kv, kv)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernels = api._Kernels(None, None, None, compiler.load_object(path), max_ctas(config_of(path), sms))
    api._run_fused(x["q"], x["k"], x["v"], x["gk"], x["beta"], kv ** -0.5, api._cu_seqlens_arg(cu, x["q"].device),
                   kernels, *outs, None)
    torch.cuda.synchronize()
    return outs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir_a")
    parser.add_argument("dir_b")
    parser.add_argument("--kv", type=int, default=128, help="head size K = V the objects were exported with")
    parser.add_argument("--gate", choices=("safe", "any"), default="safe", help="the objects' gate path")
    parser.add_argument("--varlen", action="store_true", help="cu32 objects, run on VARLEN_SHAPES")
    parser.add_argument("--reference", metavar="CONFIG", help="compare every object of DIR_B with DIR_A's CONFIG.all.o")
    args = parser.parse_args(argv)
    import torch

    if args.reference:
        pairs = [(os.path.join(args.dir_a, args.reference + ".all.o"), p)
                 for p in sorted(glob.glob(os.path.join(args.dir_b, "*.all.o")))]
    else:
        pairs = [(p, os.path.join(args.dir_b, os.path.basename(p)))
                 for p in sorted(glob.glob(os.path.join(args.dir_a, "*.all.o")))]
    pairs = [(a, b) for a, b in pairs if os.path.exists(a) and os.path.exists(b)]
    if not pairs:
        raise SystemExit(f"no CONFIG.all.o to compare in {args.dir_a} and {args.dir_b}")
    differs = False
    print("| object | shape | " + " | ".join(OUTPUTS) + " |\n|---|---|" + "---|" * len(OUTPUTS))
    for shape in VARLEN_SHAPES if args.varlen else SHAPES:
        x, cu, label = shape_inputs(args.kv, args.gate == "any", shape)  # once per shape: the packs take seconds
        for path_a, path_b in pairs:
            a, b = (run_object(path, args.kv, x, cu) for path in (path_a, path_b))
            cells = []
            for u, w in zip(a, b):
                same = torch.equal(u.view(torch.int16), w.view(torch.int16))
                differs |= not same
                cells.append("same bits" if same else
                             f"DIFFERENT ({(u.view(torch.int16) != w.view(torch.int16)).sum()})")
            print(f"| {os.path.basename(path_b)} | {label} | " + " | ".join(cells) + " |", flush=True)
            del a, b
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
