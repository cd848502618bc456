"""The tuner's logic on the CPU, with stand-in kernels and stand-in timings: the bitwise guard (an
order-changing candidate and an unwritten element are caught), the choice (1% ties go to the earlier
configuration), the records (stored beside the kernels, read back, refused when malformed, found in
read-only layers), the modes and the incremental re-tune. The real kernels' guard and timings run in
tests/test_gpu_tuner.py."""
from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

from kdajit import cache_layout, tune_guard, tune_records, tune_timing, tuner
from kdajit.cache_toolchain import toolchain_fingerprint
from kdajit.keys import FUSED_CONFIG_SPACE, ForwardSpec, FusedConfig
from kdajit.tune_records import TuningRecord, WorkloadBucket

SPEC = ForwardSpec("bf16", "dense", 128, 128, 64, False, "sm_90a")
VARLEN_SPEC = dataclasses.replace(SPEC, varlen="cu32", output_qg=True)
REF = FUSED_CONFIG_SPACE[0]
UNTUNED = SPEC.untuned_fused_config  # what forward runs without a record
SHAPE = tuner.TuneShape(1, 128, 2)  # whole chunks: only the probes have a partial one
CPU = torch.device("cpu")


def standin_prepare(broken: dict[FusedConfig, str] | None = None):
    """A `prepare` whose "kernel" copies slices of the inputs into the outputs; configurations in
    `broken` misbehave: "order" flips the lowest bit of one Akk element of a partial last chunk (what a
    reordered reduction does), "unwritten" leaves the last row of W alone."""
    broken = broken or {}

    def prepare(config, x, out):
        def launch():
            out.Aqk.copy_(x["q"][..., :64])
            out.Akk.copy_(x["k"][..., :64])
            out.w.copy_(x["k"])
            out.u.copy_(x["v"])
            out.kg.copy_((x["q"].float() * x["gk"]).to(torch.bfloat16))
            if out.qg is not None:
                out.qg.copy_(x["q"])
            T = out.Akk.shape[1]
            if broken.get(config) == "order" and T % 64:
                bits = out.Akk.view(torch.int16)
                bits[0, T - 1, 0, 3] ^= 1
            if broken.get(config) == "unwritten":
                out.w[:, -1] = float("nan")
        return launch

    return prepare


def fake_timer(times: dict[FusedConfig, float], seen: list | None = None):
    def timer(launches):
        for launch_list in launches.values():
            for launch in launch_list:
                launch()
        if seen is not None:
            seen.append(sorted(c.slug() for c in launches))
        return {c: times.get(c, 1.0) for c in launches}
    return timer


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("KDAJIT_CACHE_DIR", str(root))
    monkeypatch.setenv("KDAJIT_LOCK_DIR", str(tmp_path / "locks"))
    monkeypatch.delenv("KDAJIT_CACHE_RO_DIRS", raising=False)
    monkeypatch.delenv("KDAJIT_STRICT_BITWISE", raising=False)
    monkeypatch.setattr(tuner, "device_identity", lambda index: ("Stand-in GPU", 132, "GPU-standin"))
    tuner.clear()
    yield root
    tuner.clear()


def key_of(spec=SPEC, shape=SHAPE):
    return tuner.tuning_key(spec, 0, shape.total_tokens, shape.heads, shape.seqs)


def run_tune(prepare, times=None, *, spec=SPEC, shape=SHAPE, seen=None, force=False):
    return tuner.tune(key_of(spec, shape), shape, prepare, force=force, device_index=0,
                      timer=fake_timer(times or {}, seen), device=CPU)


def test_workload_bucket_rounds_tokens_and_sequences_to_powers_of_two():
    assert WorkloadBucket.of(2 * 8192, 64, 2) == WorkloadBucket(16384, 64, 2)
    assert WorkloadBucket.of(5000, 8, 3) == WorkloadBucket.of(8000, 8, 4) == WorkloadBucket(8192, 8, 4)
    assert WorkloadBucket.of(1, 1, 1) == WorkloadBucket(1, 1, 1)
    assert WorkloadBucket.of(8193, 8, 1).tokens == 16384


def test_tie_within_one_percent_goes_to_the_earlier_configuration():
    a, b, c = FUSED_CONFIG_SPACE[:3]
    assert tune_timing.choose([a, b, c], {a: 1.0, b: 0.991, c: 0.995}) == a
    assert tune_timing.choose([a, b, c], {a: 1.0, b: 0.98, c: 0.985}) == b
    assert tune_timing.choose([a, b, c], {b: 1.0, c: 0.5}) == c
    with pytest.raises(ValueError):
        tune_timing.choose([a], {})


def test_input_sets_exceed_twice_the_l2():
    assert tune_timing.input_sets_needed(10 << 20, 50 << 20) == 10
    assert tune_timing.input_sets_needed(2 << 30, 50 << 20) == 1
    assert tune_timing.input_sets_needed(1, 50 << 20) == tune_timing.MAX_INPUT_SETS


def test_probes_hit_the_edges_of_each_specialization():
    dense = dict(tune_guard.probe_problems(SPEC, CPU))
    assert dense["partial-last-chunk"]["q"].shape[1] % 64
    assert dense["one-token"]["q"].shape[1] == 1
    steep = dense["steepest-safe-gate"]["gk"]
    assert torch.allclose(steep[0, :64, 0, 0], torch.arange(1, 65) * (tune_guard.SAFE_GATE_BOUND / 0.6931471805599453))
    varlen = dict(tune_guard.probe_problems(VARLEN_SPEC, CPU))
    cu = varlen["sequence-boundaries"]["cu_seqlens"]
    assert cu.dtype == torch.int32 and 1 in cu.diff().tolist() and 65 in cu.diff().tolist()
    assert varlen["one-token-sequences"]["cu_seqlens"].diff().tolist() == [1, 1, 1]
    again = dict(tune_guard.probe_problems(SPEC, CPU))
    assert torch.equal(again["partial-last-chunk"]["k"], dense["partial-last-chunk"]["k"])  # seeded


def test_guard_excludes_an_order_changing_candidate_and_names_the_first_difference(cache_root):
    bad = FUSED_CONFIG_SPACE[2]
    with pytest.warns(tuner.KdajitTuningWarning, match=f"{bad.slug()}.*partial-last-chunk: Akk"):
        record = run_tune(standin_prepare({bad: "order"}), {bad: 0.1})
    result = record.result(bad)
    assert result.guard == "mismatch" and result.ms is None
    assert "partial-last-chunk: Akk[0, 999, 0, 3]" in result.detail and "(1 of" in result.detail
    assert record.winner != bad  # the fastest "time" belongs to the excluded candidate
    assert all(r.guard == "ok" for r in record.candidates if r.config != bad)


def test_guard_catches_an_element_left_unwritten(cache_root):
    lazy = FUSED_CONFIG_SPACE[1]
    with pytest.warns(tuner.KdajitTuningWarning):
        record = run_tune(standin_prepare({lazy: "unwritten"}))
    assert record.result(lazy).guard == "mismatch" and record.result(lazy).detail.split(":")[1].strip().startswith("w[")


def test_strict_bitwise_raises_instead_of_excluding(cache_root, monkeypatch):
    monkeypatch.setenv("KDAJIT_STRICT_BITWISE", "1")
    with pytest.raises(tuner.BitwiseMismatch, match="KDAJIT_STRICT_BITWISE"):
        run_tune(standin_prepare({FUSED_CONFIG_SPACE[3]: "order"}))


def test_record_is_stored_beside_the_kernels_and_drives_cached_mode(cache_root, monkeypatch):
    fast = FUSED_CONFIG_SPACE[4]
    record = run_tune(standin_prepare(), {fast: 0.5})
    assert record.winner == fast and record.speedup == pytest.approx(2.0)
    (path,) = list(cache_layout.record_paths(cache_root))
    assert path.toolchain == toolchain_fingerprint() and path.arch == "sm_90a"
    on_disk = json.loads((cache_root / path.relpath).read_text())
    assert on_disk["winner_slug"] == fast.slug() and len(on_disk["candidates"]) == len(FUSED_CONFIG_SPACE)
    assert {c["guard"] for c in on_disk["candidates"]} == {"ok"}
    tuner.clear()  # a new process: the record comes from the disk
    never = lambda *a: pytest.fail("cached mode must not tune")  # noqa: E731
    args = (SPEC, 0, SHAPE.total_tokens, SHAPE.heads, SHAPE.seqs, never, never)
    assert tuner.config_for(*args) == fast
    other_length = (SPEC, 0, 100, SHAPE.heads, SHAPE.seqs, never, never)  # same bucket (128 tokens)
    assert tuner.config_for(*other_length) == fast
    monkeypatch.setenv("KDAJIT_AUTOTUNE", "off")
    tuner.clear()
    assert tuner.config_for(*args) == UNTUNED
    monkeypatch.setenv("KDAJIT_AUTOTUNE", "cached")
    tuner.clear()
    assert tuner.config_for(SPEC, 0, 100_000, 4, 1, never, never) == UNTUNED  # no record: the untuned config


def test_mode_on_tunes_once_and_only_new_candidates_later(cache_root, monkeypatch):
    monkeypatch.setenv("KDAJIT_AUTOTUNE", "on")
    seen: list = []
    prepare = standin_prepare()
    timer = fake_timer({FUSED_CONFIG_SPACE[5]: 0.7}, seen)
    monkeypatch.setattr(tune_timing, "time_launches", timer)
    monkeypatch.setattr(tuner.tune, "__kwdefaults__", {**tuner.tune.__kwdefaults__, "timer": timer, "device": CPU})
    args = (SPEC, 0, SHAPE.total_tokens, SHAPE.heads, SHAPE.seqs, prepare, lambda: SHAPE)
    assert tuner.config_for(*args) == FUSED_CONFIG_SPACE[5]
    assert tuner.config_for(*args) == FUSED_CONFIG_SPACE[5] and len(seen) == 1  # memoized: no second run
    # A record written before the last candidate joined the space: only it, the reference and the
    # previous winner are timed again; the others keep their stored results.
    key = key_of()
    record = tuner.find_record(key)
    newest = FUSED_CONFIG_SPACE[-1]
    old = dataclasses.replace(record, candidates=[c for c in record.candidates if c.config != newest])
    tune_records.write_record(cache_root, old)
    tuner.clear()
    assert tuner.config_for(*args) == FUSED_CONFIG_SPACE[5]
    assert seen[-1] == sorted({REF.slug(), FUSED_CONFIG_SPACE[5].slug(), newest.slug()})
    assert tuner.find_record(key).result(newest).guard == "ok"


def test_no_tuning_while_capturing_or_compiling(cache_root, monkeypatch):
    monkeypatch.setenv("KDAJIT_AUTOTUNE", "force")
    monkeypatch.setattr(tuner, "may_tune", lambda: False)
    never = lambda *a: pytest.fail("must not tune while capturing")  # noqa: E731
    assert tuner.config_for(SPEC, 0, 128, 2, 1, never, never) == UNTUNED
    with pytest.raises(RuntimeError, match="captured"):
        run_tune(standin_prepare())


def test_pruned_configurations_are_recorded_unbuildable_and_never_run(cache_root, monkeypatch):
    too_big = FusedConfig(True, 3, "chunk", 0)  # 3 CTAs of ~115 KB shared memory do not fit an SM
    monkeypatch.setattr(tuner, "FUSED_CONFIG_SPACE", FUSED_CONFIG_SPACE + (too_big,))
    buildable, pruned = tuner.candidates(SPEC)
    assert pruned == [too_big] and buildable == list(FUSED_CONFIG_SPACE)
    prepare = standin_prepare()
    record = tuner._tune_locked(key_of(), SHAPE, lambda c, x, o: pytest.fail("pruned") if c == too_big
                                else prepare(c, x, o), None, CPU, lambda *a: None, fake_timer({}))
    assert record.result(too_big).guard == "unbuildable"


def test_head_size_256_prunes_the_configurations_sized_for_two_ctas_per_sm():
    # A K = V = 256 CTA needs ~209 KB of shared memory: only one fits an SM. The tile reference asks for
    # as many as fit and stays buildable; persistent grids sized for two CTAs per SM are pruned.
    spec = dataclasses.replace(SPEC, head_k=256, head_v=256)
    buildable, pruned = tuner.candidates(spec)
    assert buildable[0] == REF and pruned
    assert all(c.persistent and c.ctas_per_sm == 2 for c in pruned)
    assert [c for c in FUSED_CONFIG_SPACE if c.ctas_per_sm == 1 or not c.persistent] == buildable
    assert tuner.candidates(dataclasses.replace(SPEC, head_k=64, head_v=64, io_dtype="fp16"))[1] == []


def test_malformed_or_foreign_records_are_refused_with_the_reason(cache_root):
    record = run_tune(standin_prepare())
    doc = record.to_json()
    with pytest.raises(ValueError, match="not a kdajit-tuning-record"):
        TuningRecord.from_json({**doc, "schema": 99})
    with pytest.raises(ValueError, match="not in today's configuration space"):
        TuningRecord.from_json({**doc, "winner": dataclasses.asdict(FusedConfig(True, 4, "head", 0))})
    # Equal to a space member under ==, but another kernel's cache path: refused, never half-used.
    loose = {"persistent": 1, "ctas_per_sm": 2.0, "raster": "chunk", "loads_ahead": 0, "warps": 4, "gate_rows": "late",
             "intra_unroll": 2, "stores": "threads", "pingpong": "off"}
    with pytest.raises(ValueError, match="config.persistent=1 must be a bool"):
        TuningRecord.from_json({**doc, "winner": loose})
    with pytest.raises(ValueError, match="spec.head_k=128.0 must be a int"):
        TuningRecord.from_json({**doc, "key": {**doc["key"], "spec": {**doc["key"]["spec"], "head_k": 128.0}}})
    mismatch = [dict(c, guard="mismatch") if c["slug"] == record.winner.slug() else c for c in doc["candidates"]]
    with pytest.raises(ValueError, match="not a guarded, timed candidate"):
        TuningRecord.from_json({**doc, "candidates": mismatch})
    with pytest.raises(ValueError, match="malformed"):
        TuningRecord.from_json({**doc, "candidates": [{"config": {"persistent": True, "bogus": 1}}]})
    (path,) = list(cache_layout.record_paths(cache_root))
    (cache_root / path.relpath).write_text("{not json")
    tuner.clear()
    with pytest.warns(tuner.KdajitTuningWarning, match="ignoring the tuning record"):
        assert tuner.find_record(key_of()) is None


def test_read_only_layers_supply_records_and_bad_ones_are_skipped(cache_root, tmp_path, monkeypatch):
    fast = FUSED_CONFIG_SPACE[6]
    record = run_tune(standin_prepare(), {fast: 0.5})
    layer = tmp_path / "shared-layer"
    tune_records.write_record(layer, record)
    broken = tmp_path / "broken-layer"
    tune_records.write_record(broken, record)
    (rel,) = list(cache_layout.record_paths(broken))
    (broken / rel.relpath).write_text("[]")
    (own,) = list(cache_layout.record_paths(cache_root))
    (cache_root / own.relpath).unlink()
    monkeypatch.setenv("KDAJIT_CACHE_RO_DIRS", f"{broken}:{layer}")
    tuner.clear()
    with pytest.warns(tuner.KdajitTuningWarning, match="broken-layer"):
        assert tuner.find_record(key_of()).winner == fast
    assert (broken / rel.relpath).read_text() == "[]"  # a read-only layer is never modified
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuner.clear()
        monkeypatch.setenv("KDAJIT_CACHE_RO_DIRS", str(layer))
        assert tuner.find_record(key_of()).winner == fast


def _share_worker(rank: int, init: str, roots: list[str], record_doc: dict, results) -> None:
    import os

    import torch.distributed as dist

    os.environ["KDAJIT_CACHE_DIR"] = roots[rank]
    tuner.clear()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        if rank == 0:
            tuner._store(TuningRecord.from_json(record_doc))
        n = tuner.share_records()
        record = TuningRecord.from_json(record_doc)
        found = tuner.find_record(record.key)
        on_disk = len(list(cache_layout.record_paths(cache_layout.cache_root())))
        results.put((rank, n, found.winner.slug() if found else None, on_disk))
    finally:
        dist.destroy_process_group()


def test_share_records_makes_every_rank_adopt_rank_zeros_records(cache_root, tmp_path):
    import torch.multiprocessing as mp

    record = run_tune(standin_prepare(), {FUSED_CONFIG_SPACE[7]: 0.5})
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    roots = [str(tmp_path / "rank0"), str(tmp_path / "rank1")]
    procs = [ctx.Process(target=_share_worker, args=(r, f"file://{tmp_path / 'rendezvous'}", roots,
                                                     record.to_json(), results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    got = sorted(results.get(timeout=5) for _ in range(2))
    assert got == [(0, 1, FUSED_CONFIG_SPACE[7].slug(), 1), (1, 1, FUSED_CONFIG_SPACE[7].slug(), 1)]


def test_cli_lists_shows_exports_and_imports_tuning_records(cache_root, tmp_path, capsys):
    from kdajit import cli

    bad = FUSED_CONFIG_SPACE[3]
    with pytest.warns(tuner.KdajitTuningWarning):
        record = run_tune(standin_prepare({bad: "order"}), {FUSED_CONFIG_SPACE[1]: 0.8})
    capsys.readouterr()
    assert cli.main(["cache", "ls", "--cache-dir", str(cache_root)]) == 0
    listing = capsys.readouterr().out
    assert "1 tuning records" in listing and FUSED_CONFIG_SPACE[1].slug() in listing and "1 rejected" in listing
    (path,) = list(cache_layout.record_paths(cache_root))
    assert cli.main(["cache", "show", str(cache_root / path.relpath), "--cache-dir", str(cache_root)]) == 0
    shown = capsys.readouterr().out
    assert f"winner:  {FUSED_CONFIG_SPACE[1].slug()}, 1.250x the reference" in shown
    assert "mismatch" in shown and "partial-last-chunk: Akk" in shown and len(shown.splitlines()) >= 4 + 9
    assert cli.main(["cache", "ls", "--json", "--cache-dir", str(cache_root)]) == 0
    assert json.loads(capsys.readouterr().out)["tuning_records"][0]["winner_slug"] == FUSED_CONFIG_SPACE[1].slug()
    bundle = tmp_path / "records.tar"
    assert cli.main(["cache", "export", str(bundle), "--json", "--cache-dir", str(cache_root)]) == 0
    exported = json.loads(capsys.readouterr().out)
    assert exported["records"] == 1
    other = tmp_path / "other-root"
    assert cli.main(["cache", "import", str(bundle), "--sha256", exported["sha256"], "--json",
                     "--cache-dir", str(other)]) == 0
    assert json.loads(capsys.readouterr().out)["imported"] == 1
    imported = tune_records.read_record(other, record.key, record.toolchain)
    assert imported.to_json() == record.to_json()


def test_cli_tune_without_a_gpu_says_so_in_one_line(cache_root, capsys):
    from kdajit import cli

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli.main(["tune", "--shape", "1x256x4", "--cache-dir", str(cache_root)]) == 1
    assert "kdajit tune needs a CUDA GPU" in capsys.readouterr().err.replace("kdajit.tune", "kdajit tune")
    assert cli.main(["tune", "--shape", "2x256", "--cache-dir", str(cache_root)]) == 2
    assert "is not BxTxH" in capsys.readouterr().err


def test_cache_verify_reports_and_fix_deletes_a_bad_record(cache_root, capsys):
    from kdajit import cli

    run_tune(standin_prepare())
    (path,) = list(cache_layout.record_paths(cache_root))
    assert cli.main(["cache", "verify", "--cache-dir", str(cache_root)]) == 0
    (cache_root / path.relpath).write_text(json.dumps({"format": "kdajit-tuning-record", "schema": 1}))
    capsys.readouterr()
    assert cli.main(["cache", "verify", "--cache-dir", str(cache_root)]) == 1
    assert "BAD-RECORD" in capsys.readouterr().out
    assert cli.main(["cache", "verify", "--fix", "--cache-dir", str(cache_root)]) == 0
    assert not (cache_root / path.relpath).exists()


def _timing_worker(root: str, locks: str, log: str, go: str, force: bool) -> None:
    import os
    import time as _time
    from pathlib import Path

    os.environ.update(KDAJIT_CACHE_DIR=root, KDAJIT_LOCK_DIR=locks)
    tuner.device_identity = lambda index: ("Stand-in GPU", 132, "GPU-standin")  # one shared "GPU"
    while not Path(go).exists():
        _time.sleep(0.01)

    def slow_timer(launches):
        start = _time.time()
        _time.sleep(0.4)
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {start} {_time.time()}\n")
        return {c: 1.0 for c in launches}

    tuner.tune(key_of(), SHAPE, standin_prepare(), device_index=0, timer=slow_timer, device=CPU, force=force)


@pytest.mark.parametrize("force", [True, False], ids=["force", "adopt"])
def test_processes_sharing_a_gpu_never_time_at_the_same_time(cache_root, tmp_path, force):
    # force: each process times, one after another. Without force, the first one to hold the GPU's
    # lock times and stores the record before letting go; the others re-read it and adopt it.
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    log, go = tmp_path / "timing.log", tmp_path / "go"
    procs = [ctx.Process(target=_timing_worker, args=(str(cache_root), str(tmp_path / "locks"), str(log), str(go),
                                                      force)) for _ in range(3)]
    for p in procs:
        p.start()
    go.touch()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    spans = sorted((float(a), float(b)) for _, a, b in (line.split() for line in log.read_text().splitlines()))
    assert len(spans) == (3 if force else 1)
    assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:])), spans


def test_new_lengths_in_a_seen_bucket_cost_one_lookup_hits_and_misses_alike(cache_root, monkeypatch):
    reads = []
    real = tune_records.read_record
    monkeypatch.setattr(tune_records, "read_record", lambda *a: reads.append(a) or real(*a))
    never = lambda *a: pytest.fail("cached mode must not tune")  # noqa: E731
    for tokens in range(1025, 2049):  # one bucket (2048 tokens), no record: the miss is remembered too
        assert tuner.config_for(SPEC, 0, tokens, 4, 1, never, never) == UNTUNED
    assert len(reads) == 1 and len(tuner._CHOICES) == 1


def test_a_failing_tuning_run_never_fails_the_call(cache_root, monkeypatch):
    monkeypatch.setenv("KDAJIT_AUTOTUNE", "on")
    monkeypatch.setattr(tuner.tune, "__kwdefaults__", {**tuner.tune.__kwdefaults__, "timer": fake_timer({}),
                                                       "device": CPU})

    def broken(config, x, out):
        raise RuntimeError("out of memory (stand-in)")
    args = (SPEC, 0, SHAPE.total_tokens, SHAPE.heads, SHAPE.seqs, broken, lambda: SHAPE)
    with pytest.warns(tuner.KdajitTuningWarning, match="tuning .* failed .*out of memory"):
        assert tuner.config_for(*args) == UNTUNED
    assert tuner.config_for(*args) == UNTUNED  # remembered: not retried on every call


def test_a_candidate_that_cannot_run_is_left_out_and_retried_later(cache_root):
    skipped = FUSED_CONFIG_SPACE[2]
    prepare = standin_prepare()

    def prepare_without_one(config, x, out):
        if config == skipped:
            raise RuntimeError("kernel not cached (stand-in for KDAJIT_DISABLE_JIT)")
        return prepare(config, x, out)
    with pytest.warns(tuner.KdajitTuningWarning, match=f"{skipped.slug()} could not run"):
        record = run_tune(prepare_without_one)
    assert record.result(skipped) is None and tuner._missing(record)
    again = run_tune(prepare)  # the record lacks it: this run times it (beside the reference and winner)
    assert again.result(skipped).guard == "ok"


def test_records_of_an_untrusted_layer_are_never_read_listed_or_shared(cache_root, tmp_path, monkeypatch):
    record = run_tune(standin_prepare(), {FUSED_CONFIG_SPACE[6]: 0.5})
    layer = tmp_path / "shared-layer"
    tune_records.write_record(layer, record)
    layer.chmod(0o777)  # anyone could have planted what is in it
    (own,) = list(cache_layout.record_paths(cache_root))
    (cache_root / own.relpath).unlink()
    monkeypatch.setenv("KDAJIT_CACHE_RO_DIRS", str(layer))
    tuner.clear()
    with pytest.warns(tuner.KdajitTuningWarning, match="writable by group or others"):
        assert tuner.find_record(key_of()) is None
    assert tuner.records_of_toolchain() == []  # what share_records would broadcast


def test_cache_off_reads_no_layer(cache_root, tmp_path, monkeypatch):
    record = run_tune(standin_prepare(), {FUSED_CONFIG_SPACE[6]: 0.5})
    layer = tmp_path / "layer"
    tune_records.write_record(layer, record)
    monkeypatch.setenv("KDAJIT_CACHE_RO_DIRS", str(layer))
    monkeypatch.setenv("KDAJIT_CACHE", "off")
    tuner.clear()
    assert tuner.find_record(key_of()) is None


@pytest.mark.parametrize("stored", [True, False], ids=["record-winner", "untuned"])
def test_forward_falls_back_to_the_reference_when_its_configuration_is_not_cached(cache_root, monkeypatch, stored):
    """A record's winner, or the untuned configuration, that no cache layer holds (KDAJIT_DISABLE_JIT with a cache
    precompiled before it was chosen): the call runs the reference configuration, and remembers that."""
    from kdajit import api, cache
    from kdajit.validate import Problem

    if stored:
        run_tune(standin_prepare(), {FUSED_CONFIG_SPACE[4]: 0.5})
    tuner.clear()
    monkeypatch.setattr(api, "_spec", lambda *a: SPEC)
    monkeypatch.setattr(api, "_sm_count", lambda index: 132)
    launched = []

    def get_kernels(keys):
        (key,) = keys
        if key.config != REF:
            raise cache.KernelNotCached("not cached (stand-in)", keys)
        launched.append(key)
        return ("reference kernel",)
    monkeypatch.setattr(cache, "get_kernels", get_kernels)
    problem = Problem(1, SHAPE.tokens, SHAPE.heads, 128, 128, 64, "bf16", "dense", "bf16", SHAPE.heads)
    with pytest.warns(tuner.KdajitTuningWarning, match="cannot be used .*not cached"):
        kernels = api._kernels(problem, 64, False, 0, intra=True, recompute=True, seqs=1, shape=lambda: SHAPE)
    assert kernels.fused == "reference kernel" and launched == [SPEC.fused_key()]
    assert tuner.config_for(SPEC, 0, SHAPE.tokens, SHAPE.heads, 1, None, None) == REF  # remembered


def test_untuned_configuration_is_what_measured_fastest_per_size():
    persistent_early, w8 = FusedConfig(True, 2, "head", 1), FusedConfig(warps=8)
    early_gate_rows = FusedConfig(True, 2, "head", 1, gate_rows="early")
    kp_in_vp = FusedConfig(True, 2, "head", 1, gate_rows="early-vbuf")
    assert UNTUNED == persistent_early and UNTUNED in FUSED_CONFIG_SPACE and w8 in FUSED_CONFIG_SPACE
    assert SPEC.fused_key(UNTUNED) in SPEC.kernel_keys() and SPEC.fused_key(REF) in SPEC.kernel_keys()
    k64, k256 = (dataclasses.replace(SPEC, head_k=n, head_v=n) for n in (64, 256))
    expected = {VARLEN_SPEC: REF, k64: early_gate_rows, dataclasses.replace(k64, output_qg=True): REF,
                dataclasses.replace(k64, varlen="cu32", safe_gate=False): early_gate_rows,  # K = V = 64: any mode
                dataclasses.replace(SPEC, safe_gate=False): persistent_early,  # K = V = 128: one TMA box per tile
                dataclasses.replace(SPEC, io_dtype="fp16", beta_dtype="fp16", varlen="cu64"): persistent_early,
                dataclasses.replace(SPEC, head_v=256): w8,  # K != V: two persistent CTAs per SM do not fit
                dataclasses.replace(SPEC, head_k=100, head_v=100): kp_in_vp,  # padded K = V: its own entry
                dataclasses.replace(k64, head_k=60, head_v=60): kp_in_vp,  # ... and 64's
                dataclasses.replace(k64, head_v=60): REF,  # K != V: the (chunk, K, QG) table's entry
                k256: w8, dataclasses.replace(k256, output_qg=True): None,  # None: the standalone kernels
                dataclasses.replace(SPEC, chunk=32): REF}  # chunk 32: the reference measured faster
    for spec, config in expected.items():
        assert spec.untuned_fused_config == config, spec
        fused = [k.config for k in spec.kernel_keys() if k.TEMPLATE == "fused_forward"]
        assert fused == ([REF] if config in (REF, None) else [REF, config]), spec  # the reference always built
