"""Autotuning of the fused kernel's configuration, under the rule that tuning changes speed, never bits.

`KDAJIT_AUTOTUNE` (read in kdajit.env) decides what a `forward` call runs:

| mode | what a call uses | tunes |
|---|---|---|
| off | the spec's untuned configuration (`ForwardSpec.untuned_fused_config`) | never |
| cached (default) | the winner of a stored record for the call's `TuningKey`, else the untuned configuration | never |
| on | like cached | a workload bucket with no record, or whose record lacks candidates of today's space, on first use |
| force | like on | every bucket again (every candidate re-timed) on its first use in the process |

Nothing is tuned while a CUDA graph is being captured or torch.compile traces (the record or the
untuned configuration is used then, and a later plain call may tune). A tuning run (`tune`) holds this GPU's
tuning lock, so processes sharing a GPU never time at the same time; re-reads the record once it
holds the lock; guards every candidate (kdajit.tune_guard: bitwise equal to the reference on the
tuning inputs and on edge-case probes, or excluded: warned once, or raised with
KDAJIT_STRICT_BITWISE=1); times the survivors (kdajit.tune_timing); and stores the record beside the
kernels (kdajit.tune_records). Distributed jobs agree explicitly: `share_records` makes every rank
adopt one rank's records; nothing in `forward` ever talks to other ranks.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from kdajit import cache_files, cache_layout, cache_locks, compiler, env, tune_guard, tune_records, tune_timing
from kdajit.cache_toolchain import toolchain_fingerprint
from kdajit.keys import FUSED_CONFIG_SPACE, ForwardSpec, FusedConfig
from kdajit.tune_records import CandidateResult, TuningKey, TuningRecord, WorkloadBucket

log = logging.getLogger("kdajit")
REFERENCE = FUSED_CONFIG_SPACE[0]
Progress = Callable[[int, int, str], None]  # (done, total, what): called as a tuning run advances


class KdajitTuningWarning(RuntimeWarning):
    """A tuning candidate was excluded, or a tuning record could not be read or written."""


class BitwiseMismatch(RuntimeError):
    """With KDAJIT_STRICT_BITWISE=1: a candidate configuration's outputs differ from the reference's."""


@dataclass(frozen=True)
class TuneShape:
    """The shape a tuning run times: dense [batch, tokens] or, with `lengths`, packed sequences."""

    batch: int
    tokens: int
    heads: int
    lengths: tuple[int, ...] | None = None

    @property
    def seqs(self) -> int:
        return len(self.lengths) if self.lengths is not None else self.batch

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths) if self.lengths is not None else self.batch * self.tokens


# (spec, device index, tokens rounded up to a power of two, H, sequences rounded up) -> configuration: one
# entry per workload bucket, hits and misses alike, so a new length in a known bucket costs one dict lookup.
_CHOICES: dict[tuple, FusedConfig] = {}
_RECORDS: dict[TuningKey, TuningRecord] = {}  # records this process read, tuned or adopted
_FORCED: set[TuningKey] = set()
_WARNED: set[str] = set()
_LOCK = threading.RLock()
# Bumped after every change of a memoized choice (an entry of _CHOICES replaced, or all of them forgotten), never by a
# new entry: callers that memoize `config_for`'s answers compare it (`generation`). The state changes first, the
# number second, so a caller that reads the number before its lookups never keeps an answer older than the number.
_generation = 0


def clear() -> None:
    """Forget this process's choices and records (the disk is untouched)."""
    with _LOCK:
        _forget_choices()
        _RECORDS.clear()
        _FORCED.clear()
        _WARNED.clear()


def generation() -> int:
    """A number that changes whenever an answer `config_for` gave may change (a choice demoted, the choices forgotten
    by `clear`, a tuning run or an adopted record): what a caller that memoizes those answers checks before reusing
    one. A first choice for a new workload bucket leaves it unchanged (no earlier answer was about that bucket)."""
    return _generation


def _choose(memo: tuple, config: FusedConfig) -> None:
    """Memoize `config` for the workload bucket `memo` (`_memo_key`), under _LOCK."""
    global _generation
    replaced = memo in _CHOICES
    _CHOICES[memo] = config
    if replaced:
        _generation += 1


def _forget_choices() -> None:
    """Forget every memoized choice, under _LOCK."""
    global _generation
    _CHOICES.clear()
    _generation += 1


def _warn_once(topic: str, message: str) -> None:
    if topic in _WARNED:
        log.debug("%s", message)
        return
    _WARNED.add(topic)
    warnings.warn(message, KdajitTuningWarning, stacklevel=4)


@functools.lru_cache(maxsize=None)
def device_identity(device_index: int) -> tuple[str, int, str]:
    """(name, SM count, UUID) of a CUDA device; ("no-gpu", 0, "no-gpu") without CUDA (no record matches)."""
    if not torch.cuda.is_available():
        return "no-gpu", 0, "no-gpu"
    props = torch.cuda.get_device_properties(device_index)
    return props.name, props.multi_processor_count, str(getattr(props, "uuid", device_index))


def tuning_key(spec: ForwardSpec, device_index: int, tokens: int, heads: int, seqs: int) -> TuningKey:
    name, sms, _ = device_identity(device_index)
    return TuningKey(spec, name, sms, WorkloadBucket.of(tokens, heads, seqs))


def _roots() -> list[tuple[Path, bool]]:
    """(resolved root, writable) of every cache layer, in search order (`cache_layout.layer_roots`)."""
    return [(cache_files.real_root(root), mode == "rw") for root, mode in cache_layout.layer_roots()]


def _read_disk(key: TuningKey, first_only: bool = False) -> TuningRecord | None:
    fp = toolchain_fingerprint()
    for root, _ in _roots()[:1] if first_only else _roots():
        try:
            record = tune_records.read_record(root, key, fp)
        except (OSError, ValueError) as e:
            _warn_once(f"read:{root}:{key}", f"kdajit: ignoring the tuning record for {key.name()} under {root} "
                                             f"({e}); using the next layer or the reference configuration")
            continue
        if record is not None:
            return record
    return None


def find_record(key: TuningKey) -> TuningRecord | None:
    """The record for `key`: this process's, else the first cache layer's that has a usable one."""
    with _LOCK:
        if key not in _RECORDS:
            record = _read_disk(key)
            if record is None:
                return None
            _RECORDS[key] = record
        return _RECORDS[key]


def candidates(spec: ForwardSpec) -> tuple[list[FusedConfig], list[FusedConfig]]:
    """(buildable, pruned) configurations of the space for `spec`, in the space's order; pruned ones
    do not fit (shared memory, threads: the template's can_implement) and are never compiled."""
    cls = compiler.template_class(spec.fused_key())
    buildable = [c for c in FUSED_CONFIG_SPACE if cls.can_implement(spec.fused_key(c))]
    return buildable, [c for c in FUSED_CONFIG_SPACE if c not in buildable]


def _missing(record: TuningRecord | None) -> bool:
    return record is None or any(record.result(c) is None for c in FUSED_CONFIG_SPACE)


def may_tune() -> bool:
    """False while a CUDA graph is being captured or torch.compile traces."""
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return not (torch.compiler.is_compiling() or capturing)


def _memo_key(spec: ForwardSpec, device_index: int, tokens: int, heads: int, seqs: int) -> tuple:
    return spec, device_index, *tune_records.bucket_parts(tokens, heads, seqs)


def config_for(spec: ForwardSpec, device_index: int, tokens: int, heads: int, seqs: int,
               prepare: tune_guard.Prepare, shape: Callable[[], TuneShape]) -> FusedConfig:
    """The fused configuration a call runs (the hot path: one dict lookup once its workload bucket has
    been seen); `prepare` and `shape` are used only when this call has to tune (mode on/force)."""
    memo = _memo_key(spec, device_index, tokens, heads, seqs)
    choice = _CHOICES.get(memo)
    if choice is not None:
        return choice
    return _config_slow(memo, spec, device_index, tokens, heads, seqs, prepare, shape)


def _config_slow(memo, spec, device_index, tokens, heads, seqs, prepare, shape) -> FusedConfig:
    with _LOCK:
        mode = env.autotune_mode()
        untuned = spec.untuned_fused_config
        if mode == "off" or tokens == 0:  # an empty call launches nothing: nothing to time
            _choose(memo, untuned)
            return untuned
        key = tuning_key(spec, device_index, tokens, heads, seqs)
        record = find_record(key)
        wants = mode == "force" and key not in _FORCED or mode == "on" and key not in _FORCED and _missing(record)
        if wants and not may_tune():
            return record.winner if record else untuned  # not memoized: a later plain call may tune
        if wants:
            try:
                record = tune(key, shape(), prepare, force=mode == "force", device_index=device_index)
            except BitwiseMismatch:
                raise
            except Exception as e:  # noqa: BLE001 - a failed tuning run must not fail the call
                _FORCED.add(key)
                _warn_once(f"failed:{key}", f"kdajit: tuning {key.name()} failed ({type(e).__name__}: {e}); "
                                            f"using {'its stored record' if record else 'the untuned configuration'}")
        config = record.winner if record else untuned
        _choose(memo, config)
        return config


def demote(spec: ForwardSpec, device_index: int, tokens: int, heads: int, seqs: int, why: str) -> None:
    """Run the reference configuration for this workload bucket from now on in this process (the chosen
    configuration's kernel cannot be had: `why`)."""
    with _LOCK:
        _choose(_memo_key(spec, device_index, tokens, heads, seqs), REFERENCE)
        _warn_once(f"demote:{spec}", f"kdajit: the tuned configuration of {spec.fused_key().spec_slug()} cannot be "
                                     f"used ({why}); running the reference configuration")


def _gpu_lock(device_index: int):
    """This GPU's tuning lock (a file lock in the cache's lock directory), or None (warned) if unusable."""
    roots = _roots()
    lock_dir, refused = cache_locks.usable_lock_dir(roots[0][0] if roots and roots[0][1] else None)
    if lock_dir is None:
        _warn_once("gpu_lock", f"kdajit: no usable lock directory for tuning ({'; '.join(refused)}); another "
                               f"process timing on this GPU at the same time would skew both runs")
        return None
    import filelock

    path = cache_locks.gpu_lock_file(lock_dir, device_identity(device_index)[2])
    lock = filelock.FileLock(str(path), mode=0o600)
    try:
        lock.acquire(timeout=env.lock_timeout_s(), poll_interval=0.2)
    except (filelock.Timeout, OSError) as e:
        _warn_once("gpu_lock", f"kdajit: cannot take this GPU's tuning lock {path} ({type(e).__name__}: {e}); "
                               f"timing without it (another process timing at the same time skews both runs)")
        return None
    return lock


def tune(key: TuningKey, shape: TuneShape, prepare: tune_guard.Prepare, *, force: bool = False,
         device_index: int | None = None, progress: Progress | None = None,
         timer: Callable = tune_timing.time_launches, device: torch.device | None = None) -> TuningRecord:
    """Tune `key` at `shape`: guard, time and choose among the configuration space, store the record.

    Candidates already in the key's record keep their results unless `force`; the reference and the
    previous winner are timed again beside any new candidate. Raises BitwiseMismatch for a differing
    candidate with KDAJIT_STRICT_BITWISE=1, and RuntimeError when called where tuning is not allowed.
    `timer` and `device` (where the inputs live) are for stand-in kernels in the CPU tests.
    """
    if not may_tune():
        raise RuntimeError("kdajit cannot tune while a CUDA graph is being captured or torch.compile traces; "
                         "tune ahead of time (`kdajit tune`, kdajit.tune) and replay with the record")
    device_index = torch.cuda.current_device() if device_index is None else device_index
    device = torch.device("cuda", device_index) if device is None else device
    on_device = torch.cuda.device(device_index) if device.type == "cuda" else contextlib.nullcontext()
    with _LOCK, on_device:  # events and synchronisation on the GPU being tuned
        lock = _gpu_lock(device_index)
        try:
            previous = None if force else _read_disk(key, first_only=True) or find_record(key)
            if previous is not None and not _missing(previous):
                _remember(previous)  # another process tuned this key while we waited for the GPU
                record = previous
            else:
                record = _tune_locked(key, shape, prepare, previous, device, progress or (lambda *_: None), timer)
                _store(record)  # before the lock goes: the next process re-reads and adopts it
        finally:
            if lock is not None:
                lock.release()
        _FORCED.add(key)
        return record


def _tune_locked(key, shape, prepare, previous, device, progress, timer) -> TuningRecord:
    spec = key.spec
    buildable, pruned = candidates(spec)
    kept = {c: previous.result(c) for c in buildable if previous is not None and previous.result(c) is not None}
    retime = {REFERENCE} | ({previous.winner} if previous is not None else set())
    todo = [c for c in buildable if c not in kept or c in retime]
    t0 = time.perf_counter()
    def inputs(seed: int) -> tuple[str, tune_guard.Inputs]:
        return f"tuning-inputs-{seed}", tune_guard.make_problem(spec, shape.batch, shape.heads, tokens=shape.tokens,
                                                                lengths=shape.lengths, seed=seed, device=device)
    tuning = [inputs(0)]
    tuning += [inputs(seed) for seed in range(1, _input_sets(tuning[0][1], spec, device))]
    problems = tuning[:1] + tune_guard.probe_problems(spec, device)
    expected = tune_guard.reference_outputs(prepare, REFERENCE, problems, spec.output_qg, spec.chunk)
    results: dict[FusedConfig, CandidateResult] = {}
    for i, config in enumerate(todo):
        progress(i, 2 * len(todo), f"guard {config.slug()}")
        try:
            detail = None if config == REFERENCE else tune_guard.guard(prepare, config, problems, expected,
                                                                       spec.output_qg, spec.chunk)
        except Exception as e:  # noqa: BLE001 - e.g. KDAJIT_DISABLE_JIT and its kernel not cached: retried later
            _warn_once(f"skipped:{spec}:{config}", f"kdajit: tuning candidate {config.slug()} could not run "
                                                   f"({type(e).__name__}: {e}); left out of this record")
            continue
        if detail is None:
            results[config] = CandidateResult(config, "ok")
            continue
        results[config] = CandidateResult(config, "mismatch", detail)
        message = (f"kdajit: tuning candidate {config.slug()} of {spec.fused_key().spec_slug()} does not reproduce "
                   f"the reference configuration's bits ({detail}); it is excluded")
        if env.strict_bitwise():
            raise BitwiseMismatch(message + " (KDAJIT_STRICT_BITWISE=1)")
        _warn_once(f"mismatch:{spec}:{config}", message)
    passed = [c for c in todo if c in results and results[c].guard == "ok"]
    progress(len(todo), 2 * len(todo), f"time {len(passed)} candidates on {len(tuning)} input set(s)")
    outs = [tune_guard.poisoned_outputs(x, spec.output_qg, spec.chunk) for _, x in tuning]
    times = timer({c: [prepare(c, x, out) for (_, x), out in zip(tuning, outs)] for c in passed})
    for c in passed:
        results[c].ms = round(float(times[c]), 5)
    progress(2 * len(todo), 2 * len(todo), f"done in {time.perf_counter() - t0:.1f} s")
    every = [results.get(c) or kept[c] for c in buildable if c in results or c in kept]
    every += [CandidateResult(c, "unbuildable", "pruned: does not fit this specialization") for c in pruned]
    timed = {r.config: r.ms for r in every if r.guard == "ok" and r.ms is not None}
    winner = tune_timing.choose(list(FUSED_CONFIG_SPACE), timed)
    shape_doc = {"B": shape.batch, "T": shape.tokens, "H": shape.heads, "lengths": list(shape.lengths or [])}
    return TuningRecord(key, toolchain_fingerprint(), every, winner, REFERENCE, shape_doc)


def _input_sets(x: tune_guard.Inputs, spec: ForwardSpec, device: torch.device) -> int:
    """How many input sets like `x` (with their outputs) one timing pass walks to read past the L2."""
    rows = x["q"][..., 0].numel()  # B * T * H; every output is 16-bit, with one of these last dims
    outputs = rows * (2 * spec.chunk + (2 + spec.output_qg) * spec.head_k + spec.head_v) * 2
    per_set = sum(t.nbytes for t in x.values()) + outputs
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20) if device.type == "cuda" else 0
    return tune_timing.input_sets_needed(per_set, l2)


def _remember(record: TuningRecord) -> None:
    """Use `record` in this process from now on."""
    _RECORDS[record.key] = record
    _forget_choices()  # memoized choices of its bucket may have changed


def _store(record: TuningRecord) -> None:
    """Keep `record` for this process and publish it in the writable cache root (warned if that fails)."""
    _remember(record)
    roots = _roots()
    if not roots or not roots[0][1]:
        return
    try:
        tune_records.write_record(roots[0][0], record)
    except OSError as e:
        _warn_once("write", f"kdajit: cannot store the tuning record for {record.key.name()} under {roots[0][0]} "
                            f"({e}); this process keeps it in memory")


def records_of_toolchain() -> list[TuningRecord]:
    """Every usable record of this toolchain in the cache layers and this process (first layer wins)."""
    fp = toolchain_fingerprint()
    found: dict[TuningKey, TuningRecord] = {}
    for root, _ in _roots():
        for where in cache_layout.record_paths(root):
            if where.toolchain != fp:
                continue
            try:
                record = tune_records.load_record_file(root, where.relpath)
            except (OSError, ValueError):
                continue
            found.setdefault(record.key, record)
    for key, record in _RECORDS.items():
        found[key] = record
    return list(found.values())


def share_records(group=None, src: int = 0) -> int:
    """Make every rank of a torch.distributed process group adopt rank `src`'s tuning records (of this
    toolchain); call it on every rank, e.g. after `kdajit.tune` on `src`. Returns the records adopted
    (on `src`: the records sent). Each rank keeps them for the process and stores them in its
    writable cache root, so ranks never disagree on a configuration and `forward` never communicates."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    sender = dist.get_global_rank(group, src) if group is not None else src
    payload = [[r.to_json() for r in records_of_toolchain()] if rank == src else None]
    dist.broadcast_object_list(payload, src=sender, group=group)
    records = [TuningRecord.from_json(doc) for doc in payload[0]]  # all parse, or none is adopted
    with _LOCK:
        for record in records:
            if rank != src:
                _store(record)
            _FORCED.add(record.key)  # every rank keeps these, in force mode too
    return len(records)
