"""Where the fused kernel's time goes: time variants of it that leave phases out.

    python benchmarks/fused_phases.py --export DIR [--chunk 32] [--gate any] [--kv 60] [--varlen]   # compile (no GPU)
    python benchmarks/fused_phases.py [--objects DIR] [--chunk 32] [--gate any] [--kv 60] [--varlen] [--json out.json]
    python benchmarks/fused_phases.py --objects DIR --sms 132 96 ...   # also on 96 SMs (a green context)
    ncu --profile-from-start off --clock-control none --set full -o OUT \
        python benchmarks/fused_phases.py --objects DIR --only tile-w8.all --profile    # one launch, under ncu

`--only CONFIG.VARIANT ...` restricts export, timing and profiling to those variants; without it, `--objects DIR`
times the variants DIR holds.

Each variant is the fused kernel (templates/fused_forward.py) of one configuration with a subset of
its phases: loads (q, k, g cp.async, v, beta), intra (Aqk, L), inverse (Akk), recompute (KG, W, U).
A variant without some phase computes garbage (it is a timing instrument, never cached and never
reachable from `kdajit.forward`); the differences between variants bound what each phase costs when
the others run beside it. Shape: B=2 T=8192 H=64, bf16 beta, output_qg=False (the main bench row), chunk 64
unless `--chunk 32`, the safe-gate path unless `--gate any` (safe_gate=False; its diagonal blocks cost more in the
rows of steep gates, so `--gate-scale S` times it on FLA's logsigmoid gates times S instead of the safe ones),
K = V = 128 unless `--kv` names another head size (the objects of a directory are of the size they were exported with);
with `--varlen` the cu32 kernels instead, timed on bench_forward's packed row (32 sequences of lengths uniform in
1..4096, seed 0, H=64).
Variants are compiled in this process unless `--objects` names a directory written by `--export`.
With `--sms N ...` each variant is timed on N SMs of the device (a green context, benchmarks/held_sms.py), and its time
is also printed scaled by N / (the device's SMs): on an H100, N = 96 estimates an H200's time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import held_sms
from kdajit.keys import FUSED_PROBE_CONFIGS

VARIANTS = {  # name: phases kept
    "loads": ("loads",),
    "loads+intra": ("loads", "intra"),
    "loads+intra+inverse": ("loads", "intra", "inverse"),
    "all": ("loads", "intra", "inverse", "recompute"),
    "compute-only": ("intra", "inverse", "recompute"),
    "intra+inverse": ("intra", "inverse"),
}
# Probes: exported and timed only where named (`--only`) or present in an `--objects` directory, so the default export
# (h200_precompile.sh) and the phases stage keep their size.
PROBE_VARIANTS = {  # each compute phase alone and in pairs (no loads): a decomposition of compute-only
    "intra": ("intra",),
    "inverse": ("inverse",),
    "recompute": ("recompute",),
    "intra+recompute": ("intra", "recompute"),
    "inverse+recompute": ("inverse", "recompute"),
}
CONFIGS = {"tile": dict(), "tile-w8": dict(warps=8),  # persistent: 8 warps, 4 and 8 warps with early loads
           "persistent-c2-head-w8": dict(persistent=True, ctas_per_sm=2, raster="head", warps=8),
           "persistent-c2-head-a1": dict(persistent=True, ctas_per_sm=2, raster="head", loads_ahead=1),
           "persistent-c2-head-a1-w8": dict(persistent=True, ctas_per_sm=2, raster="head", loads_ahead=1, warps=8),
           "persistent-c2-head-a1-ge": dict(persistent=True, ctas_per_sm=2, raster="head", loads_ahead=1,
                                            gate_rows="early"),
           "persistent-c2-head-a1-gv": dict(persistent=True, ctas_per_sm=2, raster="head", loads_ahead=1,
                                            gate_rows="early-vbuf"),
           "persistent-c2-head-a1-r1": dict(persistent=True, ctas_per_sm=2, raster="head", loads_ahead=1,
                                            intra_unroll=1)}
# Exported and timed only where named or present, as the probe variants: one or three CTAs per SM (against c2, how much
# of the time a second or third CTA's warps hide or share), and W and U stored by TMA (`FusedConfig.stores`)
PROBE_CONFIGS = {"persistent-c1-head-a1": dict(persistent=True, ctas_per_sm=1, raster="head", loads_ahead=1),
                 # three CTAs per SM: buildable where a CTA fits a third of the SM (K <= 64 here; K = 128 in a tree
                 # whose tiles share bytes, docs/performance.md's twenty-eighth session)
                 "persistent-c3-head-a1": dict(persistent=True, ctas_per_sm=3, raster="head", loads_ahead=1),
                 "persistent-c2-head-a1-ts": dict(persistent=True, ctas_per_sm=2, raster="head", loads_ahead=1,
                                                  stores="tma"),
                 "persistent-c2-head-a1-r1-ts": dict(persistent=True, ctas_per_sm=2, raster="head", loads_ahead=1,
                                                     intra_unroll=1, stores="tma"),
                 "persistent-c2-head-a1-gv-ts": dict(persistent=True, ctas_per_sm=2, raster="head", loads_ahead=1,
                                                     gate_rows="early-vbuf", stores="tma"),
                 "persistent-c2-head-a1-ge-ts": dict(persistent=True, ctas_per_sm=2, raster="head", loads_ahead=1,
                                                     gate_rows="early", stores="tma"),
                 "persistent-c2-head-a1-gv-r1": dict(persistent=True, ctas_per_sm=2, raster="head", loads_ahead=1,
                                                     gate_rows="early-vbuf", intra_unroll=1),
                 "persistent-c2-head-a1-ge-r1": dict(persistent=True, ctas_per_sm=2, raster="head", loads_ahead=1,
                                                     gate_rows="early", intra_unroll=1),
                 # the configurations outside the space (two tiles per CTA: `FusedConfig.pingpong`)
                 **{c.slug(): dataclasses.asdict(c) for c in FUSED_PROBE_CONFIGS}}
ALL_VARIANTS = {**VARIANTS, **PROBE_VARIANTS}
ALL_CONFIGS = {**CONFIGS, **PROBE_CONFIGS}


def variant_kernel(config_name: str, phases: tuple[str, ...], chunk: int, safe_gate: bool, kv: int,
                   varlen: bool = False):
    from kdajit.keys import ForwardSpec, FusedConfig
    from kdajit.templates.fused_forward import FusedForward

    spec = ForwardSpec("bf16", "cu32" if varlen else "dense", kv, kv, chunk, False, "sm_90a", safe_gate=safe_gate)
    key = spec.fused_key(FusedConfig(**ALL_CONFIGS[config_name]))
    kernel = FusedForward(key)
    kernel.phases = phases
    return key, kernel


def object_name(config_name: str, variant: str) -> str:
    """The file a variant is exported to and loaded from."""
    return f"{config_name}.{variant}.o"


def config_of(path: str):
    """The FusedConfig of an exported variant's file (`object_name`)."""
    from kdajit.keys import FusedConfig

    return FusedConfig(**ALL_CONFIGS[os.path.basename(path).split(".")[0]])


def max_ctas(config, sms: int) -> int:
    """The grid bound a variant's launch passes: SMs x CTAs per SM for a persistent configuration (as `forward`)."""
    return sms * config.ctas_per_sm if config.persistent else 1


def selected(only: list[str] | None, objects: str | None = None) -> list[tuple[str, str]]:
    """(config, variant) pairs to run: those named CONFIG.VARIANT in `only` (if None: CONFIGS x VARIANTS, and the
    probes too where `objects` is given) that the directory `objects` holds (when given; a named variant it lacks is
    reported and skipped, so one list serves directories of several head sizes)."""
    every = [(config_name, name) for config_name in ALL_CONFIGS for name in ALL_VARIANTS]
    if only:
        unknown = sorted(set(only) - {f"{c}.{n}" for c, n in every})
        if unknown:
            raise SystemExit(f"--only: unknown variant(s) {unknown}; expected CONFIG.VARIANT with CONFIG in "
                             f"{list(ALL_CONFIGS)} and VARIANT in {list(ALL_VARIANTS)}")
        pairs = [(c, n) for c, n in every if f"{c}.{n}" in only]
    else:
        pairs = every if objects else [(c, n) for c in CONFIGS for n in VARIANTS]
    if not objects:
        return pairs
    present = [p for p in pairs if os.path.exists(os.path.join(objects, object_name(*p)))]
    if only and len(present) < len(pairs):
        missing = [f"{c}.{n}" for c, n in pairs if (c, n) not in present]
        print(f"--only: not in {objects}, skipped: {missing}", flush=True)
    return present


def export(directory: str, chunk: int, only: list[str] | None, safe_gate: bool, kv: int, varlen: bool = False) -> None:
    from kdajit import compiler

    os.makedirs(directory, exist_ok=True)
    for config_name, name in selected(only):
        key, kernel = variant_kernel(config_name, ALL_VARIANTS[name], chunk, safe_gate, kv, varlen)
        if not kernel.can_implement(key):  # e.g. a persistent configuration at a size whose CTAs do not fit
            print(f"{config_name} {name}: not buildable at this size, skipped", flush=True)
            continue
        compiled = compiler.compile_template(kernel, key.arch)
        compiler.export_object(compiled, os.path.join(directory, object_name(config_name, name)))
        print(f"{config_name} {name}: compiled in {compiled.kdajit_compile_s:.1f} s", flush=True)


def time_variants(objects: str | None, chunk: int, only: list[str] | None, profile: bool,
                  safe_gate: bool, kv: int, gate_scale: float | None = None, varlen: bool = False,
                  sm_counts: list[int] | None = None) -> list[dict]:
    """Median times of the selected variants (with `sm_counts`, on each of those numbers of SMs); with `profile`,
    instead one launch of each between cudaProfilerStart and cudaProfilerStop (for `ncu --profile-from-start off`),
    after a warm-up."""
    import torch
    import triton.testing

    from kdajit import api, compiler, reference
    from kdajit.keys import FusedConfig, FusedForwardKey

    B, T, H = 2, 8192, 64
    cu = torch.zeros(1, dtype=torch.int32, device="cuda")  # a dummy the dense kernels never read
    if varlen:
        from bench_forward import packed_cu_seqlens, packed_lengths

        lengths = packed_lengths()
        B, T = 1, sum(lengths)
        cu = packed_cu_seqlens(lengths)
    x = reference.make_inputs(B, T, H, kv, kv, beta_dtype=torch.bfloat16, device="cuda", chunk_size=chunk,
                              gate_scale=gate_scale, cu_seqlens=cu if varlen else None)
    empty = lambda d: torch.empty(B, T, H, d, dtype=torch.bfloat16, device="cuda")
    outs = (empty(chunk), empty(chunk), empty(kv), empty(kv), empty(kv))
    qg = torch.zeros(1, 1, 1, kv, dtype=torch.bfloat16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    inputs = {n: x[n] for n in ("q", "k", "v", "gk", "beta")}
    results = []
    for config_name, name in selected(only, objects):
        phases = ALL_VARIANTS[name]
        if objects:
            fn = compiler.load_object(os.path.join(objects, object_name(config_name, name)))
        else:
            key, kernel = variant_kernel(config_name, phases, chunk, safe_gate, kv, varlen)
            fn = compiler.callable_of(compiler.compile_template(kernel, key.arch))
        config = FusedConfig(**ALL_CONFIGS[config_name])
        call_on = lambda on_sms: lambda: api._launch(fn, FusedForwardKey, **inputs, Aqk=outs[0], Akk=outs[1],
                                                     w=outs[2], u=outs[3], kg=outs[4], qg=qg, cu_seqlens=cu,
                                                     scale=kv ** -0.5, max_ctas=max_ctas(config, on_sms))
        call = call_on(sms)
        row = {"config": config_name, "variant": name, "phases": list(phases), "chunk": chunk, "safe_gate": safe_gate,
               "kv": kv, "gate_scale": gate_scale, "varlen": varlen}
        if sm_counts:
            for n in sm_counts:
                ms = held_sms.median_ms_on_sms(call_on(n), n, sms)
                results.append({**row, "sms": n, "device_sms": sms, "ms": ms, "ms_scaled": ms * n / sms})
                print(f"| {config_name} | {name} | {n} | {ms:.3f} | {ms * n / sms:.3f} |", flush=True)
            continue
        if profile:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            call()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"profiled {config_name}.{name}", flush=True)
            continue
        ms = triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median")
        results.append({**row, "ms": ms})
        print(f"| {config_name} | {name} | {ms:.3f} |", flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--export", metavar="DIR", help="compile every variant to object files in DIR and exit")
    parser.add_argument("--objects", metavar="DIR", help="load the variants from DIR instead of compiling")
    parser.add_argument("--chunk", type=int, choices=(32, 64), default=64, help="chunk size (default 64)")
    parser.add_argument("--gate", choices=("safe", "any"), default="safe",
                        help="the safe-gate path (default) or the any-gate path (safe_gate=False)")
    parser.add_argument("--gate-scale", type=float, default=None,
                        help="time on FLA's logsigmoid gates times this (default: the safe gates)")
    parser.add_argument("--kv", type=int, default=128, help="head size K = V (default 128)")
    parser.add_argument("--varlen", action="store_true",
                        help="the cu32 kernels, timed on bench_forward's packed row (32 sequences, H=64)")
    parser.add_argument("--json", help="write the timings here")
    parser.add_argument("--only", nargs="+", metavar="CONFIG.VARIANT", help="only these variants (e.g. tile-w8.all)")
    parser.add_argument("--sms", type=int, nargs="+", metavar="N",
                        help="time each variant on N SMs, a green context (benchmarks/held_sms.py)")
    parser.add_argument("--profile", action="store_true",
                        help="launch each variant once between cudaProfilerStart/Stop (for ncu) instead of timing")
    args = parser.parse_args(argv)
    if args.export:
        export(args.export, args.chunk, args.only, args.gate == "safe", args.kv, args.varlen)
        return 0
    if args.profile and (args.json or args.sms):
        parser.error("--json, --sms: nothing is timed with --profile")
    if args.sms:
        print("| config | phases kept | SMs | ms | ms x SMs / device SMs |\n|---|---|---|---|---|")
    elif not args.profile:
        print("| config | phases kept | ms |\n|---|---|---|")
    results = time_variants(args.objects, args.chunk, args.only, args.profile, args.gate == "safe", args.kv,
                            args.gate_scale, args.varlen, args.sms)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
