"""Time kdajit.forward (fused and standalone routes) against FLA's chunk_kda_fwd_intra in the same process.

    python benchmarks/bench_forward.py [--rows all|main|coverage|ROW,ROW...] [--configs [SLUG,...]] [--json out.json]
                                       [--plot out.png] [--sms N]

Rows (K = V = 128, bf16 q/k/v, chunk 64, output_qg=False, FLA with safe_gate=True; with `--gate any`, FLA's
logsigmoid gates, times `--gate-scale`, and safe_gate=False on both sides): B=2 T=8192 H=64 with bf16 and fp32 beta;
32 packed sequences of lengths uniform in 1..4096 (seed 0), H=64; B=1 T=8192 H=32; B=8 T=2048 H=32; B=1 T=65536 H=8.
The coverage rows (`--rows coverage`, not in `all`): B=2 T=8192 H=64 with fp16 q/k/v and beta, with K = V = 64 and
256 (bf16), with the padded sizes K = V = 60 and 100 (bf16), with grouped value heads (q, k with 16 heads, v, gk,
beta and the outputs with 64), and with chunk_size 32. Every input set is larger than the H200's 50 MB L2, so one
set is timed without rotation. Per row: median time (triton.testing.do_bench: warm-up, then the median of >= 20
timed runs) of FLA, `forward` as a user calls it (no tuning record: the spec's untuned configuration of the fused
kernel, or the standalone kernels where `forward` runs those), and the standalone route (intra + inverse +
recompute), the ratio FLA / forward, the fraction of the HBM floor (minimal traffic: each input read once, each
output written once, at the measured copy rate), and a per-kernel breakdown from the torch profiler. `--configs`
also times every fused configuration that fits the row (or the ones named, e.g. `--configs tile,tile-w8`). Prints a
markdown table.

`--sms N` runs everything (the copy rate, FLA, kdajit's persistent grids sized for N SMs) on N of the device's SMs (a
green context, benchmarks/held_sms.py), and reports each time scaled by N / (the device's SMs) and the copy rate by the
inverse: an estimate for a card of as many SMs at that copy rate per SM (on an H100, N = 96: an H200). The per-kernel
breakdown is left out there.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

import held_sms
from kdajit import api, compiler, reference, tuner
from kdajit.keys import ForwardSpec, FusedConfig
from kdajit.outputs import BETA_TORCH_DTYPES, IO_TORCH_DTYPES

# name: (B, T, H, beta, number of packed sequences or 0 for dense, q/k/v dtype, K = V, group, chunk size); H counts
# the value heads (v, gk, beta, the outputs), q and k have H // group (grouped value heads when group > 1).
ROWS = {
    "B2-T8192-H64-bf16": (2, 8192, 64, "bf16", 0, "bf16", 128, 1, 64),
    "B2-T8192-H64-fp32": (2, 8192, 64, "fp32", 0, "bf16", 128, 1, 64),
    "varlen32-H64": (1, None, 64, "bf16", 32, "bf16", 128, 1, 64),
    "B1-T8192-H32": (1, 8192, 32, "bf16", 0, "bf16", 128, 1, 64),
    "B8-T2048-H32": (8, 2048, 32, "bf16", 0, "bf16", 128, 1, 64),
    "B1-T65536-H8": (1, 65536, 8, "bf16", 0, "bf16", 128, 1, 64),
    "B2-T8192-H64-fp16": (2, 8192, 64, "fp16", 0, "fp16", 128, 1, 64),
    "B2-T8192-H64-K64": (2, 8192, 64, "bf16", 0, "bf16", 64, 1, 64),
    "B2-T8192-H64-K256": (2, 8192, 64, "bf16", 0, "bf16", 256, 1, 64),
    "B2-T8192-H16-HV64": (2, 8192, 64, "bf16", 0, "bf16", 128, 4, 64),
    "B2-T8192-H64-C32": (2, 8192, 64, "bf16", 0, "bf16", 128, 1, 32),
    "B2-T8192-H64-K60": (2, 8192, 64, "bf16", 0, "bf16", 60, 1, 64),
    "B2-T8192-H64-K100": (2, 8192, 64, "bf16", 0, "bf16", 100, 1, 64),
}
MAIN_ROWS = ("B2-T8192-H64-bf16", "B2-T8192-H64-fp32")
COVERAGE_ROWS = ("B2-T8192-H64-fp16", "B2-T8192-H64-K64", "B2-T8192-H64-K256", "B2-T8192-H16-HV64", "B2-T8192-H64-C32",
                 "B2-T8192-H64-K60", "B2-T8192-H64-K100")


def minimal_bytes(tokens: int, H: int, K: int, V: int, chunk: int, beta_bytes: int, group: int = 1) -> int:
    inputs = tokens * (H // group) * 2 * K * 2 + tokens * H * (V * 2 + K * 4 + beta_bytes)  # q, k; v, gk, beta
    outputs = tokens * H * (2 * chunk * 2 + 2 * K * 2 + V * 2)  # Aqk, Akk; w, kg; u
    return inputs + outputs


# `--sms N`: (N, the device's SMs) while everything runs on N SMs (`use_sms`), else None
ON_SMS: tuple[int, int] | None = None


def use_sms(sms: int) -> None:
    """Run this process's timings on `sms` SMs, scaled to the device's SM count (`--sms`); forward's persistent grids
    are sized for `sms` SMs."""
    global ON_SMS
    device_sms = torch.cuda.get_device_properties(0).multi_processor_count
    if not 0 < sms <= device_sms:
        raise SystemExit(f"--sms {sms}: expected 1 .. {device_sms} (this device's SMs)")
    ON_SMS = (sms, device_sms)
    api._sm_count = lambda device_index: sms


def bench(fn) -> float:
    """Median ms of `fn` (with `--sms`: on those SMs, scaled to the device's SM count)."""
    import triton.testing

    if ON_SMS:
        sms, device_sms = ON_SMS
        return held_sms.median_ms_on_sms(fn, sms, device_sms) * sms / device_sms
    return triton.testing.do_bench(fn, warmup=100, rep=500, return_mode="median")


def copy_tbps() -> float:
    """This GPU's copy rate, the floor's rate (`held_sms.copy_rate_tbps` timed by `bench`), in TB/s (4.18 on the H200,
    about 3.0 on the H100)."""
    return held_sms.copy_rate_tbps(bench)


def kernel_breakdown(fn) -> list[tuple[str, float]]:
    """CUDA time per kernel name (ms per call), from the torch profiler over 10 calls (none with `--sms`)."""
    from torch.profiler import ProfilerActivity, profile

    if ON_SMS:
        return []
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


def packed_lengths(sequences: int = 32, seed: int = 0) -> list[int]:
    """The packed rows' sequence lengths: uniform in 1..4096 from a seeded CPU generator."""
    return torch.randint(1, 4097, (sequences,), generator=torch.Generator().manual_seed(seed)).tolist()


def packed_cu_seqlens(lengths: list[int]) -> torch.Tensor:
    """int32 cu_seqlens of packed sequences of `lengths`, on the GPU."""
    return torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()


def make_row_inputs(B, T, H, beta, sequences, io="bf16", K=128, group=1, safe_gate=True, chunk=64, gate_scale=1.0):
    beta_dtype = BETA_TORCH_DTYPES[beta]
    cu = None
    if sequences:
        lengths = packed_lengths(sequences)
        cu = packed_cu_seqlens(lengths)
        B, T = 1, sum(lengths)
    x = reference.make_inputs(B, T, H // group, K, K, beta_dtype=beta_dtype, io_dtype=IO_TORCH_DTYPES[io],
                              cu_seqlens=cu, value_heads=H, device="cuda", gate_scale=None if safe_gate else gate_scale,
                              chunk_size=chunk)
    return x, cu, B * T


@contextlib.contextmanager
def standalone_route():
    """KDAJIT_FORWARD_ROUTE=standalone for the block (the variable is read per call), then as before."""
    before = os.environ.get("KDAJIT_FORWARD_ROUTE")
    os.environ["KDAJIT_FORWARD_ROUTE"] = "standalone"
    try:
        yield
    finally:
        if before is None:
            del os.environ["KDAJIT_FORWARD_ROUTE"]
        else:
            os.environ["KDAJIT_FORWARD_ROUTE"] = before


def run_row(name: str, configs: str | None, rate_tbps: float, safe_gate: bool = True, gate_scale: float = 1.0) -> dict:
    B, T, H, beta, sequences, io, K, group, chunk = ROWS[name]
    x, cu, tokens = make_row_inputs(B, T, H, beta, sequences, io, K, group, safe_gate, chunk, gate_scale)
    args = (x["q"], x["k"], x["v"], x["gk"], x["beta"], None, cu, chunk, False, safe_gate, None)

    def fused(config=FusedConfig()):
        return lambda: api._forward(*args, fused_config=config)

    def forward_route():  # what `forward` runs: the fused kernel untuned, or the standalone kernels
        return api._forward(*args)

    r = {"row": name, "B": B, "T": T, "H": H, "qk_heads": H // group, "K": K, "io": io, "tokens": tokens,
         "sequences": sequences, "safe_gate": safe_gate, "gate_scale": None if safe_gate else gate_scale,
         "chunk": chunk, "beta": beta, "gpu": torch.cuda.get_device_name(), "on_sms": ON_SMS}
    r["forward_ms"] = bench(forward_route)
    with standalone_route():
        r["standalone_ms"] = bench(forward_route)
        r["standalone_kernels"] = kernel_breakdown(forward_route)
    if configs:  # the configurations of the space that fit this specialization ("all" or the named ones)
        spec = ForwardSpec(beta, "cu32" if sequences else "dense", K, K, chunk, False, compiler.current_arch(), io,
                           safe_gate)
        wanted = [c for c in tuner.candidates(spec)[0] if configs == "all" or c.slug() in configs.split(",")]
        r["configs_ms"] = {c.slug(): bench(fused(c)) for c in wanted}
    try:
        from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra as fla_intra

        scale = x["q"].shape[-1] ** -0.5
        r["fla_ms"] = bench(lambda: fla_intra(x["q"], x["k"], x["v"], x["gk"], x["beta"], scale, cu_seqlens=cu,
                                              chunk_size=chunk, safe_gate=safe_gate))
    except ImportError:
        r["fla_ms"] = None
    nbytes = minimal_bytes(tokens, H, K, K, chunk, x["beta"].element_size(), group)
    r["copy_tbps"] = rate_tbps
    r["floor_ms"] = nbytes / (rate_tbps * 1e12) * 1e3
    r["forward_floor_fraction"] = r["floor_ms"] / r["forward_ms"]
    r["forward_kernels"] = kernel_breakdown(forward_route)
    return r


def markdown(results: list[dict]) -> str:
    lines = ["| shape | FLA ms | kdajit forward ms | FLA/forward | % of floor | standalone ms | floor ms |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        fla = f"{r['fla_ms']:.3f}" if r["fla_ms"] else "n/a"
        ratio = f"{r['fla_ms'] / r['forward_ms']:.2f}x" if r["fla_ms"] else "n/a"
        lines.append(f"| {r['row']} | {fla} | {r['forward_ms']:.3f} | {ratio} | {100 * r['forward_floor_fraction']:.0f}% "
                     f"| {r['standalone_ms']:.3f} | {r['floor_ms']:.3f} |")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(results, key=lambda r: r["tokens"] * r["H"])
    work = [r["tokens"] * r["H"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, field in (("FLA", "fla_ms"), ("kdajit forward", "forward_ms"), ("kdajit standalone", "standalone_ms"),
                         ("HBM floor", "floor_ms")):
        ax.plot(work, [r[field] or float("nan") for r in rows], "o-" if field != "floor_ms" else "k--", label=label)
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("tokens x heads"), ax.set_ylabel("ms"), ax.legend(), ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"KDA forward intra, K=V=128, {rows[0]['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="all",
                        help=f"all, main (the two B=2 T=8192 H=64 rows), coverage or comma-separated names of "
                             f"{list(ROWS)}")
    parser.add_argument("--configs", nargs="?", const="all", default=None, metavar="SLUG,...",
                        help="also time every fused configuration that fits (or the named ones)")
    parser.add_argument("--gate", choices=("safe", "any"), default="safe",
                        help="safe: lower-bound gates, safe_gate=True (default); any: FLA's logsigmoid test gates, "
                             "safe_gate=False for kdajit and FLA (FLA's token-parallel intra)")
    parser.add_argument("--gate-scale", type=float, default=1.0,
                        help="with --gate any: the logsigmoid gates' scale (default 1; FLA's tests also use 10 and "
                             "40; kdajit's any-gate path takes per-pair sums in the rows of steep gates)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="draw time against tokens x heads to this PNG (needs matplotlib)")
    parser.add_argument("--sms", type=int, metavar="N",
                        help="run on N SMs (a green context), times scaled to the device's SMs (an estimate for a "
                             "card with the same copy rate per SM; on an H100, 96: an H200)")
    args = parser.parse_args(argv)
    every = [n for n in ROWS if n not in COVERAGE_ROWS]
    names = {"all": every, "main": list(MAIN_ROWS), "coverage": list(COVERAGE_ROWS)}.get(args.rows) \
        or args.rows.split(",")
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        parser.error(f"--rows: unknown rows {unknown}; expected all, main, coverage or names of {list(ROWS)}")
    if not torch.cuda.is_available():
        print("bench_forward needs a CUDA GPU")
        return 1
    if args.sms:
        use_sms(args.sms)
    rate = copy_tbps()
    estimate = f" (estimated from {ON_SMS[0]} of its {ON_SMS[1]} SMs)" if ON_SMS else ""
    print(f"{torch.cuda.get_device_name()}: copy rate {rate:.2f} TB/s (the floor's rate){estimate}", flush=True)
    results = []
    for name in names:
        r = run_row(name, args.configs, rate, args.gate == "safe", args.gate_scale)
        results.append(r)
        print(f"{name}: forward {r['forward_ms']:.3f} ms, standalone {r['standalone_ms']:.3f} ms, FLA "
              f"{r['fla_ms'] or float('nan'):.3f} ms, floor {r['floor_ms']:.3f} ms", flush=True)
        for route in ("forward_kernels", "standalone_kernels"):
            for kernel, ms in r[route][:4]:
                print(f"    {route[:-8]:10} {ms:8.3f} ms  {kernel}")
        if args.configs:
            print("    configs: " + ", ".join(f"{k} {v:.3f}" for k, v in r["configs_ms"].items()))
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
