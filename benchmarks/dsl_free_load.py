"""Can a cached kernel run without importing the CuTe DSL? (issue 12's first-forward aim, <= 0.5 s)

    KDAJIT_CACHE_DIR=<warm cache> python benchmarks/dsl_free_load.py [--json out.json]

Run it in a fresh process. It loads the cached object of the reference fused kernel (bf16 beta, dense,
no QG) the way KDAJIT_LOADER=linked does (`kdajit.linked_loader.load`: linked into a shared library
by the system C compiler against the DSL's libcute_dsl_runtime and TVM-FFI's libtvm_ffi, loaded by
`tvm_ffi.load_module` alone) and launches it on NaN-poisoned outputs: the time from after `import torch`
and CUDA initialisation to the synchronised first result is what a DSL-free first `forward` costs. It
checks that `cutlass` was never imported, then runs `kdajit.forward` with the DSL's loader on the same
inputs and compares every output bit.
GPU only; `--help` works anywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("dsl_free_load needs a CUDA GPU")
        return 1
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    t_torch = time.perf_counter()
    import kdajit
    from kdajit import api, cache_layout, cache_toolchain, linked_loader, reference
    from kdajit.keys import ForwardSpec, FusedForwardKey

    key = ForwardSpec("bf16", "dense", 128, 128, 64, False, "sm_90a").fused_key()
    entry = cache_layout.cache_root() / cache_layout.entry_relpath(key, cache_toolchain.toolchain_fingerprint())
    cached = entry / cache_layout.ARTIFACT
    if not cached.is_file():
        print(f"no cached object {cached} (run `kdajit precompile` first)")
        return 1
    obj = os.path.join(tempfile.mkdtemp(), "kernel.o")
    shutil.copyfile(cached, obj)

    x = reference.make_inputs(2, 1000, 4, device="cuda", generator=torch.Generator().manual_seed(0))
    B, T, H, K = x["q"].shape
    nan = lambda last: torch.full((B, T, H, last), float("nan"), dtype=torch.bfloat16, device="cuda")  # noqa: E731
    outs = {"Aqk": nan(64), "Akk": nan(64), "w": nan(K), "u": nan(K), "kg": nan(K)}
    dummy = torch.zeros(1, dtype=torch.int32, device="cuda")
    qg_dummy = torch.zeros(1, 1, 1, K, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn = linked_loader.load(obj)
    t_loaded = time.perf_counter()
    api._launch(fn, FusedForwardKey, q=x["q"], k=x["k"], v=x["v"], gk=x["gk"], beta=x["beta"], qg=qg_dummy,
                cu_seqlens=dummy, scale=K ** -0.5, max_ctas=1, **outs)
    torch.cuda.synchronize()
    t_first = time.perf_counter()
    dsl_imported = "cutlass" in sys.modules

    os.environ.pop("KDAJIT_LOADER", None)
    ref = kdajit.forward(x["q"], x["k"], x["v"], x["gk"], x["beta"])
    torch.cuda.synchronize()
    equal = {name: bool(torch.equal(outs[name].view(torch.int16), getattr(ref, name).view(torch.int16)))
             for name in outs}
    result = {
        "object": str(cached),
        "process_start_to_torch_cuda_ready_s": round(t_torch - t_start, 3),
        "dsl_free_link_and_load_ms": round((t_loaded - t0) * 1e3, 2),
        "dsl_free_first_result_ms": round((t_first - t0) * 1e3, 2),
        "cutlass_imported_before_forward": dsl_imported,
        "bitwise_equal_to_forward": equal,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if all(equal.values()) and not dsl_imported else 1


if __name__ == "__main__":
    sys.exit(main())
