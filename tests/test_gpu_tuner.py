"""GPU: the tuner on the real kernels. Its guard rejects a planted order-changing candidate (the
reference kernel run with the head dimension reversed, so every k-loop of the intra products runs
backwards: the same mathematics, another rounding); a real tuning run guards and times every
configuration of the space, stores the record, and `forward` then runs the winner with the same bits.
Kernels come from the session's cache as a read-only layer (KDAJIT_CACHE_RO_DIRS); records go to a
fresh writable root.
"""
import dataclasses
import os

import pytest
import torch

import kdajit
from kdajit import api, cache, tune_guard, tune_records, tune_timing, tuner
from kdajit.keys import FUSED_CONFIG_SPACE, FusedConfig
from test_gpu_forward import assert_bitwise
from test_gpu_fused import _arch_has_fused

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not _arch_has_fused(), reason="this GPU's arch has no fused kernel")]

REF = FUSED_CONFIG_SPACE[0]
PLANTED = FusedConfig(True, 1, "head", 1)  # stands for the reversed-k candidate below
PERSISTENT = FusedConfig(True, 2, "chunk", 0)


@pytest.fixture
def tuning_cache(tmp_path, monkeypatch):
    session_cache = os.environ.get("KDAJIT_CACHE_DIR")
    monkeypatch.setenv("KDAJIT_CACHE_DIR", str(tmp_path / "records"))
    if session_cache:
        monkeypatch.setenv("KDAJIT_CACHE_RO_DIRS", session_cache)
    monkeypatch.delenv("KDAJIT_STRICT_BITWISE", raising=False)
    monkeypatch.setenv("KDAJIT_AUTOTUNE", "cached")
    tuner.clear()
    yield tmp_path / "records"
    tuner.clear()


def reversed_k_launcher(x, out):
    """The reference kernel on q, k, gk with the head dimension reversed; W, KG (and QG) flipped back."""
    flipped = dict(x, q=x["q"].flip(-1).contiguous(), k=x["k"].flip(-1).contiguous(), gk=x["gk"].flip(-1).contiguous())
    tmp = tune_guard.poisoned_outputs(flipped, out.qg is not None, out.Aqk.shape[-1])
    launch = api._fused_launcher(REF, flipped, tmp)

    def run():
        launch()
        for name in ("Aqk", "Akk", "u"):
            getattr(out, name).copy_(getattr(tmp, name))
        for name in ("w", "kg", "qg"):
            if getattr(out, name) is not None:
                getattr(out, name).copy_(getattr(tmp, name).flip(-1))
    return run


def planted_prepare(config, x, out):
    return reversed_k_launcher(x, out) if config == PLANTED else api._fused_launcher(config, x, out)


def planted_run(monkeypatch, shape, force=False):
    monkeypatch.setattr(tuner, "candidates", lambda spec: ([REF, PLANTED, PERSISTENT], []))
    spec = api._spec("bf16", "dense", 128, 128, 64, False, torch.cuda.current_device())
    key = tuner.tuning_key(spec, torch.cuda.current_device(), shape.total_tokens, shape.heads, shape.seqs)
    return tuner.tune(key, shape, planted_prepare, force=force)


def test_guard_rejects_a_planted_order_changing_candidate(tuning_cache, monkeypatch):
    shape = tuner.TuneShape(1, 1024, 4)
    with pytest.warns(tuner.KdajitTuningWarning, match=f"{PLANTED.slug()}.*tuning-inputs-0: (Aqk|Akk)"):
        record = planted_run(monkeypatch, shape)
    planted = record.result(PLANTED)
    assert planted.guard == "mismatch" and planted.ms is None, planted
    assert record.result(REF).guard == record.result(PERSISTENT).guard == "ok"
    assert record.result(REF).ms > 0 and record.result(PERSISTENT).ms > 0
    assert record.winner in (REF, PERSISTENT)
    monkeypatch.setenv("KDAJIT_STRICT_BITWISE", "1")
    with pytest.raises(tuner.BitwiseMismatch, match=PLANTED.slug()):
        planted_run(monkeypatch, shape, force=True)  # force: the stored mismatch is not a guard run


@pytest.mark.parametrize("workload", ["dense", "varlen"])
def test_tuning_run_guards_times_stores_and_forward_runs_the_winner(tuning_cache, workload, monkeypatch):
    if workload == "dense":
        x = kdajit.reference.make_inputs(2, 2048, 8, device="cuda")
        cu, record = None, kdajit.tune(2, 2048, 8)
    else:
        lengths = (1, 63, 65, 2000, 7)
        cu = torch.tensor((0,) + lengths, device="cuda").cumsum(0).to(torch.int64)
        x = kdajit.reference.make_inputs(1, sum(lengths), 8, cu_seqlens=cu, device="cuda")
        record = kdajit.tune(1, sum(lengths), 8, varlen="cu64", lengths=lengths)
    assert [c.config for c in record.candidates] == list(FUSED_CONFIG_SPACE)
    assert all(c.guard == "ok" and c.ms > 0 for c in record.candidates), record.to_json()
    times = {c.config: c.ms for c in record.candidates}
    assert record.winner == tune_timing.choose(list(FUSED_CONFIG_SPACE), times)
    print(f"\n{workload}: winner {record.winner.slug()}, {record.speedup:.3f}x the reference; "
          + ", ".join(f"{c.slug()} {ms:.4f} ms" for c, ms in times.items()))
    relpath = tune_records.record_relpath(record.key, record.toolchain)
    assert (tuning_cache / relpath).is_file()
    # Store a record whose winner is another guarded configuration, neither the measured winner nor the
    # untuned one, so that `forward` provably runs the record's kernel below.
    untuned = record.key.spec.untuned_fused_config
    winner = next(c for c in FUSED_CONFIG_SPACE if c not in (record.winner, untuned))
    tune_records.write_record(tuning_cache, dataclasses.replace(record, winner=winner))
    tuner.clear()  # as a new process would: the record comes from the disk
    launched = []
    real_get_kernels = cache.get_kernels
    monkeypatch.setattr(cache, "get_kernels", lambda keys: launched.extend(keys) or real_get_kernels(keys))
    args = (x["q"], x["k"], x["v"], x["gk"], x["beta"])
    tuned = kdajit.forward(*args, cu_seqlens=cu)
    assert launched == [record.key.spec.fused_key(winner)], launched
    monkeypatch.setenv("KDAJIT_AUTOTUNE", "off")
    tuner.clear()
    launched.clear()
    untuned_run = kdajit.forward(*args, cu_seqlens=cu)
    assert launched == [record.key.spec.fused_key(untuned)], launched
    torch.cuda.synchronize()
    assert_bitwise(tuned, untuned_run, f"tuned winner {winner.slug()} vs untuned configuration {untuned.slug()}")
