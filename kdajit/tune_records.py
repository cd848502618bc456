"""Tuning records: which configuration of the fused kernel is fastest for one workload on one GPU model.

A record is keyed by a `TuningKey`: the specialization (with its SM arch), the GPU model (device
name and SM count), the toolchain (the record lives in that toolchain's directory, beside the
kernels it timed) and a `WorkloadBucket`, so a new sequence length does not re-tune. It keeps every
candidate's guard result and time, so a configuration added to the space later is the only one
timed then. Records are small JSON files written atomically (one file per key, private like every
cache file) and read bounded; a record that does not parse, or names a configuration outside
today's space, is refused with the reason, never half-used.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from kdajit import cache_files, cache_layout
from kdajit.cache_entry import parse_json, utc_now
from kdajit.cache_publish import makedirs_private
from kdajit.keys import FUSED_CONFIG_SPACE, ForwardSpec, FusedConfig

FORMAT = "kdajit-tuning-record"
SCHEMA = 1
MAX_RECORD_BYTES = 1 << 20
GUARD_RESULTS = ("ok", "mismatch", "unbuildable")


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def _exact(value, kind: type, what: str):
    """`value` if its type is exactly `kind` (so 2.0 or True never stand in for 2), else ValueError."""
    if type(value) is not kind:
        raise ValueError(f"{what}={value!r} must be a {kind.__name__}")
    return value


def config_from_json(d: object) -> FusedConfig:
    """The configuration of the space that `d` spells exactly (field names and types), else ValueError."""
    if not isinstance(d, dict):
        raise ValueError(f"config={d!r} must be an object")
    fields = {f.name: f.type for f in dataclasses.fields(FusedConfig)}
    if set(d) != set(fields):
        raise ValueError(f"config fields {sorted(d)}; expected {sorted(fields)}")
    defaults = dataclasses.asdict(FusedConfig())
    config = FusedConfig(**{name: _exact(d[name], type(defaults[name]), f"config.{name}") for name in fields})
    for member in FUSED_CONFIG_SPACE:
        if member == config:
            return member
    raise ValueError(f"config {config.slug()} is not in today's configuration space")


def bucket_parts(tokens: int, heads: int, seqs: int) -> tuple[int, int, int]:
    """(tokens, heads, seqs) of a call's workload bucket: tokens and sequences rounded up to powers of two."""
    return pow2_ceil(tokens), heads, pow2_ceil(seqs)


@dataclass(frozen=True)
class WorkloadBucket:
    """The part of a call's runtime shape that tuning depends on: total tokens (B * T, rounded up to
    a power of two), heads (exact) and sequences (B, or N with cu_seqlens; rounded up to a power of two)."""

    tokens: int
    heads: int
    seqs: int

    @classmethod
    def of(cls, tokens: int, heads: int, seqs: int) -> WorkloadBucket:
        return cls(*bucket_parts(tokens, heads, seqs))

    def slug(self) -> str:
        return f"t{self.tokens}-h{self.heads}-s{self.seqs}"


def device_slug(name: str) -> str:
    """A GPU model name as a file-name part ("NVIDIA H200" -> "NVIDIA_H200")."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.-")[:60] or "gpu"


@dataclass(frozen=True)
class TuningKey:
    """What a tuning record is valid for (the toolchain is its directory: see `record_relpath`)."""

    spec: ForwardSpec
    device: str
    sms: int
    bucket: WorkloadBucket

    def name(self) -> str:
        return f"{device_slug(self.device)}-sm{self.sms}.{self.bucket.slug()}"

    def to_json(self) -> dict:
        return {"spec": dataclasses.asdict(self.spec), "device": self.device, "sms": self.sms,
                "bucket": dataclasses.asdict(self.bucket)}

    @classmethod
    def from_json(cls, d: dict) -> TuningKey:
        spec = {f.name: _exact(d["spec"][f.name], type(getattr(_SPEC_TYPES, f.name)), f"spec.{f.name}")
                for f in dataclasses.fields(ForwardSpec)}
        bucket = {f.name: _exact(d["bucket"][f.name], int, f"bucket.{f.name}")
                  for f in dataclasses.fields(WorkloadBucket)}
        return cls(ForwardSpec(**spec), _exact(d["device"], str, "device"), _exact(d["sms"], int, "sms"),
                   WorkloadBucket(**bucket))


_SPEC_TYPES = ForwardSpec("bf16", "dense", 128, 128, 64, False, "sm_90a")  # the type of each spec field


@dataclass
class CandidateResult:
    """One configuration's outcome: `guard` is "ok" (bitwise equal to the reference on every input),
    "mismatch" (`detail` names the first differing output and index) or "unbuildable"; `ms` is its
    median time (None unless the guard passed)."""

    config: FusedConfig
    guard: str
    detail: str = ""
    ms: float | None = None

    def to_json(self) -> dict:
        return {"config": dataclasses.asdict(self.config), "slug": self.config.slug(), "guard": self.guard,
                "detail": self.detail, "ms": self.ms}

    @classmethod
    def from_json(cls, d: dict) -> CandidateResult:
        guard = d["guard"]
        if guard not in GUARD_RESULTS:
            raise ValueError(f"guard={guard!r}; expected one of {GUARD_RESULTS}")
        ms = d.get("ms")
        if ms is not None and (type(ms) not in (int, float) or not ms > 0):
            raise ValueError(f"ms={ms!r} must be a positive number or null")
        return cls(config_from_json(d["config"]), guard, _exact(d.get("detail", ""), str, "detail"), ms)


@dataclass
class TuningRecord:
    """The outcome of tuning one `TuningKey`: every candidate, the reference, the winner."""

    key: TuningKey
    toolchain: str
    candidates: list[CandidateResult]
    winner: FusedConfig
    reference: FusedConfig = FusedConfig()
    shape: dict = field(default_factory=dict)  # the shape that was timed (B, T, H, lengths)
    created_at: str = field(default_factory=utc_now)

    def result(self, config: FusedConfig) -> CandidateResult | None:
        return next((c for c in self.candidates if c.config == config), None)

    @property
    def speedup(self) -> float | None:
        """Reference time / winner time (1.0 when the reference won)."""
        ref, win = self.result(self.reference), self.result(self.winner)
        if ref is None or win is None or not ref.ms or not win.ms:
            return None
        return ref.ms / win.ms

    def to_json(self) -> dict:
        return {"format": FORMAT, "schema": SCHEMA, "key": self.key.to_json(), "toolchain": self.toolchain,
                "reference": dataclasses.asdict(self.reference), "winner": dataclasses.asdict(self.winner),
                "winner_slug": self.winner.slug(), "speedup_vs_reference": self.speedup, "shape": self.shape,
                "created_at": self.created_at, "candidates": [c.to_json() for c in self.candidates]}

    @classmethod
    def from_json(cls, d: object) -> TuningRecord:
        """Parse a record; ValueError naming what is wrong (unknown format, fields or types, a
        configuration outside today's space, or a winner that is not an "ok" candidate)."""
        found = (d.get("format"), d.get("schema")) if isinstance(d, dict) else type(d).__name__
        if not isinstance(d, dict) or found != (FORMAT, SCHEMA):
            raise ValueError(f"not a {FORMAT} of schema {SCHEMA} (found {found!r})")
        try:
            candidates = [CandidateResult.from_json(c) for c in d["candidates"]]
            record = cls(TuningKey.from_json(d["key"]), _exact(d["toolchain"], str, "toolchain"), candidates,
                         config_from_json(d["winner"]), config_from_json(d["reference"]),
                         dict(d.get("shape") or {}), str(d.get("created_at", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed record ({type(e).__name__}: {e})") from None
        won = record.result(record.winner)
        if record.reference != FUSED_CONFIG_SPACE[0] or won is None or won.guard != "ok" or won.ms is None:
            raise ValueError(f"winner {record.winner.slug()} is not a guarded, timed candidate (or the reference is "
                             f"not {FUSED_CONFIG_SPACE[0].slug()})")
        return record


def record_relpath(key: TuningKey, fingerprint: str) -> str:
    return cache_layout.record_relpath(key.spec.fused_key().spec_slug(), key.name(), key.spec.arch, fingerprint)


def _read_checked(root: Path, relpath: str) -> TuningRecord:
    """Parse the record file `root/relpath` after the cache's trust checks (the root and every directory
    down to the file ours and private, the file a regular one of ours, bounded). Raises
    FileNotFoundError, cache_files.UnsafeFile (an OSError) or ValueError."""
    problem = cache_files.root_problem(root)
    if problem:
        raise cache_files.UnsafeFile(errno.EPERM, problem, str(root))
    problem = cache_files.unsafe_dirs(root, cache_layout.parse_record_relpath(relpath).parent_relpath)
    if problem:
        raise cache_files.UnsafeFile(errno.EPERM, problem, str(root / relpath))
    return TuningRecord.from_json(parse_json(cache_files.read_regular(root / relpath, MAX_RECORD_BYTES)))


def read_record(root: Path, key: TuningKey, fingerprint: str) -> TuningRecord | None:
    """The record for `key` under `root`, None when there is none; ValueError or OSError (another
    user's file or directory, a link, oversized, malformed) when one is there but cannot be used."""
    relpath = record_relpath(key, fingerprint)
    try:
        record = _read_checked(root, relpath)
    except FileNotFoundError:
        return None
    if record.key != key or record.toolchain != fingerprint:
        raise ValueError(f"{root / relpath} holds the record of {record.key.name()} (tc-{record.toolchain}), "
                         f"not of {key.name()} (tc-{fingerprint})")
    return record


def record_bytes(record: TuningRecord) -> bytes:
    """A record's file content (canonical JSON)."""
    return json.dumps(record.to_json(), indent=1, sort_keys=True).encode()


def write_record(root: Path, record: TuningRecord) -> Path:
    """Publish `record` (atomic replace of the key's file, private directories). Raises OSError."""
    relpath = record_relpath(record.key, record.toolchain)
    parent = makedirs_private(root, cache_layout.parse_record_relpath(relpath).parent_relpath)
    path = parent / relpath.rsplit("/", 1)[1]
    cache_files.write_file_atomic(path, record_bytes(record))
    return path


def load_record_file(root: Path, relpath: str) -> TuningRecord:
    """A record found by a listing (`cache_layout.record_paths`), parsed; raises like `read_record`."""
    return _read_checked(root, relpath)
