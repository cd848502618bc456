"""Registers, spills and stack of every kernel of one specialization, from ptxas (CPU, no GPU needed).

    python benchmarks/ptxas_report.py [--beta bf16] [--varlen dense] [--qg] [--io bf16] [--kv 128] [--reference-only]

Compiles each kernel key (the standalone kernels and every fused configuration that fits) for sm_90a with CuTe DSL's
`remarks{ptx}` option, which prints ptxas's resource usage, and writes a markdown table: registers per thread,
spill stores/loads, stack, and the CTAs per SM that the registers alone allow (65,536 per SM, allocated per
warp in units of 256). Numbers: docs/performance.md, "Registers".
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

REGS_PER_SM = 65_536


def ptxas_usage(compiler, key) -> dict:
    """ptxas's resource line for one key's kernel: compiled with remarks{ptx}, the process's stdout and
    stderr (where the DSL prints the remarks) sent to a temporary file meanwhile."""
    cute = compiler._cute()
    kernel = compiler.template_class(key)(key)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            cute.compile(kernel, *kernel.fake_args(), options=f"--enable-tvm-ffi --gpu-arch {key.arch} remarks{{ptx}}")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
        log.seek(0)
        text = log.read().decode(errors="replace")
    usage = {}
    for name, pattern in (("registers", r"Used (\d+) registers"), ("stack", r"(\d+) bytes stack frame"),
                          ("spill_stores", r"(\d+) bytes spill stores"), ("spill_loads", r"(\d+) bytes spill loads")):
        found = re.search(pattern, text)
        usage[name] = int(found.group(1)) if found else None
    return usage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--beta", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--varlen", default="dense", choices=("dense", "cu32", "cu64"))
    parser.add_argument("--qg", action="store_true", help="the output_qg specialization")
    parser.add_argument("--io", default="bf16", choices=("bf16", "fp16"), help="q/k/v dtype")
    parser.add_argument("--kv", type=int, default=128, choices=(64, 128, 256), help="head size K = V")
    parser.add_argument("--reference-only", action="store_true", help="only the fused reference configuration")
    args = parser.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from kdajit import compiler, tuner
    from kdajit.keys import ForwardSpec

    spec = ForwardSpec(args.beta, args.varlen, args.kv, args.kv, 64, args.qg, "sm_90a", args.io)
    configs = tuner.candidates(spec)[0][:1 if args.reference_only else None]
    keys = [spec.intra_key(), spec.inverse_key(), spec.recompute_key()] + [spec.fused_key(c) for c in configs]
    print("| kernel | config | registers | spill stores / loads (B) | stack (B) | CTAs per SM by registers |")
    print("|---|---|---|---|---|---|", flush=True)
    for key in keys:
        u = ptxas_usage(compiler, key)
        threads = 128
        per_warp = -(-u["registers"] * 32 // 256) * 256 if u["registers"] else None
        ctas = REGS_PER_SM // (per_warp * threads // 32) if per_warp else "?"
        print(f"| {key.TEMPLATE} | {key.config.slug()} | {u['registers']} | {u['spill_stores']} / {u['spill_loads']} | "
              f"{u['stack']} | {ctas} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
