"""GPU: kernels precompiled without a GPU load from the cache and give the bits of kernels compiled on the GPU.

The precompiled cache is `$KDAJIT_TEST_CPU_CACHE` when set (a cache built on the CPU machine with
`kdajit precompile --arch sm_90a` and carried over); otherwise the test builds one here in a GPU-blind
process (CUDA_VISIBLE_DEVICES="", CUTE_DSL_ARCH=sm_90a). Two fresh processes then run the same inputs:
one may only load (KDAJIT_DISABLE_JIT=1), the other compiles into an empty cache on the GPU. A third
loads every kernel through KDAJIT_LOADER=linked (each object linked into its own shared library and
loaded by TVM-FFI, the CuTe DSL never imported), twelve such libraries in one process.
"""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Both routes of `forward` (the fused kernel where the arch has one, and the three standalone kernels) in
# every varlen mode: every kernel a precompiled bf16-beta, QG-on cache holds for this arch.
RUNNER = textwrap.dedent("""
    import json, os, sys, torch, kdajit
    from kdajit import cache
    x = torch.load(sys.argv[1])
    outs = {}
    for route in ("auto", "standalone"):
        os.environ["KDAJIT_FORWARD_ROUTE"] = route
        for name, cu in (("dense", None), ("cu32", x["cu"]), ("cu64", x["cu"].long())):
            args = x["dense"] if cu is None else x["packed"]
            out = kdajit.forward(*args, cu_seqlens=cu, output_qg=True)
            outs[f"{route}-{name}"] = [t.cpu() for t in out]
    torch.save(outs, sys.argv[2])
    print(json.dumps({**cache.stats(), "cutlass_imported": "cutlass" in sys.modules}))
""")


def kernels_the_runner_uses() -> int:
    from kdajit import compiler
    from kdajit.keys import VARLEN_MODES, ForwardSpec

    specs = [ForwardSpec("bf16", m, 128, 128, 64, True, compiler.current_arch()) for m in VARLEN_MODES]
    return len({key for spec in specs for key in spec.kernel_keys()})


def run_in_fresh_process(tmp_path, cache_dir, inputs, tag, **extra_env):
    env = dict(os.environ, KDAJIT_CACHE_DIR=str(cache_dir), **extra_env)
    out_path = tmp_path / f"{tag}.pt"
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(inputs), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out_path), json.loads(proc.stdout.strip().splitlines()[-1])


def precompiled_cache(tmp_path):
    source = os.environ.get("KDAJIT_TEST_CPU_CACHE")
    target = tmp_path / "precompiled"
    if source:
        shutil.copytree(source, target)
        return target
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", CUTE_DSL_ARCH="sm_90a", KDAJIT_CACHE_DIR=str(target))
    proc = subprocess.run([sys.executable, "-m", "kdajit", "precompile", "--arch", "sm_90a", "--beta", "bf16",
                           "--io", "bf16", "--kv", "128", "--varlen", "dense,cu32,cu64", "--qg", "on",
                           "--no-progress"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return target


def test_precompiled_objects_load_without_compiling_and_match(tmp_path):
    from kdajit import reference

    lengths = [1, 63, 64, 65, 127, 300]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).cuda()
    packed = reference.make_inputs(1, sum(lengths), 4, cu_seqlens=cu, device="cuda")
    dense = reference.make_inputs(2, 200, 4, device="cuda")
    names = ("q", "k", "v", "gk", "beta")
    inputs = tmp_path / "inputs.pt"
    torch.save({"dense": [dense[n] for n in names], "packed": [packed[n] for n in names], "cu": cu}, inputs)

    precompiled = precompiled_cache(tmp_path)
    loaded, load_stats = run_in_fresh_process(tmp_path, precompiled, inputs, "loaded", KDAJIT_DISABLE_JIT="1")
    expected = kernels_the_runner_uses()  # 12 on sm_90a: 3 fused + 3 intra + 3 inverse + 3 recompute
    assert (load_stats["compiles"], load_stats["disk_hits"]) == (0, expected), load_stats
    compiled, compile_stats = run_in_fresh_process(tmp_path, tmp_path / "fresh", inputs, "compiled")
    assert compile_stats["compiles"] == expected, compile_stats
    linked, linked_stats = run_in_fresh_process(tmp_path, precompiled, inputs, "linked", KDAJIT_DISABLE_JIT="1",
                                                KDAJIT_LOADER="linked")
    assert (linked_stats["compiles"], linked_stats["disk_hits"]) == (0, expected), linked_stats
    assert linked_stats["cutlass_imported"] is False, "KDAJIT_LOADER=linked imported the CuTe DSL"
    assert set(loaded) == set(compiled) == set(linked) and len(loaded) == 6
    for mode in loaded:
        for i, (a, b, c) in enumerate(zip(loaded[mode], compiled[mode], linked[mode])):
            assert a.shape == b.shape
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{mode}: output {i} differs"
            assert torch.equal(c.view(torch.int16), b.view(torch.int16)), f"{mode}: output {i} differs (linked)"
            assert not torch.isnan(a.float()).any()
