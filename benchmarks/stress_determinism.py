"""Determinism stress test: millions of CUDA-graph replays of kdajit.forward, every output bit compared on the device.

One CUDA graph holds: poison every output with NaN, `kdajit.forward` into those static buffers, compare every
element of every output (as raw 16-bit patterns) with reference outputs, and add the number of mismatching
elements to a device counter. Replays never synchronise with the host; every `--checkpoint` replays the counter
is read and the JSON report is rewritten. Before any replay, the eager forward must equal, bit for bit, an
independent run of the standalone route (`kdajit.intra` + `kdajit.recompute_w_u`); its outputs are the reference.
A fraction of the checkpoint windows (`--noise`) run with a bandwidth-heavy copy on another stream, so the CTAs
land on the SMs in other orders. Method and results: docs/reliability.md. GPU only; `--help` works anywhere.

    python benchmarks/stress_determinism.py --replays 10000000 --tokens 256 --heads 4 --beta bf16
    python benchmarks/stress_determinism.py --replays 1000000 --varlen --lengths 1,63,65,64,200
    python benchmarks/stress_determinism.py --replays 1000000 --config persistent-c2-head-a1   # a tuner choice
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import kdajit
from kdajit import api, reference
from kdajit.keys import FUSED_CONFIG_SPACE
from kdajit.outputs import BETA_TORCH_DTYPES

FIELDS = ("Aqk", "Akk", "w", "u", "kg", "qg")
BETA = BETA_TORCH_DTYPES


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replays", type=int, default=10_000_000, help="graph replays in total (default 10,000,000)")
    p.add_argument("--checkpoint", type=int, default=100_000, help="replays between counter reads and reports")
    p.add_argument("--batch", type=int, default=1, help="B (dense mode)")
    p.add_argument("--tokens", type=int, default=256, help="T (dense mode)")
    p.add_argument("--heads", type=int, default=4, help="H")
    p.add_argument("--beta", choices=tuple(BETA), default="bf16", help="beta dtype")
    p.add_argument("--varlen", action="store_true", help="pack sequences of --lengths with cu_seqlens (B = 1)")
    p.add_argument("--lengths", default="1,63,65,64,127,300", help="varlen sequence lengths, comma separated")
    p.add_argument("--noise", type=float, default=0.25,
                   help="fraction of checkpoint windows run with a concurrent large copy on another stream")
    p.add_argument("--noise-mib", type=int, default=1024, help="size of each noise copy in MiB")
    p.add_argument("--noise-every", type=int, default=16, help="replays per noise copy enqueued")
    p.add_argument("--max-seconds", type=float, default=None, help="stop at the first checkpoint after this time")
    p.add_argument("--no-qg", action="store_true",
                   help="output_qg=False (FLA's default; forward then runs tile-w8 at K = 128 untuned)")
    p.add_argument("--config", default=None, choices=[c.slug() for c in FUSED_CONFIG_SPACE],
                   help="fused configuration the graph runs (default: what forward picks, the tuner's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default="stress_determinism.json", help="JSON report path")
    return p.parse_args(argv)


def commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha.stdout.strip() + ("-dirty" if dirty else "")


def make_problem(args):
    gen = torch.Generator().manual_seed(args.seed)
    cu = None
    if args.varlen:
        lengths = [int(n) for n in args.lengths.split(",")]
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).cuda()
        x = reference.make_inputs(1, sum(lengths), args.heads, beta_dtype=BETA[args.beta], cu_seqlens=cu,
                                  device="cuda", generator=gen)
    else:
        x = reference.make_inputs(args.batch, args.tokens, args.heads, beta_dtype=BETA[args.beta], device="cuda",
                                  generator=gen)
    return x, cu


def static_outputs(x) -> tuple[torch.Tensor, kdajit.ForwardOutput]:
    """One flat bf16 buffer and the six outputs as contiguous, 16-byte aligned views of it (one compare)."""
    B, T, H, K = x["q"].shape
    shapes = [(B, T, H, 64), (B, T, H, 64), (B, T, H, K), (B, T, H, x["v"].shape[-1]), (B, T, H, K), (B, T, H, K)]
    sizes = [-(-torch.Size(s).numel() // 8) * 8 for s in shapes]  # round each view up to 16 bytes
    flat = torch.empty(sum(sizes), dtype=torch.bfloat16, device="cuda")
    views, start = [], 0
    for shape, size in zip(shapes, sizes):
        views.append(flat[start:start + torch.Size(shape).numel()].view(shape))
        start += size
    return flat, kdajit.ForwardOutput(*views)


CONFIG = None  # --config: the fused configuration every forward of this run uses
OUTPUT_QG = True  # not --no-qg (without QG the qg view is never written: its NaN bits stay in every replay)


def forward(x, cu, out=None):
    if CONFIG is not None:
        return api._forward(x["q"], x["k"], x["v"], x["gk"], x["beta"], None, cu, 64, OUTPUT_QG, True, out,
                            fused_config=CONFIG)
    return kdajit.forward(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, output_qg=OUTPUT_QG, out=out)


def check_standalone_route(x, cu, eager: kdajit.ForwardOutput) -> None:
    Aqk, Akk = kdajit.intra(x["q"], x["k"], x["gk"], x["beta"], cu_seqlens=cu)
    w, u, kg, qg = kdajit.recompute_w_u(x["k"], x["v"], x["beta"], Akk, x["gk"], cu_seqlens=cu,
                                        q=x["q"] if OUTPUT_QG else None)
    for name, a, b in zip(FIELDS, eager, (Aqk, Akk, w, u, kg, qg)):
        if b is None:
            continue
        if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
            bad = int((a.view(torch.int16) != b.view(torch.int16)).sum())
            sys.exit(f"forward != intra + recompute_w_u: {name} differs in {bad} elements; not replaying")


def capture(x, cu, flat, out, ref_bits, counter) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream, as torch recommends
        forward(x, cu, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flat.fill_(float("nan"))
        forward(x, cu, out)
        counter.add_((flat.view(torch.int16) != ref_bits).sum())
    return graph


def main(argv=None) -> int:
    global CONFIG, OUTPUT_QG
    args = parse_args(argv)
    CONFIG = next((c for c in FUSED_CONFIG_SPACE if c.slug() == args.config), None)
    OUTPUT_QG = not args.no_qg
    if not torch.cuda.is_available():
        sys.exit("stress_determinism needs a CUDA GPU")
    x, cu = make_problem(args)
    flat, out = static_outputs(x)
    flat.fill_(float("nan"))  # the padding between views keeps these bits in every replay
    eager = forward(x, cu, out)
    torch.cuda.synchronize()
    check_standalone_route(x, cu, eager)
    ref_bits = flat.view(torch.int16).clone()
    counter = torch.zeros((), dtype=torch.int64, device="cuda")
    graph = capture(x, cu, flat, out, ref_bits, counter)
    graph.replay()
    torch.cuda.synchronize()
    if int(counter):
        sys.exit(f"the first graph replay differs from the eager run in {int(counter)} elements")
    counter.zero_()

    noise_stream = torch.cuda.Stream()
    noise_n = args.noise_mib * 2**20 // 4
    noise_src = torch.empty(noise_n, dtype=torch.float32, device="cuda") if args.noise > 0 else None
    noise_dst = torch.empty_like(noise_src) if noise_src is not None else None
    report = dict(device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                  shape=dict(B=x["q"].shape[0], T=x["q"].shape[1], H=args.heads, K=x["q"].shape[-1],
                             V=x["v"].shape[-1]),
                  beta_dtype=args.beta, config=args.config or "forward's choice", output_qg=OUTPUT_QG,
                  mode="varlen" if args.varlen else "dense",
                  lengths=[int(n) for n in args.lengths.split(",")] if args.varlen else None,
                  seed=args.seed, commit=commit(), torch=torch.__version__, iterations=0, noisy_iterations=0,
                  mismatches=0, seconds=0.0, replays_per_s=0.0, complete=False)
    done, window, start = 0, 0, time.perf_counter()
    while done < args.replays:
        n = min(args.checkpoint, args.replays - done)
        noisy = noise_src is not None and int((window + 1) * args.noise) > int(window * args.noise)
        for i in range(n):
            if noisy and i % args.noise_every == 0:
                with torch.cuda.stream(noise_stream):
                    noise_dst.copy_(noise_src)
            graph.replay()
        mismatches = int(counter)  # the only host synchronisation of the window
        noise_stream.synchronize()  # no copy spills into a quiet window
        done, window = done + n, window + 1
        report["noisy_iterations"] += n if noisy else 0
        seconds = time.perf_counter() - start
        report.update(iterations=done, mismatches=mismatches, seconds=round(seconds, 3),
                      replays_per_s=round(done / seconds, 1), complete=done == args.replays)
        with open(args.report, "w") as f:
            json.dump(report, f, indent=1)
        print(f"{done:>11,} replays  {mismatches} mismatches  {done / seconds:,.0f}/s{'  (noise)' if noisy else ''}",
              flush=True)
        if args.max_seconds is not None and seconds > args.max_seconds:
            break
    print(json.dumps(report))
    return 1 if report["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
