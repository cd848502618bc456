"""`python -m kdajit demo`: run `forward` once and check it against the fp64 reference.

With a CUDA GPU it runs a small varlen problem and prints each output's relative error. Without one it
cross-compiles the kernels for sm_90a into the cache (a CPU build machine's job) and says what it would run.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from kdajit import api, cache, compiler, env
from kdajit.keys import BETA_DTYPES, ForwardSpec
from kdajit.outputs import BETA_TORCH_DTYPES

# Loose bounds: bf16 outputs give ~2e-3; a wrong kernel gives O(1).
_MAX_REL_ERROR = 2e-2
ANY_GATE_SCALE = 10.0  # --gate any: FLA's steep test gates, logsigmoid(randn) x 10 (the safe path overflows on them)


def _lengths(text: str) -> list[int]:
    """--lengths: comma-separated sequence lengths >= 0, at least one token in all."""
    try:
        lengths = [int(word) for word in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1,63,700") \
            from None
    if min(lengths) < 0 or sum(lengths) == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: lengths must be >= 0 with at least one token in all")
    return lengths


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _run_on_gpu(args: argparse.Namespace, arch: str) -> int:
    from kdajit import reference

    lengths = args.lengths
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    safe_gate = args.gate == "safe"
    x = reference.make_inputs(1, sum(lengths), args.heads, beta_dtype=BETA_TORCH_DTYPES[args.beta], cu_seqlens=cu,
                              device="cuda", gate_scale=None if safe_gate else ANY_GATE_SCALE)
    t0 = time.perf_counter()
    out = api.forward(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, output_qg=True, safe_gate=safe_gate)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    api.forward(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, output_qg=True, safe_gate=safe_gate)
    torch.cuda.synchronize()
    second_s = time.perf_counter() - t0
    ref = reference.forward_reference(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu_seqlens=cu, output_qg=True)
    print(f"kdajit.forward on {torch.cuda.get_device_name()} ({arch}), "
          f"{len(lengths)} sequences {lengths}, H={args.heads}, K=V=128, beta {args.beta}, "
          f"{'safe gates (safe_gate=True)' if safe_gate else f'logsigmoid x {ANY_GATE_SCALE:g} gates (safe_gate=False)'}")
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


def _compile_only(args: argparse.Namespace, arch: str) -> int:
    spec = ForwardSpec(args.beta, "cu32", 128, 128, 64, True, arch, safe_gate=args.gate == "safe")
    t0 = time.perf_counter()
    for key in spec.kernel_keys():
        cache.get_kernel(key)
    print(f"No CUDA GPU here: compiled (or found in the cache) the {len(spec.kernel_keys())} kernels of {spec} "
          f"in {time.perf_counter() - t0:.1f} s; cache root {cache.cache_root()}; {cache.stats()}")
    print(f"On a GPU, this demo runs kdajit.forward on packed sequences {args.lengths} with H={args.heads} and "
          f"checks every output against the fp64 reference (relative error < {_MAX_REL_ERROR}). Without a GPU, "
          f"kdajit.reference.forward_reference computes the same outputs in fp64 on the CPU.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kdajit demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=_lengths, default="1,63,64,65,127,700", metavar="N,N,...",
                        help="comma-separated lengths of the packed sequences (default: %(default)s)")
    parser.add_argument("--heads", type=_positive_int, default=4, metavar="H",
                        help="number of heads H (default: %(default)s)")
    parser.add_argument("--beta", choices=BETA_DTYPES, default="bf16", help="dtype of beta (default: %(default)s)")
    parser.add_argument("--gate", choices=("safe", "any"), default="safe",
                        help="safe: lower-bound gates, safe_gate=True; any: logsigmoid x 10 gates, safe_gate=False "
                             "(default: %(default)s)")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="cache root (default: KDAJIT_CACHE_DIR, else the user cache dir)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of `kdajit demo`; returns the exit code (2: a usage or configuration error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.cache_dir:
        env.use_cache_dir(str(Path(args.cache_dir).expanduser().absolute()))
    try:
        arch = compiler.current_arch()
    except (ValueError, RuntimeError) as e:  # a bad KDAJIT_ARCH, or a GPU kdajit has no kernels for
        parser.exit(2, f"kdajit demo: error: {e}\n")
    return _run_on_gpu(args, arch) if torch.cuda.is_available() else _compile_only(args, arch)


if __name__ == "__main__":
    sys.exit(main())
