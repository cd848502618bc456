"""Input validation for the public API: every check runs before any kernel is launched.

Errors are ValueError (bad values, shapes, layouts), TypeError (bad dtypes or non-tensors) or
NotImplementedError (valid requests kdajit does not implement yet). Each message names the argument,
what it got and what is allowed. Device checks come last, so the CPU test suite can exercise every
other rule with CPU tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kdajit import env
from kdajit.keys import CHUNK_SIZES, HEAD_DIMS
from kdajit.outputs import BETA_TORCH_DTYPES

_BETA_DTYPES = {dtype: name for name, dtype in BETA_TORCH_DTYPES.items()}
_CU_DTYPES = {torch.int32: "cu32", torch.int64: "cu64"}
_MAX_INDEX = 2**31 - 1


@dataclass(frozen=True)
class Problem:
    """The validated sizes of one call."""

    batch: int
    tokens: int
    heads: int
    head_k: int
    head_v: int
    chunk: int
    beta_dtype: str
    varlen: str


def _tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def _dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        names = " or ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must have dtype {names}, got {str(t.dtype).replace('torch.', '')}")


def _shape(name: str, t: torch.Tensor, expected: tuple[int, ...], meaning: str) -> None:
    if tuple(t.shape) != expected:
        raise ValueError(f"{name} must have shape {list(expected)} ({meaning}), got {list(t.shape)}")


def _layout(name: str, t: torch.Tensor, align: int) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {list(t.stride())} for shape {list(t.shape)}; "
                         f"call .contiguous() first")
    if t.numel() and t.data_ptr() % align:
        raise ValueError(f"{name} must start at a {align}-byte aligned address, got {hex(t.data_ptr())} "
                         f"(a view into another tensor? use .clone())")


def _choice(name: str, value: object, allowed: tuple) -> None:
    if value not in allowed:
        raise NotImplementedError(f"{name}={value!r} is not supported yet; supported: {list(allowed)}")


def check_scale(scale: float | None) -> None:
    """A given scale must be a finite Python number (None means K ** -0.5)."""
    if scale is None:
        return
    if isinstance(scale, (torch.Tensor, bool)) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite Python float, got {scale!r}")


def check_safe_gate(safe_gate: object) -> None:
    if safe_gate is not True:
        raise NotImplementedError(
            f"safe_gate={safe_gate!r}: kdajit implements only the safe-gate path (every per-token log-gate "
            f">= -5, as KDA's lower-bound gate guarantees; pass safe_gate=True). The exact path for "
            f"arbitrary gates is not implemented yet.")


def _check_cu_seqlens(cu_seqlens: torch.Tensor, batch: int, tokens: int) -> str:
    _dtype("cu_seqlens", cu_seqlens, tuple(_CU_DTYPES))
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [N+1] with N >= 1 sequences, got shape "
                         f"{list(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B={batch}")
    _layout("cu_seqlens", cu_seqlens, cu_seqlens.element_size())
    if env.validate_mode() == "full" and not _capturing():
        values = cu_seqlens.tolist()
        if values[0] != 0 or values[-1] != tokens:
            raise ValueError(f"cu_seqlens must start at 0 and end at T={tokens}, got first={values[0]}, "
                             f"last={values[-1]}")
        steps = [b - a for a, b in zip(values, values[1:])]
        if min(steps) < 0:
            i = steps.index(min(steps))
            raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}]={values[i]} > "
                             f"cu_seqlens[{i + 1}]={values[i + 1]}")
    return _CU_DTYPES[cu_seqlens.dtype]


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


def check_forward_inputs(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None, gk: torch.Tensor,
                         beta: torch.Tensor, cu_seqlens: torch.Tensor | None, chunk_size: int,
                         **more_tensors: torch.Tensor) -> Problem:
    """Validate the inputs of `forward`/`intra`/`recompute_w_u` (q or v may be None where optional).

    `more_tensors` (already checked by the caller) join the final same-CUDA-device check.
    """
    k = _tensor("k", k)
    ref_name, ref = ("k", k) if q is None else ("q", _tensor("q", q))
    _dtype(ref_name, ref, (torch.bfloat16,))
    if ref.dim() != 4:
        raise ValueError(f"{ref_name} must be 4-D [B, T, H, K], got shape {list(ref.shape)}")
    batch, tokens, heads, head_k = ref.shape
    _choice(f"K ({ref_name}.shape[-1])", head_k, HEAD_DIMS)
    _choice("chunk_size", chunk_size, CHUNK_SIZES)
    gk = _tensor("gk", gk)
    beta = _tensor("beta", beta)
    _dtype("k", k, (torch.bfloat16,))
    _shape("k", k, (batch, tokens, heads, head_k), f"same as {ref_name}")
    _dtype("gk", gk, (torch.float32,))
    _shape("gk", gk, (batch, tokens, heads, head_k), f"same as {ref_name}")
    _dtype("beta", beta, tuple(_BETA_DTYPES))
    _shape("beta", beta, (batch, tokens, heads), "[B, T, H]")
    head_v = head_k
    if v is not None:
        v = _tensor("v", v)
        _dtype("v", v, (torch.bfloat16,))
        if v.dim() != 4 or tuple(v.shape[:3]) != (batch, tokens, heads):
            raise ValueError(f"v must have shape [B, T, H, V] = [{batch}, {tokens}, {heads}, V], got "
                             f"{list(v.shape)}")
        head_v = v.shape[3]
        _choice("V (v.shape[-1])", head_v, HEAD_DIMS)
    for name, t in (("q", q), ("k", k), ("v", v), ("gk", gk)):
        if t is not None:
            _layout(name, t, 16)
    _layout("beta", beta, beta.element_size())
    if tokens > _MAX_INDEX:
        raise ValueError(f"T={tokens} must be < 2**31")
    varlen = "dense"
    if cu_seqlens is not None:
        varlen = _check_cu_seqlens(_tensor("cu_seqlens", cu_seqlens), batch, tokens)
    check_devices(**{ref_name: ref, "k": k, "v": v, "gk": gk, "beta": beta, "cu_seqlens": cu_seqlens},
                  **more_tensors)
    return Problem(batch, tokens, heads, head_k, head_v, chunk_size, _BETA_DTYPES[beta.dtype], varlen)


def check_recompute_inputs(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, Akk: torch.Tensor,
                           gk: torch.Tensor, q: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                           chunk_size: int) -> Problem:
    """Validate the inputs of `recompute_w_u`."""
    Akk = _tensor("Akk", Akk)
    _dtype("Akk", Akk, (torch.bfloat16,))
    ref = k if q is None else q
    if isinstance(ref, torch.Tensor) and ref.dim() == 4:
        expected = (*ref.shape[:3], chunk_size)
        _shape("Akk", Akk, expected, "[B, T, H, chunk_size]")
    _layout("Akk", Akk, 16)
    return check_forward_inputs(q, k, v, gk, beta, cu_seqlens, chunk_size, Akk=Akk)
