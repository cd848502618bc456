"""kdajit's entry points as `torch.library` custom ops, so `torch.compile` traces them without graph breaks.

`kdajit.forward`, `intra` and `recompute_w_u` call these ops only while torch.compile traces
(`torch.compiler.is_compiling()`); in eager mode they launch directly (no dispatcher overhead). The real
implementation of each op is the eager API itself (validation included, at run time); the fake
implementations give the output shapes and dtypes from the input shapes alone, so T, B and H stay
symbolic (no recompile per length). `kdajit::forward_out` writes into given buffers and is declared as
mutating them (the `out=` form, e.g. static buffers for CUDA graphs).

Ops return tensors only: an output that was not requested (QG) comes back as an empty tensor and the
API turns it into None.
"""
from __future__ import annotations

import torch
from torch import Tensor

from kdajit.outputs import ForwardOutput


def _qg_or_empty(qg: Tensor | None, like: Tensor) -> Tensor:
    return qg if qg is not None else like.new_empty(0)


@torch.library.custom_op("kdajit::forward", mutates_args=())
def forward(q: Tensor, k: Tensor, v: Tensor, gk: Tensor, beta: Tensor, scale: float, cu_seqlens: Tensor | None,
            chunk_size: int, output_qg: bool, safe_gate: bool = True) -> list[Tensor]:
    """[Aqk, Akk, w, u, kg, qg] (qg empty unless `output_qg`); see `kdajit.forward`."""
    from kdajit import api

    out = api.forward(q, k, v, gk, beta, scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size, output_qg=output_qg,
                      safe_gate=safe_gate)
    return [out.Aqk, out.Akk, out.w, out.u, out.kg, _qg_or_empty(out.qg, q)]


@forward.register_fake
def _forward_fake(q, k, v, gk, beta, scale, cu_seqlens, chunk_size, output_qg, safe_gate=True):
    B, T, HV, K = gk.shape  # HV value heads (grouped: a multiple of q's H)
    return [q.new_empty(B, T, HV, chunk_size), q.new_empty(B, T, HV, chunk_size), q.new_empty(B, T, HV, K),
            q.new_empty(v.shape), q.new_empty(B, T, HV, K), q.new_empty(B, T, HV, K) if output_qg else q.new_empty(0)]


@torch.library.custom_op("kdajit::forward_out", mutates_args=("Aqk", "Akk", "w", "u", "kg", "qg"))
def forward_out(q: Tensor, k: Tensor, v: Tensor, gk: Tensor, beta: Tensor, scale: float, cu_seqlens: Tensor | None,
                chunk_size: int, Aqk: Tensor, Akk: Tensor, w: Tensor, u: Tensor, kg: Tensor,
                qg: Tensor | None, safe_gate: bool = True) -> None:
    """`kdajit.forward(..., out=ForwardOutput(Aqk, Akk, w, u, kg, qg))`, QG computed when `qg` is given."""
    from kdajit import api

    api.forward(q, k, v, gk, beta, scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size, output_qg=qg is not None,
                safe_gate=safe_gate, out=ForwardOutput(Aqk, Akk, w, u, kg, qg))


@forward_out.register_fake
def _forward_out_fake(q, k, v, gk, beta, scale, cu_seqlens, chunk_size, Aqk, Akk, w, u, kg, qg, safe_gate=True):
    return None


@torch.library.custom_op("kdajit::intra", mutates_args=())
def intra(q: Tensor, k: Tensor, gk: Tensor, beta: Tensor, scale: float, cu_seqlens: Tensor | None,
          chunk_size: int, safe_gate: bool = True) -> list[Tensor]:
    """[Aqk, Akk]; see `kdajit.intra`."""
    from kdajit import api

    return list(api.intra(q, k, gk, beta, scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size, safe_gate=safe_gate))


@intra.register_fake
def _intra_fake(q, k, gk, beta, scale, cu_seqlens, chunk_size, safe_gate=True):
    B, T, HV, _ = gk.shape
    return [q.new_empty(B, T, HV, chunk_size), q.new_empty(B, T, HV, chunk_size)]


@torch.library.custom_op("kdajit::recompute_w_u", mutates_args=())
def recompute_w_u(k: Tensor, v: Tensor, beta: Tensor, Akk: Tensor, gk: Tensor, cu_seqlens: Tensor | None,
                  chunk_size: int, q: Tensor | None) -> list[Tensor]:
    """[w, u, kg, qg] (qg empty without `q`); see `kdajit.recompute_w_u`."""
    from kdajit import api

    w, u, kg, qg = api.recompute_w_u(k, v, beta, Akk, gk, cu_seqlens=cu_seqlens, chunk_size=chunk_size, q=q)
    return [w, u, kg, _qg_or_empty(qg, k)]


@recompute_w_u.register_fake
def _recompute_fake(k, v, beta, Akk, gk, cu_seqlens, chunk_size, q):
    return [k.new_empty(gk.shape), k.new_empty(v.shape), k.new_empty(gk.shape),
            k.new_empty(gk.shape) if q is not None else k.new_empty(0)]
