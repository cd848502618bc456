"""FLA's whole `chunk_kda` with and without the kdajit backend: time, and whether its output is prefix-stable.

    python benchmarks/bench_fla_backend.py [--json out.json] [--shapes 1x2048x8,2x8192x64] [--no-prefix]

First the prefix check: rows of `o` for a prompt of T0 tokens vs the same prompt followed by more tokens,
bit for bit, with the backend off and on (FLA's later stages decide whether the whole output is
prefix-stable). Then for each shape: median time (triton.testing.do_bench) of the forward alone (no grad)
and of forward + backward, FLA's own kernels vs the kdajit backend, in the same process. Each result is
printed and written to --json as soon as it exists.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

SHAPES = ((1, 2048, 8), (2, 8192, 64))  # the small shape first: it autotunes and runs sooner


def inputs(B: int, T: int, H: int, seed: int = 0, grad: bool = False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, 128, device="cuda", generator=g), dim=-1).bfloat16()
    k = F.normalize(torch.randn(B, T, H, 128, device="cuda", generator=g), dim=-1).bfloat16()
    v = torch.randn(B, T, H, 128, device="cuda", generator=g).bfloat16()
    gate = -5.0 * torch.sigmoid(torch.randn(B, T, H, 128, device="cuda", generator=g))
    beta = torch.rand(B, T, H, device="cuda", generator=g).bfloat16()
    return [x.requires_grad_(grad) for x in (q, k, v, gate, beta)]


def parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    try:
        shapes = tuple(tuple(int(n) for n in item.split("x")) for item in text.split(","))
    except ValueError:
        shapes = ()
    if not shapes or any(len(shape) != 3 for shape in shapes):
        raise argparse.ArgumentTypeError(f"--shapes {text!r}: expected BxTxH[,BxTxH...], e.g. 2x8192x64")
    return shapes  # type: ignore[return-value]


def time_shape(B: int, T: int, H: int) -> dict:
    import triton.testing
    from fla.ops.kda import chunk_kda

    from kdajit.integrations import fla as kdajit_fla

    x = inputs(B, T, H, grad=True)
    do = torch.randn_like(x[2])

    def fwd():
        with torch.no_grad():
            chunk_kda(*x, safe_gate=True)

    def fwd_bwd():
        o, _ = chunk_kda(*x, safe_gate=True)
        o.backward(do)

    row = {"B": B, "T": T, "H": H}
    for label, switch in (("fla", kdajit_fla.disable), ("kdajit", kdajit_fla.enable)):
        switch()
        row[f"{label}_fwd_ms"] = triton.testing.do_bench(fwd, warmup=25, rep=200, return_mode="median")
        row[f"{label}_fwd_bwd_ms"] = triton.testing.do_bench(fwd_bwd, warmup=10, rep=200, return_mode="median")
    kdajit_fla.disable()
    return row


def prefix_stable(prompt: int, extra: int) -> dict:
    from fla.ops.kda import chunk_kda

    from kdajit.integrations import fla as kdajit_fla

    long = inputs(1, prompt + extra, 4)
    short = [t[:, :prompt].contiguous() for t in long]
    result = {"prompt": prompt, "extra": extra}
    for label, switch in (("fla", kdajit_fla.disable), ("kdajit", kdajit_fla.enable)):
        switch()
        with torch.no_grad():
            o_long, _ = chunk_kda(*long, safe_gate=True)
            o_short, _ = chunk_kda(*short, safe_gate=True)
        result[f"{label}_prefix_bitwise"] = bool(torch.equal(o_long[:, :prompt], o_short))
    kdajit_fla.disable()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES,
                        help="BxTxH shapes to time, comma-separated (default: 1x2048x8,2x8192x64)")
    parser.add_argument("--no-prefix", action="store_true", help="skip the prefix-stability check")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fla_backend needs a CUDA GPU")
        return 1
    # Each result is printed (and the JSON rewritten) as soon as it exists: a run cut short by a time limit
    # keeps what it measured: the prefix checks (forward only, fewer FLA kernels to compile) first.
    results: dict = {"timings": [], "prefix": []}

    def report(section: str, value: dict, line: str) -> None:
        results[section].append(value)
        print(line, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)

    for prompt, extra in () if args.no_prefix else ((70, 58), (1000, 37), (4096, 100)):
        p = prefix_stable(prompt, extra)
        report("prefix", p, f"prefix {prompt} + {extra}: o rows bit-identical: FLA {p['fla_prefix_bitwise']}, "
                            f"with kdajit backend {p['kdajit_prefix_bitwise']}")
    print("| shape | FLA fwd ms | kdajit-backend fwd ms | ratio | FLA fwd+bwd ms | kdajit-backend fwd+bwd ms | ratio |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for shape in args.shapes:
        r = time_shape(*shape)
        report("timings", r, f"| {r['B']} x {r['T']} x {r['H']} | {r['fla_fwd_ms']:.3f} | {r['kdajit_fwd_ms']:.3f} | "
                             f"{r['fla_fwd_ms'] / r['kdajit_fwd_ms']:.2f}x | {r['fla_fwd_bwd_ms']:.3f} | "
                             f"{r['kdajit_fwd_bwd_ms']:.3f} | {r['fla_fwd_bwd_ms'] / r['kdajit_fwd_bwd_ms']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
