"""Host-side costs of kdajit: first call with a warm disk cache, and per-call launch overhead.

    KDAJIT_CACHE_DIR=<warm cache> python benchmarks/bench_host.py [--profile]

Run it in a fresh process: it reports `import kdajit`, the one-time CuTe DSL import, and the first
`forward` call (disk load of three kernels, no compile), then the steady-state host time per call on a
tiny problem (the GPU work is negligible there, so calls/second measures host overhead). With
KDAJIT_LOADER=linked the DSL import is left out and the first call includes the TVM-FFI load.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

t_start = time.perf_counter()
import torch  # noqa: E402

t_torch = time.perf_counter()
import kdajit  # noqa: E402
from kdajit import api, cache, compiler, env, linked_loader, reference, validate  # noqa: E402
from kdajit.keys import ForwardSpec  # noqa: E402

t_kdajit = time.perf_counter()


def per_call_us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def itemised_us(args: tuple) -> dict[str, float]:
    """Per-call host time of each step of a steady-state dense `forward` (issue 12's itemisation), each timed alone in
    a loop of its own: validation, the kernels' lookup, the output allocations, the launch (its arguments' conversion
    by TVM-FFI included; on the standalone route also the fp32 L workspace the intra kernel writes), and the whole
    call."""
    q, k, v, gk, beta = args
    problem = validate.check_forward_inputs(q, k, v, gk, beta, None, 64, {})
    device_index = api._device_index(q)

    def lookup():
        return api._kernels(problem, 64, False, device_index, intra=True, recompute=True, seqs=problem.batch)

    def allocate():
        return api._intra_outputs(None, problem, q) + api._recompute_outputs(None, gk, v, q, False)

    kernels, outputs, cu = lookup(), allocate(), api._cu_seqlens_arg(None, q.device)
    scale = problem.head_k ** -0.5

    def launch():
        if kernels.fused is not None:
            api._run_fused(q, k, v, gk, beta, scale, cu, kernels, *outputs)
        else:
            api._run_intra(q, k, gk, beta, scale, cu, kernels, *outputs[:2])
            api._run_recompute(k, v, beta, outputs[1], gk, None, cu, kernels, *outputs[2:])

    items = {"validation": per_call_us(lambda: validate.check_forward_inputs(q, k, v, gk, beta, None, 64, {})),
             "kernel lookup": per_call_us(lookup),
             f"output allocation ({sum(t is not None for t in outputs)} tensors)": per_call_us(allocate),
             f"launch ({'fused' if kernels.fused is not None else 'standalone'})": per_call_us(launch)}
    items["sum of the steps"] = sum(items.values())
    items["whole forward call"] = per_call_us(lambda: kdajit.forward(*args))
    return items


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_host needs a CUDA GPU")
        return 1
    x = reference.make_inputs(1, 128, 2, device="cuda")
    args = (x["q"], x["k"], x["v"], x["gk"], x["beta"])
    torch.cuda.synchronize()
    linked = linked_loader.uses_linked(env.object_loader())
    t0 = time.perf_counter()
    if not linked:
        compiler._cute()  # the CuTe DSL + TVM-FFI import, paid once per process
    t_dsl = time.perf_counter() - t0
    profiler = cProfile.Profile() if "--profile" in sys.argv else None
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    kdajit.forward(*args)
    torch.cuda.synchronize()
    t_first = time.perf_counter() - t0
    if profiler:
        profiler.disable()
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    stats = cache.stats()
    dsl = "not imported (linked loader)" if linked else f"{t_dsl * 1e3:.0f} ms"
    print(f"import torch {(t_torch - t_start) * 1e3:.0f} ms, import kdajit {(t_kdajit - t_torch) * 1e3:.0f} ms, "
          f"CuTe DSL import {dsl}")
    print(f"first forward (warm disk cache, loader {env.object_loader()}): {t_first * 1e3:.1f} ms; "
          f"cutlass imported: {'cutlass' in sys.modules}; compiles={stats['compiles']} "
          f"disk_hits={stats['disk_hits']}")
    cu = torch.tensor([0, 50, 128], dtype=torch.int32, device="cuda")
    kdajit.forward(*args, cu_seqlens=cu)  # load the varlen kernels outside the timing
    print(f"host time per forward call, dense: {per_call_us(lambda: kdajit.forward(*args)):.1f} us")
    print("itemised, dense (us per call): " + ", ".join(f"{name} {us:.1f}" for name, us in itemised_us(args).items()))
    op_call = lambda: torch.ops.kdajit.forward(*args, 128 ** -0.5, None, 64, False)  # noqa: E731
    print(f"host time per call of the custom op kdajit::forward (what a torch.compile graph calls), dense: "
          f"{per_call_us(op_call):.1f} us")
    if profiler:
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(2000):
            kdajit.forward(*args)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    print(f"host time per forward call, varlen (cu_seqlens values checked, one D2H copy): "
          f"{per_call_us(lambda: kdajit.forward(*args, cu_seqlens=cu)):.1f} us")
    os.environ["KDAJIT_VALIDATE"] = "shapes"
    print(f"host time per forward call, varlen (KDAJIT_VALIDATE=shapes, no sync): "
          f"{per_call_us(lambda: kdajit.forward(*args, cu_seqlens=cu)):.1f} us")
    fn = cache.get_kernel(ForwardSpec("bf16", "dense", 128, 128, 64, False, compiler.current_arch()).inverse_key())
    L = torch.zeros(1, 128, 2, 64, device="cuda")
    Akk = torch.empty(1, 128, 2, 64, dtype=torch.bfloat16, device="cuda")
    dummy = torch.zeros(1, dtype=torch.int32, device="cuda")
    print(f"raw TVM-FFI launch of one kernel: {per_call_us(lambda: fn(L, Akk, dummy)):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
