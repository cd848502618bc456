"""CPU study: the fp64 error of Akk = (I + L)^-1 under other inverse orders, emulated, on realistic L tiles.

    python benchmarks/inverse_orders.py [--tiles 256] [--lower-bound -5]

Question (issue 12): may a faster inverse replace today's fp32 column substitution (64-long serial chains)
with 16x16 diagonal blocks plus tensor-core merges, as FLA does, without an output's error exceeding FLA's?
Emulation: fp32 FMAs are exact products and sums rounded once; a tensor-core product takes TF32 operands
(the fp32 bits truncated, FLA's case, or rounded to nearest) and its exact sum is rounded to fp32 once (an
optimistic accumulation order); "3xTF32" splits each operand into a TF32 head and tail. L comes from
`kdajit.reference.make_inputs` (the fp64 products rounded to fp32, as the intra phase stores them); the
reference is the fp64 inverse of that fp32 L. Prints a markdown table (numbers: docs/performance.md).
"""
from __future__ import annotations

import argparse

import torch

from kdajit import reference

F64, F32 = torch.float64, torch.float32


def l_tiles(n_tiles: int, lower_bound: float, K: int = 128, seed: int = 0) -> torch.Tensor:
    """[n_tiles, 64, 64] strictly lower fp32 L tiles of realistic inputs."""
    g = torch.Generator().manual_seed(seed)
    B, T, H = 1, 64 * max(1, n_tiles // 4), 4
    x = reference.make_inputs(B, T, H, K, K, generator=g, lower_bound=lower_bound)
    k, gk, beta = (x[n].to(F64) for n in ("k", "gk", "beta"))
    kc = k.view(B, T // 64, 64, H, K).permute(0, 1, 3, 2, 4).reshape(-1, 64, K)
    gc = gk.view(B, T // 64, 64, H, K).permute(0, 1, 3, 2, 4).reshape(-1, 64, K)
    bc = beta.view(B, T // 64, 64, H).permute(0, 1, 3, 2).reshape(-1, 64)
    # L[i, j] = beta_i sum_d k_id k_jd 2^(g_id - g_jd), j < i; evaluated in fp64, then rounded to fp32 (the workspace)
    a = kc * torch.exp2(gc)
    b = kc * torch.exp2(-gc)
    L = bc[:, :, None] * (a @ b.transpose(1, 2))
    L = torch.tril(L, -1)
    return L.to(F32)


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add: exact a*b + c, rounded once (fp64 holds the exact product of two fp32)."""
    return (a.to(F64) * b.to(F64) + c.to(F64)).to(F32)


def substitute(L: torch.Tensor) -> torch.Tensor:
    """Forward substitution in fp32, one rounding per FMA, x_s chains in ascending s (kdajit's order, emulated):
    X[i, j] = -sum_{s<i} L[i, s] X[s, j] for i > j, X[i, i] = 1."""
    n = L.shape[-1]
    X = torch.zeros_like(L)
    eye = torch.eye(n, dtype=F32).expand_as(L)
    for i in range(n):
        acc = None
        for s in range(i):
            term = L[:, i, s, None]
            acc = (term.to(F64) * X[:, s].to(F64)).to(F32) if acc is None else fma32(term, X[:, s], acc)
        row = eye[:, i].clone() if acc is None else torch.where(torch.arange(n) < i, -acc, eye[:, i])
        X[:, i] = torch.where(torch.arange(n) > i, torch.zeros(()), row)
    return X


def tf32(x: torch.Tensor, rounding: str) -> torch.Tensor:
    """fp32 values as TF32 operands: the low 13 mantissa bits dropped ("trunc") or rounded ("rn")."""
    bits = x.contiguous().view(torch.int32)
    if rounding == "rn":
        bits = bits + 0x1000  # round half up on the magnitude (close to cvt.rna)
    return (bits & ~0x1FFF).view(F32)


def mm(a: torch.Tensor, b: torch.Tensor, rounding: str) -> torch.Tensor:
    """Tensor-core product of fp32 tiles: operands as TF32 (truncated or rounded), exact products summed in fp64
    and rounded to fp32 once (optimistic about the accumulation order); '3x': split operands (big + small) for
    near-fp32 accuracy; 'fp32': fp32 products (CUDA cores, exact sum then one rounding)."""
    if rounding == "fp32":
        return (a.to(F64) @ b.to(F64)).to(F32)
    if rounding == "3x":
        ab, bb = tf32(a, "rn"), tf32(b, "rn")
        as_, bs = tf32(a - ab, "rn"), tf32(b - bb, "rn")
        return (ab.to(F64) @ bb.to(F64) + as_.to(F64) @ bb.to(F64) + ab.to(F64) @ bs.to(F64)).to(F32)
    return (tf32(a, rounding).to(F64) @ tf32(b, rounding).to(F64)).to(F32)


def blocked(L: torch.Tensor, rounding: str) -> torch.Tensor:
    """FLA's order: 16x16 diagonal blocks by fp32 substitution, then X_ab = -X_aa (sum_c L_ac X_cb), c = b..a-1,
    as tensor-core products (FLA 0.6.0 chunk_intra.py:315-351)."""
    n, s = L.shape[-1], 16
    X = torch.zeros_like(L)
    blk = lambda M, a, b: M[:, s * a:s * a + s, s * b:s * b + s]
    for a in range(n // s):
        X[:, s * a:s * a + s, s * a:s * a + s] = substitute(blk(L, a, a))
    for d in range(1, n // s):
        for a in range(d, n // s):
            b = a - d
            inner = None
            for c in range(b, a):
                p = mm(blk(L, a, c), blk(X, c, b), rounding)
                inner = p if inner is None else (inner.to(F64) + p.to(F64)).to(F32)
            X[:, s * a:s * a + s, s * b:s * b + s] = -mm(blk(X, a, a), inner, rounding)
    return X


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.norm((x.to(F64) - ref).flatten()) / torch.linalg.norm(ref.flatten()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", type=int, default=256, help="64x64 L tiles (multiples of 4)")
    parser.add_argument("--lower-bound", type=float, default=-5.0, help="make_inputs' per-token log-gate bound")
    args = parser.parse_args()
    L = l_tiles(args.tiles, args.lower_bound)
    ref = torch.linalg.inv(torch.eye(64, dtype=F64) + L.to(F64))
    rows = {"fp32 substitution (kdajit today)": substitute(L),
            "16x16 blocks + TF32 truncated merges (FLA)": blocked(L, "trunc"),
            "16x16 blocks + TF32 round-to-nearest merges": blocked(L, "rn"),
            "16x16 blocks + 3xTF32 merges": blocked(L, "3x"),
            "16x16 blocks + fp32 merges": blocked(L, "fp32")}
    print("| inverse order | Akk fp32 error | Akk after bf16 RN |")
    print("|---|---|---|")
    for name, X in rows.items():
        print(f"| {name} | {rel(X, ref):.3e} | {rel(X.to(torch.bfloat16), ref):.3e} |")


if __name__ == "__main__":
    main()
