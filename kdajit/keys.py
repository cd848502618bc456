"""Specialization and compile keys: frozen dataclasses, and nothing else, decide what gets compiled.

`ForwardSpec` is what a user call selects (beta dtype, varlen mode, head dims, chunk size, QG on
request, SM arch, q/k/v dtype). Each kernel template has its own key class holding exactly the fields its
generated code depends on, plus its tunable config (`KernelConfig`; `FusedConfig` for the fused
kernel). Runtime shapes (B, T, H, N) are never in a key: the kernels take them as symbolic sizes.

This module is a leaf: it imports nothing from kdajit but kdajit.untuned_configs (the untuned defaults, which imports
nothing), so templates, the cache and the API can all use it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from typing import ClassVar

from kdajit import untuned_configs

BETA_DTYPES = ("bf16", "fp16", "fp32")
# dtype of q, k, v and of every 16-bit output (Aqk, Akk, W, U, KG, QG): the MMA operand type.
IO_DTYPES = ("bf16", "fp16")
# "dense": equal-length batch [B, T]; "cu32"/"cu64": packed sequences with int32/int64 cu_seqlens.
VARLEN_MODES = ("dense", "cu32", "cu64")
# K and V (any pair) are compile-time sizes of every template that reads them: a multiple of HEAD_DIM_STEP up to
# the last HEAD_DIMS entry. The kernels' shared tiles have one of the HEAD_DIMS sizes (`padded_head_dim`); a size
# between them (60, 100, ...) is padded inside the kernel: zero columns in shared memory, global accesses that stop
# at the row's end. HEAD_DIMS are what precompile and the compile sweep build by default; PADDED_HEAD_DIM_EXAMPLES
# stand for the padded sizes in the sweep and the GPU tests (FLA's own test sizes).
HEAD_DIMS = (64, 128, 256)
HEAD_DIM_STEP = 4  # every row then starts 8-byte aligned in 16-bit tensors (16-byte where K is a multiple of 8)
PADDED_HEAD_DIM_EXAMPLES = (60, 100)
CHUNK_SIZES = (32, 64)  # rows per chunk: each a specialization of every template
# Base-address alignment (bytes) the kernels assume: the fake tensors' `assumed_align` in
# templates/common.py `SymbolicShapes`. kdajit.validate checks exactly these before any launch.
TILE_ALIGN = 16  # [B, T, H, D] tensors: q, k, v, gk, Akk, the L workspace and every output
ROW_ALIGN = 4  # [B, T, H] tensors: beta (bf16 or fp32)
SEQ_ALIGN = 4  # cu_seqlens
ALIGN_BY_KIND = {"bthd": TILE_ALIGN, "bth": ROW_ALIGN, "seq": SEQ_ALIGN}  # per `KernelArg.kind`
ARCHS = ("sm_80", "sm_90a", "sm_100a")


def _check_choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not supported; expected one of {allowed}")


def head_dim_supported(size: object) -> bool:
    """Whether `size` can be K or V: a positive multiple of HEAD_DIM_STEP up to max(HEAD_DIMS)."""
    return (isinstance(size, int) and not isinstance(size, bool) and 0 < size <= HEAD_DIMS[-1]
            and size % HEAD_DIM_STEP == 0)


HEAD_DIM_RULE = f"an int, a multiple of {HEAD_DIM_STEP} from {HEAD_DIM_STEP} to {HEAD_DIMS[-1]}"


def padded_head_dim(size: int) -> int:
    """The columns of the kernels' shared tiles for head size `size`: the smallest HEAD_DIMS entry >= size."""
    return next(d for d in HEAD_DIMS if d >= size)


def _check_head_dim(name: str, value: object) -> None:
    if not head_dim_supported(value):
        raise ValueError(f"{name}={value!r} is not supported; expected {HEAD_DIM_RULE}")


@dataclass(frozen=True)
class KernelConfig:
    """Tunable launch configuration. Every config a template accepts must give identical bits.

    `warps`: warps per CTA. The reference config is the default instance.
    """

    warps: int = 4

    def slug(self) -> str:
        return f"w{self.warps}"


RASTER_ORDERS = ("chunk", "head")
LOADS_AHEAD = (0, 1)


@dataclass(frozen=True)
class FusedConfig:
    """Launch configuration of the fused forward kernel; every value gives identical bits.

    `persistent`: False = one (chunk, head) tile per CTA on the standalone kernels' grid; True = a
    grid of min(tiles, SMs * ctas_per_sm) CTAs that walk the tiles with a static stride (with `pingpong`, each of
    a CTA's two groups its own tiles).
    `ctas_per_sm`: resident CTAs per SM the persistent grid is sized for (and the occupancy the
    launch requests). `raster`: tile order of the persistent walk, "chunk" (chunk index fastest,
    the standalone grid's order) or "head" (head fastest: consecutive tiles read adjacent rows of
    [B, T, H, D] memory). `loads_ahead`: tiles whose loads a persistent CTA issues before it has
    finished the current one (0: load, then compute; 1: the next tile's inputs stream into the
    shared buffers the current tile has finished reading, while it computes W, U and stores).
    `warps`: 4 (every warp runs every phase) or 8 (two warp groups: the intra blocks spread over all
    8 warps; then warps 0-3 invert while warps 4-7 compute the gate rows, and warps 0-3 multiply W
    while warps 4-7 multiply U; only without QG and with loads_ahead 0), or, with `pingpong`, two groups of 4
    warps on two tiles.
    `gate_rows`: where a 4-warp persistent CTA with loads_ahead 1 and no QG runs the gate rows: "late" (after the
    inverse; the next tile's q is issued after the intra phase, the rest after the gate rows), "early" (right after
    the intra phase, Kp kept in registers until the inverse frees its buffer, so every load of the next tile is
    issued before the inverse) or "early-vbuf" (K = V: right after the intra phase without Vp, Kp into Vp's tile;
    the next tile's q goes out after the intra phase, k, g and beta before the inverse, v once Vp, computed after the
    inverse into the work region's Kp tile, has left its registers). "late" everywhere else.
    `intra_unroll`: head-dim steps per iteration of the intra blocks' mainloop in a persistent 4-warp CTA: 2 (the
    standalone intra kernel's and the other configurations' choice) or 1 (half the mainloop code: the persistent
    kernel's tile loop is large enough that the instruction cache feels its size; docs/performance.md, twenty-third
    session). The same operations in the same order either way.
    `stores`: how a 4-warp CTA at chunk 64 with K and V in HEAD_DIMS stores W and U from their staging tiles:
    "threads" (each thread its rows' 16-byte pieces) or "tma" (the staging tiles as 64-column panels of the 128-byte
    swizzle; a warp whose 16 rows are all valid stores them as one TMA box per panel, a partial warp as "threads").
    Data movement only.
    `pingpong`: "off", or two tiles at once in one persistent CTA of 8 warps (one CTA per SM, loads_ahead 1): warps
    0-3 and 4-7 are two groups of 4, each walking its own tiles through its own shared memory with the 4-warp
    schedule (what `gate_rows`, `intra_unroll` and `stores` say of a 4-warp CTA holds for each group) ("free"), or
    also taking turns at the intra phase, so that one group's intra blocks run beside the other's inverse and
    recompute ("intra"), or at the inverse ("inverse"). The same per-tile functions on the same operands as the
    4-warp CTA.
    Non-persistent configs keep the defaults of the other fields but `warps`.
    The reference configuration is the default instance.
    """

    persistent: bool = False
    ctas_per_sm: int = 2
    raster: str = "chunk"
    loads_ahead: int = 0
    warps: int = 4
    gate_rows: str = "late"
    intra_unroll: int = 2
    stores: str = "threads"
    pingpong: str = "off"

    def slug(self) -> str:
        warps = f"-w{self.warps}" if self.warps != 4 else ""
        if not self.persistent:
            return "tile" + warps
        ahead = f"-a{self.loads_ahead}" if self.loads_ahead else ""
        early = {"early": "-ge", "early-vbuf": "-gv"}.get(self.gate_rows, "")
        rolled = f"-r{self.intra_unroll}" if self.intra_unroll != 2 else ""
        stores = "-ts" if self.stores == "tma" else ""
        pingpong = {"free": "-ppf", "intra": "-pp", "inverse": "-ppi"}.get(self.pingpong, "")
        return f"persistent-c{self.ctas_per_sm}-{self.raster}{ahead}{warps}{early}{rolled}{stores}{pingpong}"


FUSED_WARPS = (4, 8)
GATE_ROWS = ("late", "early", "early-vbuf")
INTRA_UNROLLS = (2, 1)
STORE_PATHS = ("threads", "tma")
PINGPONG_MODES = ("off", "free", "intra", "inverse")
# The fused kernel's declared configuration space (what the full compile sweep builds, the bitwise
# GPU tests run and the autotuner may choose from); the reference configuration comes first.
FUSED_CONFIG_SPACE = (FusedConfig(),) + tuple(
    FusedConfig(True, ctas, raster, ahead) for ahead in LOADS_AHEAD for ctas in (1, 2) for raster in RASTER_ORDERS
) + (FusedConfig(warps=8),) + tuple(FusedConfig(True, ctas, "head", 0, 8) for ctas in (1, 2)) + tuple(
    FusedConfig(True, ctas, "head", 1, gate_rows=early) for early in GATE_ROWS[1:] for ctas in (1, 2)) + tuple(
    FusedConfig(True, ctas, "head", 1, gate_rows=rows, intra_unroll=1) for rows in GATE_ROWS for ctas in (1, 2)
) + tuple(FusedConfig(True, 2, "head", 1, gate_rows=rows, intra_unroll=unroll, stores="tma")
          for rows, unroll in (("late", 2), ("late", 1), ("early-vbuf", 2)))
# Configurations outside the space, buildable and bit-tested on the GPU (tests/test_gpu_fused.py) but not tuned: a knob
# joins the space once its GPU tests have passed on a card (docs/performance.md). `pingpong`: built 2026-12-08, not yet
# run on a GPU.
FUSED_PROBE_CONFIGS = tuple(FusedConfig(True, 1, "head", 1, 8, gate_rows=rows, pingpong=mode)
                            for rows, mode in (("late", "free"), ("late", "intra"), ("late", "inverse"),
                                               ("early-vbuf", "intra")))


@dataclass(frozen=True)
class KernelArg:
    """One argument of a kernel: the single definition its template's fake arguments and the API's
    launch are both built from (by name, so two same-typed tensors cannot be swapped).

    `name`: the API's name (kdajit.validate.ALIGNMENT's for tensors). `kind`: "bthd" ([B, T, H, D],
    D the key field `last`), "bth" ([B, T, H]), "seq" ([N + 1] vector) or "scalar". `dtype`: "io" (the
    key's io_dtype: bf16 or fp16), "fp32", "int32", "beta" (the key's beta dtype) or "cu" (its
    cu_seqlens dtype). `qg_only`: read or
    written only when the key's output_qg is set; otherwise it has sizes of its own, so the API may
    pass a small dummy. `qk_heads`: H is the query/key head count (q, k), which grouped value heads
    let differ from the value head count HV of every other [B, T, H, ...] tensor (HV a multiple of H)."""

    name: str
    kind: str
    dtype: str
    last: str = ""
    qg_only: bool = False
    qk_heads: bool = False


_FLAGS = ("qg_only", "qk_heads")


def _args(*specs: str) -> tuple[KernelArg, ...]:
    """KernelArgs from "name:kind:dtype[:last][:qg_only][:qk_heads]" words."""
    out = []
    for spec in specs:
        name, kind, dtype, *rest = spec.split(":")
        last = [word for word in rest if word not in _FLAGS]
        out.append(KernelArg(name, kind, dtype, last[0] if last else "", "qg_only" in rest, "qk_heads" in rest))
    return tuple(out)


_SEQ = ("cu_seqlens:seq:cu",)
_WU_OUTPUTS = ("w:bthd:io:head_k", "u:bthd:io:head_v", "kg:bthd:io:head_k", "qg:bthd:io:head_k:qg_only")


@dataclass(frozen=True)
class _KernelKey:
    """Common behaviour of the per-template compile keys."""

    TEMPLATE: ClassVar[str] = ""
    CONFIG: ClassVar[type] = KernelConfig
    # The kernel's arguments in order (the template's __call__ takes them so, then the stream).
    ARGS: ClassVar[tuple[KernelArg, ...]] = ()

    def to_json(self) -> dict:
        """Canonical JSON form (stable field order), used for hashing and metadata."""
        d = dataclasses.asdict(self)
        d["template"] = self.TEMPLATE
        return d

    def spec_slug(self) -> str:
        """Human-readable name of the specialization part (no arch, no config)."""
        parts = []
        for f in dataclasses.fields(self):
            if f.name in ("arch", "config"):
                continue
            v = getattr(self, f.name)
            parts.append(f"{f.name}-{str(v).lower()}")
        return f"{self.TEMPLATE}." + ".".join(parts)

    def canonical(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class IntraKey(_KernelKey):
    """Aqk and the strict-lower L workspace (fp32) for one (chunk, head) per CTA."""

    TEMPLATE: ClassVar[str] = "intra"
    ARGS: ClassVar[tuple[KernelArg, ...]] = _args(
        "q:bthd:io:head_k:qk_heads", "k:bthd:io:head_k:qk_heads", "gk:bthd:fp32:head_k", "beta:bth:beta",
        "Aqk:bthd:io:chunk", "L:bthd:fp32:chunk", *_SEQ, "scale:scalar:fp32")
    beta_dtype: str
    varlen: str
    head_k: int
    chunk: int
    arch: str
    config: KernelConfig = KernelConfig()
    io_dtype: str = "bf16"
    safe_gate: bool = True


@dataclass(frozen=True)
class AkkInverseKey(_KernelKey):
    """Akk = (I + L)^-1 from the fp32 L workspace."""

    TEMPLATE: ClassVar[str] = "akk_inverse"
    ARGS: ClassVar[tuple[KernelArg, ...]] = _args("L:bthd:fp32:chunk", "Akk:bthd:io:chunk", *_SEQ)
    varlen: str
    chunk: int
    arch: str
    config: KernelConfig = KernelConfig()
    io_dtype: str = "bf16"


@dataclass(frozen=True)
class _Specialization:
    """The fields of a specialization that every kernel of it but intra and the inverse depends on, in key order:
    the user-level `ForwardSpec` and the keys of the recompute and fused kernels."""

    beta_dtype: str
    varlen: str
    head_k: int
    head_v: int
    chunk: int
    output_qg: bool
    arch: str


@dataclass(frozen=True)
class _SpecKey(_KernelKey, _Specialization):
    """The key of a kernel that depends on every part of the specialization (recompute, fused)."""


@dataclass(frozen=True)
class RecomputeWUKey(_SpecKey):
    """W, U, KG (and QG when `output_qg`) from Akk."""

    TEMPLATE: ClassVar[str] = "recompute_wu"
    ARGS: ClassVar[tuple[KernelArg, ...]] = _args(
        "k:bthd:io:head_k:qk_heads", "v:bthd:io:head_v", "beta:bth:beta", "Akk:bthd:io:chunk",
        "gk:bthd:fp32:head_k", "q:bthd:io:head_k:qg_only:qk_heads", *_WU_OUTPUTS, *_SEQ)
    config: KernelConfig = KernelConfig()
    io_dtype: str = "bf16"


@dataclass(frozen=True)
class FusedForwardKey(_SpecKey):
    """The whole forward intra stage (Aqk, Akk, W, U, KG, QG when `output_qg`) in one kernel."""

    TEMPLATE: ClassVar[str] = "fused_forward"
    ARGS: ClassVar[tuple[KernelArg, ...]] = _args(
        "q:bthd:io:head_k:qk_heads", "k:bthd:io:head_k:qk_heads", "v:bthd:io:head_v", "gk:bthd:fp32:head_k",
        "beta:bth:beta", "Aqk:bthd:io:chunk", "Akk:bthd:io:chunk", *_WU_OUTPUTS, *_SEQ, "scale:scalar:fp32",
        "max_ctas:scalar:int32")
    CONFIG: ClassVar[type] = FusedConfig
    config: FusedConfig = FusedConfig()
    io_dtype: str = "bf16"
    safe_gate: bool = True


KEY_TYPES = {k.TEMPLATE: k for k in (IntraKey, AkkInverseKey, RecomputeWUKey, FusedForwardKey)}
# Base-address alignment of every tensor argument of every kernel, by the API's name.
ARG_ALIGNMENT = {arg.name: ALIGN_BY_KIND[arg.kind] for key_type in KEY_TYPES.values() for arg in key_type.ARGS
                 if arg.kind in ALIGN_BY_KIND}
assert all(ALIGN_BY_KIND[arg.kind] == ARG_ALIGNMENT[arg.name] for key_type in KEY_TYPES.values()
           for arg in key_type.ARGS if arg.kind in ALIGN_BY_KIND), "one argument name with two kinds"
# Archs on which `kdajit.forward` runs the fused kernel (elsewhere: intra + inverse + recompute).
FUSED_ARCHS = ("sm_90a",)


def key_from_json(d: dict) -> _KernelKey:
    """Inverse of `_KernelKey.to_json`; raises ValueError on an unknown template or field."""
    d = dict(d)
    template = d.pop("template", None)
    if template not in KEY_TYPES:
        raise ValueError(f"template={template!r} is not a kdajit kernel; expected one of {tuple(KEY_TYPES)}")
    key_type = KEY_TYPES[template]
    d["config"] = key_type.CONFIG(**d.get("config", {}))
    return key_type(**d)


@dataclass(frozen=True)
class ForwardSpec(_Specialization):
    """One user-level specialization of the forward intra stage.

    `safe_gate`: True for the fast path that assumes KDA's lower-bound gate (every per-token log-gate >= -5);
    False for the any-gate path (diagonal blocks as 3xTF32 products where the gate drops little inside a 16-row
    block, else by per-pair exponentials in fp32: finite for every gate <= 0; docs/numerics.md). The two give
    different bits; each is exact in its own order.
    """

    io_dtype: str = "bf16"
    safe_gate: bool = True

    def __post_init__(self) -> None:
        _check_choice("io_dtype (q, k, v dtype)", self.io_dtype, IO_DTYPES)
        _check_choice("beta_dtype", self.beta_dtype, BETA_DTYPES)
        _check_choice("varlen", self.varlen, VARLEN_MODES)
        _check_head_dim("head_k (K)", self.head_k)
        _check_head_dim("head_v (V)", self.head_v)
        _check_choice("chunk_size", self.chunk, CHUNK_SIZES)
        _check_choice("arch", self.arch, ARCHS)
        if not isinstance(self.output_qg, bool):
            raise ValueError(f"output_qg={self.output_qg!r} must be a bool")
        if not isinstance(self.safe_gate, bool):
            raise ValueError(f"safe_gate={self.safe_gate!r} must be a bool")

    def intra_key(self, config: KernelConfig = KernelConfig()) -> IntraKey:
        return IntraKey(self.beta_dtype, self.varlen, self.head_k, self.chunk, self.arch, config, self.io_dtype,
                        self.safe_gate)

    def inverse_key(self, config: KernelConfig = KernelConfig()) -> AkkInverseKey:
        return AkkInverseKey(self.varlen, self.chunk, self.arch, config, self.io_dtype)

    def recompute_key(self, config: KernelConfig = KernelConfig()) -> RecomputeWUKey:
        return RecomputeWUKey(self.beta_dtype, self.varlen, self.head_k, self.head_v, self.chunk,
                              self.output_qg, self.arch, config, self.io_dtype)

    def fused_key(self, config: FusedConfig = FusedConfig()) -> FusedForwardKey:
        return FusedForwardKey(self.beta_dtype, self.varlen, self.head_k, self.head_v, self.chunk,
                               self.output_qg, self.arch, config, self.io_dtype, self.safe_gate)

    @property
    def uses_fused(self) -> bool:
        """Whether this spec's arch has the fused kernel (built, bit-tested, and what `kdajit.forward` runs
        unless `untuned_fused_config` is None)."""
        return self.arch in FUSED_ARCHS

    @functools.cached_property
    def untuned_fused_config(self) -> FusedConfig | None:
        """The fused configuration `kdajit.forward` runs for this spec without a tuning record, or None where it
        runs the standalone kernels: `kdajit.untuned_configs`, outside the toolchain fingerprint (a default changes
        no kernel's code). Computed once per spec: `forward` asks on every call."""
        fields = untuned_configs.untuned_fields(self.chunk, self.head_k, self.head_v, padded_head_dim(self.head_k),
                                                self.output_qg)
        return None if fields is None else FusedConfig(**fields)

    def kernel_keys(self) -> tuple[_KernelKey, ...]:
        """The keys of every kernel the API runs for this spec without a tuning record: the standalone
        intra, inverse and recompute (`intra`, `recompute_w_u`, and `forward` off the fused route) in
        their reference configurations and, on the fused archs, the fused kernel in its reference
        configuration and, where that differs, in `untuned_fused_config`."""
        standalone = (self.intra_key(), self.inverse_key(), self.recompute_key())
        if not self.uses_fused:
            return standalone
        untuned = self.untuned_fused_config
        fused = dict.fromkeys((self.fused_key(),) + ((self.fused_key(untuned),) if untuned is not None else ()))
        return standalone + tuple(fused)
