"""Exact PyTorch evaluation of the KDA forward "intra" boundary (docs/contract.md, authoritative), for tests.

Per sequence, per chunk c (rows [C*c, min(C*c + C, len)) of one head), with g the chunk-local
cumulative gate in log2 units, i, j rows of the chunk and d the head-dim index:

    Aqk[i, j] = scale * sum_d q[i,d] k[j,d] 2^(g[i,d] - g[j,d])   for j <= i, else 0
    L[i, j]   = beta[i] * sum_d k[i,d] k[j,d] 2^(g[i,d] - g[j,d]) for j < i, else 0
    Akk       = (I + L)^-1                       (unit lower triangular)
    W         = Akk @ (beta * k * 2^g),    U = Akk @ (beta * v)
    KG[i]     = k[i] * 2^(g_last - g[i])   (g_last: g at the chunk's last valid row)
    QG[i]     = q[i] * 2^g[i]

Everything is evaluated in one floating dtype (fp64 by default, or fp32) with no bf16 rounding.
The pairwise gate factor 2^(g_i - g_j) is formed per element (never factorised through a reference
row), so the result is exact up to the working precision for any gate, safe or not.

Also here: `make_inputs` (realistic KDA inputs with the lower-bound "safe gate"), `relative_error`,
the chunked delta-rule forward built from the pieces (`chunked_kda_forward`) and the token-by-token
recurrence it must equal (`naive_recurrent_kda`). This module never imports cutlass.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kdajit.outputs import ForwardOutput

__all__ = [
    "RCP_LN2",
    "ForwardOutput",
    "forward_reference",
    "chunk_local_cumsum",
    "make_inputs",
    "relative_error",
    "chunked_kda_forward",
    "naive_recurrent_kda",
]

RCP_LN2 = 1.0 / math.log(2.0)

# (chunk, head) slices per step of the pairwise-gate evaluation: bounds the [n, C, C, K]
# temporary (4 x 64 x 64 x 128 fp64 = 16 MiB), which measured fastest on CPU.
_PAIRWISE_SLICES = 4


def _sequence_bounds(cu_seqlens: torch.Tensor | None, batch: int, tokens: int) -> list[tuple[int, int]] | None:
    """[(bos, eos)] from cu_seqlens (validated), or None in dense mode."""
    if cu_seqlens is None:
        return None
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [N+1], got dtype={cu_seqlens.dtype}, "
                         f"shape={list(cu_seqlens.shape)}")
    if batch != 1:
        raise ValueError(f"with cu_seqlens the batch size must be 1 (sequences packed along T), got B={batch}")
    values = [int(x) for x in cu_seqlens.tolist()]
    if values[0] != 0 or values[-1] != tokens:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={tokens}, got {values}")
    if any(b > e for b, e in zip(values[:-1], values[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {values}")
    return list(zip(values[:-1], values[1:]))


def _to_chunks(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[B, T, H, D] -> [B * NC * H, C, D], zero-padding T up to a multiple of C."""
    batch, tokens, heads, dim = x.shape
    n_chunks = -(-tokens // chunk_size)
    x = F.pad(x, (0, 0, 0, 0, 0, n_chunks * chunk_size - tokens))
    x = x.view(batch, n_chunks, chunk_size, heads, dim).permute(0, 1, 3, 2, 4)
    return x.reshape(batch * n_chunks * heads, chunk_size, dim)


def _from_chunks(x: torch.Tensor, batch: int, tokens: int, heads: int) -> torch.Tensor:
    """Inverse of `_to_chunks`: [B * NC * H, C, D] -> [B, T, H, D] (contiguous, padding dropped)."""
    _, chunk_size, dim = x.shape
    n_chunks = -(-tokens // chunk_size)
    x = x.view(batch, n_chunks, heads, chunk_size, dim).permute(0, 1, 3, 2, 4)
    return x.reshape(batch, n_chunks * chunk_size, heads, dim)[:, :tokens].contiguous()


def _forward_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   scale: float, chunk_size: int, output_qg: bool) -> ForwardOutput:
    """Equal-length batch [B, T, H, *], every input already in the working dtype."""
    batch, tokens, heads, _ = q.shape
    if tokens == 0:
        empty = q.new_zeros(batch, 0, heads, chunk_size)
        return ForwardOutput(empty, empty.clone(), torch.zeros_like(k), torch.zeros_like(v),
                                torch.zeros_like(k), torch.zeros_like(q) if output_qg else None)
    C = chunk_size
    n_chunks = -(-tokens // C)
    qc, kc, vc, gc = (_to_chunks(x, C) for x in (q, k, v, g))
    bc = _to_chunks(beta.unsqueeze(-1), C)  # [N, C, 1]
    n_slices = qc.shape[0]
    device = q.device

    # Valid rows of every (batch, chunk, head) slice; only the last chunk of a sequence is partial.
    valid = torch.clamp(tokens - C * torch.arange(n_chunks, device=device), max=C)
    valid = valid.view(1, n_chunks, 1).expand(batch, n_chunks, heads).reshape(n_slices)
    rows = torch.arange(C, device=device)
    row_valid = rows.view(1, C) < valid.view(n_slices, 1)                         # [N, C]
    causal = rows.view(C, 1) >= rows.view(1, C)                                   # j <= i
    pair_mask = causal.view(1, C, C) & row_valid.view(n_slices, C, 1)            # [N, C, C]

    # Aqk and L from the pairwise gate factor P[i, j, d] = k[j, d] 2^(g[i, d] - g[j, d]) (j <= i).
    qk = torch.empty(n_slices, C, C, dtype=q.dtype, device=device)
    kk = torch.empty_like(qk)
    for s0 in range(0, n_slices, _PAIRWISE_SLICES):
        s = slice(s0, min(s0 + _PAIRWISE_SLICES, n_slices))
        diff = gc[s].unsqueeze(2) - gc[s].unsqueeze(1)                            # [n, C(i), C(j), K]
        diff.masked_fill_(~pair_mask[s].unsqueeze(-1), -math.inf)
        pair = torch.exp2(diff).mul_(kc[s].unsqueeze(1))
        qk[s] = torch.matmul(pair, qc[s].unsqueeze(-1)).squeeze(-1)
        kk[s] = torch.matmul(pair, kc[s].unsqueeze(-1)).squeeze(-1)
    aqk = qk * scale
    strict_l = (bc * kk).tril(-1)

    eye = torch.eye(C, dtype=q.dtype, device=device).expand(n_slices, C, C)
    akk = torch.linalg.solve_triangular(eye + strict_l, eye, upper=False, unitriangular=True)

    w = akk @ (bc * kc * torch.exp2(gc))
    u = akk @ (bc * vc)
    g_last = torch.gather(gc, 1, (valid - 1).view(n_slices, 1, 1).expand(n_slices, 1, gc.shape[-1]))
    kg = torch.where(row_valid.unsqueeze(-1), kc * torch.exp2(g_last - gc), 0.0)
    qg = qc * torch.exp2(gc) if output_qg else None

    def back(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else _from_chunks(x, batch, tokens, heads)

    return ForwardOutput(back(aqk), back(akk), back(w), back(u), back(kg), back(qg))


def forward_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, beta: torch.Tensor,
                      scale: float | None = None, *, cu_seqlens: torch.Tensor | None = None,
                      chunk_size: int = 64, output_qg: bool = False,
                      dtype: torch.dtype = torch.float64) -> ForwardOutput:
    """Evaluate the boundary's formulas exactly in `dtype` (see the module docstring).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; gk: [B, T, HV, K] chunk-local cumulative log2 gate;
            beta: [B, T, HV]. HV = H, or a multiple of H (grouped value heads: value head h uses q, k
            head h // (HV / H)). Any dtype and device (CPU or CUDA); values are converted to `dtype`.
        scale: defaults to K ** -0.5.
        cu_seqlens: optional int32/int64 [N+1]; B must be 1 and chunks restart at every sequence.
        chunk_size: rows per chunk.
        output_qg: also return QG.
        dtype: working and output dtype (torch.float64 or torch.float32).

    Returns:
        ForwardOutput(Aqk, Akk, w, u, kg, qg) in `dtype` with the kernel output shapes. Columns of
        Aqk/Akk beyond a partial chunk's valid rows are 0.
    """
    if dtype not in (torch.float64, torch.float32):
        raise ValueError(f"dtype must be torch.float64 or torch.float32, got {dtype}")
    grouped = q.dim() == 4 and gk.dim() == 4 and (
        gk.shape[2] == q.shape[2] or (q.shape[2] > 0 and gk.shape[2] % q.shape[2] == 0))
    if k.shape != q.shape or not grouped or (gk.shape[:2], gk.shape[3]) != (q.shape[:2], q.shape[3]):
        raise ValueError(f"q, k must share one [B, T, H, K] shape and gk be [B, T, HV, K] with HV a multiple of H, "
                         f"got q={list(q.shape)}, k={list(k.shape)}, gk={list(gk.shape)}")
    batch, tokens, heads, head_k = gk.shape
    if v.dim() != 4 or v.shape[:3] != gk.shape[:3]:
        raise ValueError(f"v must be [B, T, HV, V] = [{batch}, {tokens}, {heads}, V], got {list(v.shape)}")
    if beta.shape != gk.shape[:3]:
        raise ValueError(f"beta must be [B, T, HV] = {list(gk.shape[:3])}, got {list(beta.shape)}")
    if scale is None:
        scale = head_k ** -0.5
    if heads != q.shape[2]:
        q, k = (x.repeat_interleave(heads // q.shape[2], dim=2) for x in (q, k))
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, gk, beta))

    bounds = _sequence_bounds(cu_seqlens, batch, tokens)
    if bounds is None:
        return _forward_dense(q, k, v, g, beta, scale, chunk_size, output_qg)

    out = ForwardOutput(
        Aqk=q.new_zeros(1, tokens, heads, chunk_size), Akk=q.new_zeros(1, tokens, heads, chunk_size),
        w=torch.zeros_like(k), u=torch.zeros_like(v), kg=torch.zeros_like(k),
        qg=torch.zeros_like(q) if output_qg else None)
    for bos, eos in bounds:
        if eos == bos:
            continue
        part = _forward_dense(q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], g[:, bos:eos], beta[:, bos:eos],
                              scale, chunk_size, output_qg)
        for name, piece in part._asdict().items():
            if piece is not None:
                getattr(out, name)[:, bos:eos] = piece
    return out


def chunk_local_cumsum(g: torch.Tensor, chunk_size: int = 64, *, cu_seqlens: torch.Tensor | None = None,
                       scale: float = 1.0) -> torch.Tensor:
    """Running sum of `g` ([B, T, ...]) along T inside every chunk, times `scale`, in g's dtype.

    Chunks are `chunk_size` rows counted from each sequence start (cu_seqlens: B == 1, packed
    sequences); the sum restarts at every chunk and every sequence. The scale is applied after the
    sum, as FLA's `chunk_local_cumsum(g, chunk_size, scale=RCP_LN2)` does.
    """
    batch, tokens = g.shape[:2]
    bounds = _sequence_bounds(cu_seqlens, batch, tokens) or [(0, tokens)]
    out = torch.empty_like(g)
    for bos, eos in bounds:
        length = eos - bos
        if length == 0:
            continue
        n_chunks = -(-length // chunk_size)
        part = g[:, bos:eos].flatten(2)
        part = F.pad(part, (0, 0, 0, n_chunks * chunk_size - length))
        part = part.view(batch, n_chunks, chunk_size, -1).cumsum(2).view(batch, n_chunks * chunk_size, -1)
        out[:, bos:eos] = (part[:, :length] * scale).view(g[:, bos:eos].shape)
    return out


def make_inputs(B: int, T: int, H: int, K: int = 128, V: int = 128, *, beta_dtype: torch.dtype = torch.bfloat16,
                io_dtype: torch.dtype = torch.bfloat16, cu_seqlens: torch.Tensor | None = None,
                lower_bound: float = -5.0, value_heads: int | None = None,
                device: str | torch.device = "cpu", generator: torch.Generator | None = None,
                chunk_size: int = 64, gate_scale: float | None = None,
                gate_zeros: float = 0.0) -> dict[str, torch.Tensor]:
    """Realistic KDA forward inputs, by default with the lower-bound ("safe") gate; all contiguous, on `device`.

    Returns a dict with (HV = `value_heads`, default H; a multiple of H gives grouped value heads)
        q, k: [B, T, H, K] in `io_dtype`, L2-normalised over K;  v: [B, T, HV, V] `io_dtype` standard normal;
        g_raw: [B, T, HV, K] fp32 per-token natural-log gates lower_bound * sigmoid(randn), in
            [lower_bound, 0); with `gate_scale`, FLA's unbounded test gates logsigmoid(randn) * gate_scale
            instead (for safe_gate=False), a `gate_zeros` fraction of them exactly 0 (FLA's mask_p);
        gk: [B, T, HV, K] fp32, chunk-local cumsum of g_raw (restarting at every chunk and sequence
            start) times 1/ln 2, summed in fp32;
        beta: [B, T, HV] sigmoid(randn) in `beta_dtype`;
        cu_seqlens (only when given).
    Random draws come from `generator` (a CPU generator) so a seed reproduces the inputs on any device.
    """
    if cu_seqlens is not None:
        _sequence_bounds(cu_seqlens, B, T)
    HV = H if value_heads is None else value_heads

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32)

    q = F.normalize(randn(B, T, H, K), dim=-1).to(io_dtype)
    k = F.normalize(randn(B, T, H, K), dim=-1).to(io_dtype)
    v = randn(B, T, HV, V).to(io_dtype)
    if gate_scale is None:
        g_raw = lower_bound * torch.sigmoid(randn(B, T, HV, K))
    else:
        g_raw = F.logsigmoid(randn(B, T, HV, K)) * gate_scale
    if gate_zeros:
        g_raw = torch.where(torch.rand(B, T, HV, K, generator=generator) < gate_zeros, 0.0, g_raw)
    beta = torch.sigmoid(randn(B, T, HV)).to(beta_dtype)
    gk = chunk_local_cumsum(g_raw, chunk_size, cu_seqlens=cu_seqlens, scale=RCP_LN2)
    out = {"q": q, "k": k, "v": v, "gk": gk, "beta": beta, "g_raw": g_raw}
    out = {name: x.to(device).contiguous() for name, x in out.items()}
    if cu_seqlens is not None:
        out["cu_seqlens"] = cu_seqlens.to(device)
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F computed in fp64; nan if `out` holds a NaN (inf if ref is 0 and out is not)."""
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: out {list(out.shape)} vs ref {list(ref.shape)}")
    out64 = out.detach().to(torch.float64)
    ref64 = ref.detach().to(torch.float64).to(out64.device)
    if torch.isnan(out64).any():
        return math.nan
    diff = torch.linalg.vector_norm(out64 - ref64).item()
    norm = torch.linalg.vector_norm(ref64).item()
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def _sequence_walk(q: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None,
                   initial_state: torch.Tensor | None, dtype: torch.dtype):
    """Shared set-up of the two state walks: (bounds, groups, state, o, final).

    groups: one (batch rows, bos, eos) per state; state: [N, H, K, V] from zero or `initial_state`.
    """
    batch, tokens, heads, head_k = q.shape
    bounds = _sequence_bounds(cu_seqlens, batch, tokens)
    groups = [(slice(0, batch), 0, tokens)] if bounds is None else \
        [(slice(0, 1), bos, eos) for bos, eos in bounds]
    shape = (batch if bounds is None else len(bounds), heads, head_k, v.shape[-1])
    if initial_state is None:
        state = torch.zeros(shape, dtype=dtype, device=q.device)
    elif tuple(initial_state.shape) != shape:
        raise ValueError(f"initial_state must be [N, H, K, V] = {list(shape)}, got {list(initial_state.shape)}")
    else:
        state = initial_state.to(dtype=dtype, device=q.device)
    o = torch.zeros(batch, tokens, heads, v.shape[-1], dtype=dtype, device=q.device)
    return bounds, groups, state, o, torch.empty_like(state)


def chunked_kda_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, beta: torch.Tensor,
                        scale: float, pieces: ForwardOutput, *, cu_seqlens: torch.Tensor | None = None,
                        chunk_size: int = 64,
                        initial_state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked KDA forward (output and final state) assembled from the intra-stage pieces.

    Per sequence and head, chunk by chunk with the state S [K, V] (zero or `initial_state`):
        v_new = U - W @ S
        o     = (QG @ S) * scale + Aqk @ v_new
        S     = diag(2^g_last) S + KG^T @ v_new
    `pieces` is a `forward_reference` result (or kernel outputs cast up); if its qg is None, QG is
    computed from q and gk. The arithmetic runs in pieces.Aqk's dtype. q, k, v, beta give shapes
    (and QG when missing); gk gives g_last.

    Returns:
        o: [B, T, H, V]; final_state: [N, H, K, V] with N = B (dense) or the number of sequences.
    """
    dtype = pieces.Aqk.dtype
    g = gk.to(dtype)
    qg = pieces.qg.to(dtype) if pieces.qg is not None else q.to(dtype) * torch.exp2(g)
    aqk, w, u, kg = (x.to(dtype) for x in (pieces.Aqk, pieces.w, pieces.u, pieces.kg))

    bounds, groups, state, o, final = _sequence_walk(q, v, cu_seqlens, initial_state, dtype)

    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)  # [b, n, H, D] -> [b, H, n, D]

    for index, (rows_b, bos, eos) in enumerate(groups):
        s = state[index:index + 1] if bounds is not None else state
        for r0 in range(bos, eos, chunk_size):
            r1 = min(r0 + chunk_size, eos)
            n = r1 - r0
            a = heads_first(aqk[rows_b, r0:r1, :, :n])
            w_c, u_c, qg_c, kg_c = (heads_first(x[rows_b, r0:r1]) for x in (w, u, qg, kg))
            v_new = u_c - w_c @ s
            o[rows_b, r0:r1] = heads_first((qg_c @ s) * scale + a @ v_new)
            decay = torch.exp2(g[rows_b, r1 - 1]).unsqueeze(-1)                 # [b, H, K, 1]
            s = decay * s + kg_c.transpose(-1, -2) @ v_new
        if bounds is None:
            final = s
        else:
            final[index:index + 1] = s
    return o, final


def naive_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_raw: torch.Tensor,
                        beta: torch.Tensor, scale: float, *, cu_seqlens: torch.Tensor | None = None,
                        initial_state: torch.Tensor | None = None,
                        dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA recurrence (the ground truth the chunked form must reproduce).

    Per head, with the per-token natural-log gates g_raw ([B, T, H, K]):
        S_t = (I - beta_t k_t k_t^T) diag(exp(g_raw_t)) S_{t-1} + beta_t k_t v_t^T
        o_t = scale * S_t^T q_t
    S starts from zero or `initial_state` ([N, H, K, V]) at every sequence start.

    Returns:
        o: [B, T, H, V] and final_state: [N, H, K, V] in `dtype` (N = B dense, else the sequence count).
    """
    q, k, v, g_raw, beta = (x.to(dtype) for x in (q, k, v, g_raw, beta))
    decay = torch.exp(g_raw)
    bounds, groups, state, o, final = _sequence_walk(q, v, cu_seqlens, initial_state, dtype)
    for index, (rows_b, bos, eos) in enumerate(groups):
        s = state[index:index + 1] if bounds is not None else state.clone()
        for t in range(bos, eos):
            k_t, v_t, q_t = k[rows_b, t], v[rows_b, t], q[rows_b, t]            # [b, H, K|V]
            b_t = beta[rows_b, t].unsqueeze(-1)                                  # [b, H, 1]
            s = decay[rows_b, t].unsqueeze(-1) * s                               # diag(exp g) S
            k_s = torch.einsum("bhk,bhkv->bhv", k_t, s)                          # k^T S
            s = s + (b_t * k_t).unsqueeze(-1) * (v_t - k_s).unsqueeze(-2)
            o[rows_b, t] = scale * torch.einsum("bhk,bhkv->bhv", q_t, s)
        if bounds is None:
            final = s
        else:
            final[index:index + 1] = s
    return o, final
