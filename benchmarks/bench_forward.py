"""Time kdajit.forward against FLA's Triton chunk_kda_fwd_intra in the same process, and say where time goes.

    python benchmarks/bench_forward.py [--B 2 --T 8192 --H 64] [--json out.json]

Prints, per case: median time of each implementation (triton.testing.do_bench, median of repeats),
the ratio FLA / kdajit (> 1: kdajit faster), effective bandwidth over the minimal traffic (each input
read once, each output written once), and a per-kernel breakdown of kdajit from the torch profiler.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import kdajit
from kdajit import reference

HBM_TBPS = 4.18  # measured copy bandwidth of the H200 (read + write bytes / time)


def minimal_bytes(B: int, T: int, H: int, K: int, V: int, chunk: int, beta_bytes: int) -> int:
    inputs = B * T * H * (2 * K * 2 + V * 2 + K * 4 + beta_bytes)  # q, k, v bf16; gk fp32; beta
    outputs = B * T * H * (2 * chunk * 2 + 2 * K * 2 + V * 2)  # Aqk, Akk; w, kg; u
    return inputs + outputs


def bench(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median")


def kernel_breakdown(fn) -> list[tuple[str, float]]:
    """CUDA time per kernel name (ms per call), from the torch profiler over 10 calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        cuda_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if cuda_us > 0:
            rows.append((e.key[:60], cuda_us / 10 / 1e3))
    return sorted(rows, key=lambda r: -r[1])


def run_case(B: int, T: int, H: int, beta: str, varlen: bool) -> dict:
    beta_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[beta]
    cu = None
    if varlen:  # 8 sequences of random lengths summing to B*T, packed
        cuts = sorted(torch.randperm(B * T - 1)[:7].add(1).tolist())
        cu = torch.tensor([0, *cuts, B * T], dtype=torch.int32, device="cuda")
        x = reference.make_inputs(1, B * T, H, beta_dtype=beta_dtype, cu_seqlens=cu, device="cuda")
    else:
        x = reference.make_inputs(B, T, H, beta_dtype=beta_dtype, device="cuda")
    args = (x["q"], x["k"], x["v"], x["gk"], x["beta"])
    scale = x["q"].shape[-1] ** -0.5

    def ours():
        return kdajit.forward(*args, scale, cu_seqlens=cu)

    result = {"B": B, "T": T, "H": H, "K": 128, "V": 128, "beta": beta, "varlen": varlen,
              "gpu": torch.cuda.get_device_name()}
    result["kdajit_ms"] = bench(ours)
    try:
        from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra as fla_intra

        def theirs():
            return fla_intra(*args, scale, cu_seqlens=cu, safe_gate=True)

        result["fla_ms"] = bench(theirs)
        result["fla_over_kdajit"] = result["fla_ms"] / result["kdajit_ms"]
    except ImportError:
        result["fla_ms"] = None
    nbytes = minimal_bytes(B, T, H, 128, 128, 64, beta_dtype.itemsize)
    result["min_bytes"] = nbytes
    result["floor_ms"] = nbytes / (HBM_TBPS * 1e12) * 1e3
    result["kdajit_TBps"] = nbytes / (result["kdajit_ms"] * 1e-3) / 1e12
    result["kernels"] = kernel_breakdown(ours)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--B", type=int, default=2)
    parser.add_argument("--T", type=int, default=8192)
    parser.add_argument("--H", type=int, default=64)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_forward needs a CUDA GPU")
        return 1
    results = []
    for beta, varlen in (("bf16", False), ("fp32", False), ("bf16", True)):
        r = run_case(args.B, args.T, args.H, beta, varlen)
        results.append(r)
        fla = f"{r['fla_ms']:.3f} ms" if r["fla_ms"] else "n/a"
        ratio = f"{r['fla_over_kdajit']:.2f}x" if r["fla_ms"] else "n/a"
        print(f"B={r['B']} T={r['T']} H={r['H']} beta={beta} {'varlen(8)' if varlen else 'dense'}: "
              f"kdajit {r['kdajit_ms']:.3f} ms, FLA {fla}, FLA/kdajit {ratio}, "
              f"{r['kdajit_TBps']:.2f} TB/s effective (floor {r['floor_ms']:.3f} ms)")
        for name, ms in r["kernels"][:8]:
            print(f"    {ms:8.3f} ms  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
