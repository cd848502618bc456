"""Input validation for the public API: every check runs before any kernel is launched.

Errors are ValueError (bad values, shapes, layouts), TypeError (bad dtypes or non-tensors) or
NotImplementedError (valid requests kdajit does not implement yet). Each message names the argument,
what it got and what is allowed. Device checks come last, so the CPU test suite can exercise every
other rule with CPU tensors.
"""
from __future__ import annotations

import math
import struct
import weakref
from dataclasses import dataclass

import torch

from kdajit import env
from kdajit.keys import ARG_ALIGNMENT, CHUNK_SIZES, HEAD_DIM_RULE, head_dim_supported
from kdajit.outputs import BETA_TORCH_DTYPES, CU_SEQLENS_TORCH_DTYPES, IO_TORCH_DTYPES

_BETA_DTYPES = {dtype: name for name, dtype in BETA_TORCH_DTYPES.items()}
_IO_DTYPES = {dtype: name for name, dtype in IO_TORCH_DTYPES.items()}
_CU_DTYPES = {dtype: name for name, dtype in CU_SEQLENS_TORCH_DTYPES.items()}
# kdajit's safe-gate contract: every per-token natural-log gate >= this (KDA's lower-bound gate).
SAFE_GATE_LOWER_BOUND = -5.0
_MAX_INDEX = 2**31 - 1  # also the CUDA grid x limit (chunks)
_MAX_GRID_YZ = 65535  # CUDA grid y (heads) and z (batch) limits
_FP32_MAX = 3.4028234663852886e38
# Base-address alignment (bytes) the kernels assume for each tensor argument: kdajit.keys' kernel argument
# definitions, from which the templates' fake tensors are built too (tests/test_validation.py checks both).
ALIGNMENT = ARG_ALIGNMENT
# Last dimension of each output, as a Problem field.
_OUTPUT_LAST_DIM = {"Aqk": "chunk", "Akk": "chunk", "w": "head_k", "u": "head_v", "kg": "head_k", "qg": "head_k"}


@dataclass(frozen=True)
class Problem:
    """The validated sizes of one call."""

    batch: int
    tokens: int
    heads: int  # HV: value heads (v, gk, beta, every output; the kernels' grid)
    head_k: int
    head_v: int
    chunk: int
    beta_dtype: str
    varlen: str
    io_dtype: str  # q, k, v and every output: kdajit.keys.IO_DTYPES
    qk_heads: int  # H: query / key heads; HV is a multiple of it (grouped value heads when HV > H)


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = " or ".join(_dtype_name(d) for d in allowed)
        raise TypeError(f"{name} must have dtype {names}, got {_dtype_name(t.dtype)}")


def _same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have dtype {_dtype_name(ref.dtype)} (the dtype of {ref_name}), got "
                        f"{_dtype_name(t.dtype)}")


def _shape(name: str, t: torch.Tensor, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must have shape {list(expected)} ({meaning}), got {list(t.shape)}")


def _layout(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {list(t.stride())} for shape {list(t.shape)}; "
                         f"call .contiguous() first")
    _address(name, t)


def _alignment(name: str, t: torch.Tensor) -> int:
    """The base-address alignment in bytes that argument `name` needs (at least its element size)."""
    return max(ALIGNMENT[name], t.element_size())


def _address(name: str, t: torch.Tensor) -> None:
    align = _alignment(name, t)
    if t.numel() and t.data_ptr() % align:
        raise ValueError(f"{name} must start at a {align}-byte aligned address, got {hex(t.data_ptr())} "
                         f"(a view into another tensor? use .clone())")


def _choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise NotImplementedError(f"{name}={value!r} is not supported yet; supported: {list(allowed)}")


def _head_dim(name: str, value: int) -> None:
    if not head_dim_supported(value):
        raise NotImplementedError(f"{name}={value!r} is not supported; supported: {HEAD_DIM_RULE}")


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


def check_scale(scale: float | None) -> None:
    """A given scale must be a Python number that stays finite in float32, as the kernels take it.

    None means K ** -0.5.
    """
    if scale is None:
        return
    if isinstance(scale, (torch.Tensor, bool)) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a finite Python float, got {type(scale).__name__} {_brief(scale)}")
    try:
        # float32 round to nearest, as the launch converts it; pack raises where the result is not finite.
        finite = math.isfinite(struct.unpack("f", struct.pack("f", float(scale)))[0])
    except OverflowError:
        finite = False
    if not finite:
        raise ValueError(f"scale must be a finite Python float that stays finite in float32 (|scale| <= "
                         f"{_FP32_MAX!r}), got {_brief(scale)}")


def _check_chunk_size(chunk_size: object) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be a Python int, got {type(chunk_size).__name__} {chunk_size!r}")
    _choice("chunk_size", chunk_size, CHUNK_SIZES)


def _check_grid(ref_name: str, batch: int, tokens: int, heads: int) -> None:
    """One CTA per (chunk, head, batch): heads are grid y and the batch grid z."""
    if tokens > _MAX_INDEX:
        raise ValueError(f"T={tokens} ({ref_name}.shape[1]) must be < 2**31")
    for size, dim, axis in ((heads, "H", "y"), (batch, "B", "z")):
        if size > _MAX_GRID_YZ:
            index = "BTH".index(dim)
            raise ValueError(f"{dim}={size} ({ref_name}.shape[{index}]) exceeds the CUDA grid limit: {dim} is grid "
                             f"{axis}, at most {_MAX_GRID_YZ}")


def _value_heads(gk: torch.Tensor, batch: int, tokens: int, qk_heads: int, head_k: int, ref_name: str) -> int:
    """HV from gk [B, T, HV, K]: a multiple of the q / k head count H (FLA's grouped value heads)."""
    shape = tuple(gk.shape)
    heads = shape[2] if gk.dim() == 4 else -1
    grouped = heads == qk_heads or (qk_heads > 0 and heads > 0 and heads % qk_heads == 0)
    if gk.dim() != 4 or (shape[0], shape[1], shape[3]) != (batch, tokens, head_k) or not grouped:
        raise ValueError(f"gk must have shape [B, T, HV, K] = [{batch}, {tokens}, HV, {head_k}] with HV a multiple "
                         f"of H={qk_heads} ({ref_name}.shape[2]; HV > H for grouped value heads), got {list(shape)}")
    return heads


def check_safe_gate(safe_gate: object) -> None:
    if not isinstance(safe_gate, bool):
        raise TypeError(
            f"safe_gate={safe_gate!r} must be a bool: True (every per-token log-gate >= -5, as KDA's lower-bound "
            f"gate guarantees: the fast path) or False (any gate <= 0)")


def _check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, tokens: int, chunk: int) -> str:
    _dtype("cu_seqlens", cu_seqlens, tuple(_CU_DTYPES))
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [N+1] with N >= 1 sequences, got shape "
                         f"{list(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B={batch}")
    grid_x = tokens // chunk + cu_seqlens.numel() - 1
    if grid_x > _MAX_INDEX:
        raise ValueError(f"cu_seqlens holds N={cu_seqlens.numel() - 1} sequences: the varlen grid T // chunk_size + N "
                         f"= {grid_x} exceeds the CUDA grid x limit {_MAX_INDEX}")
    _layout("cu_seqlens", cu_seqlens)
    _check_cu_values(cu_seqlens, tokens)
    return _CU_DTYPES[cu_seqlens.dtype]


# The cu_seqlens tensor whose values last passed (a weak reference), its version counter and T: a model's KDA layers
# share one cu_seqlens per step, so its values cross to the host (a synchronisation) once per step, not per layer.
_checked_cu: tuple = (None, None, None)


def _version(t: torch.Tensor) -> int | None:
    """t's version counter (torch bumps it on every in-place write through torch, views included); None for an
    inference tensor, which keeps none."""
    try:
        return t._version
    except RuntimeError:
        return None


def _cu_values(cu_seqlens: torch.Tensor) -> list[int]:
    """cu_seqlens' values on the host: a device-to-host copy, which waits for the GPU."""
    return cu_seqlens.tolist()


def _check_cu_values(cu_seqlens: torch.Tensor, tokens: int) -> None:
    """cu_seqlens' values: with KDAJIT_VALIDATE=strict on every call; with `full` (the default) only when they may
    have changed since they last passed: the tensor that passed last, unwritten since (the same object and version
    counter) and with the same T, is not read again; with `shapes` and during CUDA-graph capture never. The version
    counter sees every write made through torch's tensor operations; it misses writes that bypass them
    (torch.distributed collectives into the buffer, `.data`, DLPack / NumPy aliases, custom or Triton kernels,
    CUDA-graph replays), which `strict` catches. Values no check read cannot drive a kernel out of bounds (every
    kernel clamps them); they give wrong outputs at worst. While torch.compile traces, the tensor's identity is not
    part of the graph's guards, so every traced call reads the values."""
    global _checked_cu
    mode = env.validate_mode()
    if mode == "shapes" or _capturing():
        return
    remember = mode == "full" and not torch.compiler.is_compiling()
    ref, version, checked_tokens = _checked_cu
    version_now = _version(cu_seqlens) if remember else None
    if version_now is not None and ref is not None and ref() is cu_seqlens and version_now == version \
            and tokens == checked_tokens:
        return
    values = _cu_values(cu_seqlens)
    if values[0] != 0 or values[-1] != tokens:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={tokens}, got first={values[0]}, "
                         f"last={values[-1]}")
    steps = [b - a for a, b in zip(values, values[1:])]
    if min(steps) < 0:
        i = steps.index(min(steps))
        raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}]={values[i]} > "
                         f"cu_seqlens[{i + 1}]={values[i + 1]}")
    if version_now is not None:
        _checked_cu = (weakref.ref(cu_seqlens), version_now, tokens)


def _capturing() -> bool:
    # Reading cu_seqlens' values needs a device-to-host copy, which CUDA-graph capture forbids.
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_devices(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors on one CUDA device; returns it."""
    present = {n: t for n, t in tensors.items() if t is not None}
    first_name, first = next(iter(present.items()))
    if first.device.type != "cuda":
        raise ValueError(f"{first_name} must be a CUDA tensor, got device {first.device}; kdajit's kernels run on "
                         f"NVIDIA GPUs only (for checking without one, kdajit.reference.forward_reference evaluates "
                         f"the same outputs in fp64 on any device)")
    for name, t in present.items():
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}; all inputs must be "
                             f"on one CUDA device")
    return first.device


def _span(t: torch.Tensor) -> tuple[torch.device, int, int]:
    """(device, first byte, end byte) of a contiguous tensor."""
    return t.device, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _check_outputs(outputs: dict[str, object], problem: Problem, inputs: dict[str, torch.Tensor | None]) -> None:
    """The caller's `out=` buffers: exact shape, the inputs' dtype, contiguous, aligned, and disjoint from every
    input and from each other (a kernel reading bytes that another CTA writes would make the outputs depend on
    timing)."""
    if not outputs:
        return
    seen = [(name, _span(t)) for name, t in inputs.items() if t is not None and t.numel()]
    dtype = IO_TORCH_DTYPES[problem.io_dtype]
    for name, t in outputs.items():
        shape = [problem.batch, problem.tokens, problem.heads, getattr(problem, _OUTPUT_LAST_DIM[name])]
        if not isinstance(t, torch.Tensor) or list(t.shape) != shape or t.dtype != dtype \
                or not t.is_contiguous() or t.data_ptr() % ALIGNMENT[name]:
            got = (f"{_dtype_name(t.dtype)} {list(t.shape)} with strides {list(t.stride())} at "
                   f"{hex(t.data_ptr())}" if isinstance(t, torch.Tensor) else type(t).__name__)
            raise ValueError(f"out.{name} must be a contiguous, {ALIGNMENT[name]}-byte aligned {_dtype_name(dtype)} "
                             f"tensor (the inputs' dtype) of shape {shape}, got {got}")
        if not t.numel():
            continue
        device, start, end = _span(t)
        for other, (other_device, other_start, other_end) in seen:
            if device == other_device and start < other_end and other_start < end:
                raise ValueError(f"out.{name} overlaps {other} (bytes [{hex(start)}, {hex(end)}) and "
                                 f"[{hex(other_start)}, {hex(other_end)})): out= buffers must not alias an input "
                                 f"or another output")
        seen.append((f"out.{name}", (device, start, end)))


# Signatures of valid calls without `out=` -> (their Problem, the `_alignment` of each of _SIGNATURE_TENSORS, 1 where
# the call passed None: what `_address` checks on every call, computed once). Bounded (a server with many distinct lengths
# would add one per length); cleared when full.
_VALID_SIGNATURES: dict[tuple, tuple[Problem, tuple[int, ...]]] = {}
_SIGNATURE_TENSORS = ("q", "k", "v", "gk", "beta", "cu_seqlens")  # check_forward_inputs' tensors, in its order
_MAX_SIGNATURES = 1024


def _signature(*args) -> tuple | None:
    """What every check of `check_forward_inputs` reads, but the base addresses and cu_seqlens' values:
    each tensor's dtype, shape, strides and device, and the other arguments; None if an argument is
    neither a plain torch.Tensor nor None nor an int (subclasses, e.g. fake tensors with symbolic sizes,
    and wrong types take the full checks)."""
    parts = []
    for a in args:
        if type(a) is torch.Tensor:
            parts.append((a.dtype, a.shape, a.stride(), a.device))
        elif a is None or isinstance(a, int):
            parts.append(a)
        else:
            return None
    return tuple(parts)


def check_forward_inputs(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None, gk: torch.Tensor,
                         beta: torch.Tensor, cu_seqlens: torch.Tensor | None, chunk_size: int,
                         outputs: dict[str, object] | None = None, **more_tensors: torch.Tensor) -> Problem:
    """Validate the inputs of `forward`/`intra`/`recompute_w_u` (q or v may be None where optional).

    `outputs`: the caller's `out=` fields this call writes, by name ("Aqk", "w", ...). `more_tensors`
    (already checked by the caller) join the overlap and the final same-CUDA-device checks.
    Without either, a call whose tensors have the signature of an earlier valid call (`_signature`) only
    re-checks what the signature leaves out: the base addresses' alignment and cu_seqlens' values.
    """
    signature = None if outputs or more_tensors else _signature(q, k, v, gk, beta, cu_seqlens, chunk_size)
    known = _VALID_SIGNATURES.get(signature) if signature is not None else None
    if known is not None:
        problem, alignments = known
        for name, align, t in zip(_SIGNATURE_TENSORS, alignments, (q, k, v, gk, beta, cu_seqlens), strict=True):
            if t is not None and t.data_ptr() % align:
                _address(name, t)  # misaligned unless empty: raises with the full message
        if cu_seqlens is not None:
            _check_cu_values(cu_seqlens, problem.tokens)
        return problem
    k = _tensor("k", k)
    ref_name, ref = ("k", k) if q is None else ("q", _tensor("q", q))
    _dtype(ref_name, ref, tuple(_IO_DTYPES))
    if ref.dim() != 4:
        raise ValueError(f"{ref_name} must be 4-D [B, T, H, K], got shape {list(ref.shape)}")
    batch, tokens, qk_heads, head_k = ref.shape
    _check_grid(ref_name, batch, tokens, qk_heads)
    _head_dim(f"K ({ref_name}.shape[-1])", head_k)
    _check_chunk_size(chunk_size)
    gk = _tensor("gk", gk)
    beta = _tensor("beta", beta)
    _same_dtype("k", k, ref_name, ref)
    _shape("k", k, (batch, tokens, qk_heads, head_k), f"same as {ref_name}")
    _dtype("gk", gk, (torch.float32,))
    heads = _value_heads(gk, batch, tokens, qk_heads, head_k, ref_name)
    _check_grid("gk", batch, tokens, heads)
    _dtype("beta", beta, tuple(_BETA_DTYPES))
    _shape("beta", beta, (batch, tokens, heads), "[B, T, HV], HV = gk.shape[2]")
    head_v = head_k
    if v is not None:
        v = _tensor("v", v)
        _same_dtype("v", v, ref_name, ref)
        if v.dim() != 4 or tuple(v.shape[:3]) != (batch, tokens, heads):
            raise ValueError(f"v must have shape [B, T, HV, V] = [{batch}, {tokens}, {heads}, V] (HV = gk.shape[2]), "
                             f"got {list(v.shape)}")
        head_v = v.shape[3]
        _head_dim("V (v.shape[-1])", head_v)
    for name, t in (("q", q), ("k", k), ("v", v), ("gk", gk), ("beta", beta)):
        if t is not None:
            _layout(name, t)
    varlen = "dense"
    if cu_seqlens is not None:
        varlen = _check_cu_seqlens(_tensor("cu_seqlens", cu_seqlens), batch, tokens, chunk_size)
    problem = Problem(batch, tokens, heads, head_k, head_v, chunk_size, _BETA_DTYPES[beta.dtype], varlen,
                      _IO_DTYPES[ref.dtype], qk_heads)
    inputs = {ref_name: ref, "k": k, "v": v, "gk": gk, "beta": beta, "cu_seqlens": cu_seqlens, **more_tensors}
    outputs = outputs or {}
    _check_outputs(outputs, problem, inputs)
    check_devices(**inputs, **{f"out.{name}": t for name, t in outputs.items()})
    if signature is not None:
        if len(_VALID_SIGNATURES) >= _MAX_SIGNATURES:
            _VALID_SIGNATURES.clear()
        _VALID_SIGNATURES[signature] = (problem, tuple(
            _alignment(name, t) if t is not None else 1
            for name, t in zip(_SIGNATURE_TENSORS, (q, k, v, gk, beta, cu_seqlens), strict=True)))
    return problem


def check_recompute_inputs(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, Akk: torch.Tensor,
                           gk: torch.Tensor, q: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                           chunk_size: int, outputs: dict[str, object] | None = None) -> Problem:
    """Validate the inputs (and the `out=` fields it writes) of `recompute_w_u`."""
    Akk = _tensor("Akk", Akk)
    ref = k if q is None else q
    if isinstance(ref, torch.Tensor) and ref.dtype in _IO_DTYPES:
        _same_dtype("Akk", Akk, "k" if q is None else "q", ref)
    else:
        _dtype("Akk", Akk, tuple(_IO_DTYPES))
    if isinstance(ref, torch.Tensor) and ref.dim() == 4:
        heads = gk.shape[2] if isinstance(gk, torch.Tensor) and gk.dim() == 4 else ref.shape[2]
        _shape("Akk", Akk, (*ref.shape[:2], heads, chunk_size), "[B, T, HV, chunk_size], HV = gk.shape[2]")
    _layout("Akk", Akk)
    return check_forward_inputs(q, k, v, gk, beta, cu_seqlens, chunk_size, outputs, Akk=Akk)
