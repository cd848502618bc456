"""`python -m kdajit demo`: run `forward` once and check it against the fp64 reference.

With a CUDA GPU it runs a small varlen problem and prints each output's relative error. Without one it
cross-compiles the kernels for sm_90a into the cache (a CPU build machine's job) and says what it would run.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from kdajit import api, cache, compiler
from kdajit.keys import ForwardSpec

# Loose bounds: bf16 outputs give ~2e-3; a wrong kernel gives O(1).
_MAX_REL_ERROR = 2e-2


def _run_on_gpu(args: argparse.Namespace) -> int:
    from kdajit import reference

    lengths = [int(x) for x in args.lengths.split(",")]
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    beta_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.beta]
    x = reference.make_inputs(1, sum(lengths), args.heads, beta_dtype=beta_dtype, cu_seqlens=cu, device="cuda")
    t0 = time.perf_counter()
    out = api.forward(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, output_qg=True)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    api.forward(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, output_qg=True)
    torch.cuda.synchronize()
    second_s = time.perf_counter() - t0
    ref = reference.forward_reference(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, output_qg=True)
    print(f"kdajit.forward on {torch.cuda.get_device_name()} ({compiler.current_arch()}), "
          f"{len(lengths)} sequences {lengths}, H={args.heads}, K=V=128, beta {args.beta}")
    print(f"first call {first_s * 1e3:.1f} ms (compile or cache load), second call {second_s * 1e3:.2f} ms")
    ok = True
    for name in ("Aqk", "Akk", "w", "u", "kg", "qg"):
        err = reference.relative_error(getattr(out, name), getattr(ref, name))
        good = err < _MAX_REL_ERROR
        ok &= good
        print(f"  {name:4s} relative error vs fp64 reference: {err:.2e} {'ok' if good else 'FAIL'}")
    print(f"cache: {cache.stats()}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def _compile_only(args: argparse.Namespace) -> int:
    arch = compiler.current_arch()
    spec = ForwardSpec(args.beta, "cu32", 128, 128, 64, True, arch)
    t0 = time.perf_counter()
    for key in spec.kernel_keys():
        cache.get_kernel(key)
    print(f"No CUDA GPU here: compiled (or found in the cache) the {len(spec.kernel_keys())} kernels of {spec} "
          f"in {time.perf_counter() - t0:.1f} s; cache root {cache.cache_root()}; {cache.stats()}")
    print(f"On a GPU, this demo runs kdajit.forward on packed sequences {args.lengths} with H={args.heads} and "
          f"checks every output against the fp64 reference (relative error < {_MAX_REL_ERROR}).")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kdajit demo`; returns the exit code."""
    parser = argparse.ArgumentParser(prog="kdajit demo", description=__doc__)
    parser.add_argument("--lengths", default="1,63,64,65,127,700", help="comma-separated sequence lengths")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--beta", choices=("bf16", "fp32"), default="bf16")
    args = parser.parse_args(argv)
    return _run_on_gpu(args) if torch.cuda.is_available() else _compile_only(args)


if __name__ == "__main__":
    sys.exit(main())
