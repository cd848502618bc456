"""CPU study for the any-gate path (issue 9): candidate arithmetic for the diagonal 16x16 blocks, against fp64.

    python benchmarks/any_gate_numerics.py [--tiles 48] [--seed 0]

Emulates, in fp32 on the CPU, Aqk and the strict-lower L = k_i . k_j 2^(g_i - g_j) (beta left out) of
single 64-row chunks, every candidate sharing the off-diagonal blocks of today's kernel (TF32 products of
factors taken at the row block's first row, safe for any non-increasing gate). Candidates for the four
diagonal blocks:
- `tf32-shift`: today's safe-gate path (reference row 16a minus 54, TF32 products): overflows once the gate
  drops more than ~180 log2 units inside a block;
- `fp32-pairwise`: 2^(g_i - g_j) per (i, j, d) and fp32 sums, as FLA's safe_gate=False (token-parallel)
  intra computes them: 120 exp2 per row pair block and column;
- `fp32-halving`: the block split recursively at its midpoint m (rows i >= m against columns j < m use the
  factors 2^(g_i - g_m) and 2^(g_m - g_j), both <= 1 for any gate), down to single pairs, fp32 products:
  2,048 exp2 per level and 4 levels per block (8,192, against 15,360 pairwise) and causal (m <= i).
- `3xtf32-rows`: rows whose gate drops at most FAST_SPREAD from the block's first row take `tf32-shift`'s factors
  multiplied as 3xTF32 (hi/lo splits); the other rows `fp32-pairwise` (built on the any-gate path,
  `templates/tile_intra.py`'s FAST_SPREAD).
Gate families: FLA's safe gate (logsigmoid clamped at -5), logsigmoid x 1 (FLA's test and benchmark gates), x 10
and x 40 (unbounded), and x 10 with half the per-token gates exactly 0 (FLA's `mask_p`). Reports the norm-wise
relative error against fp64 (whole output and diagonal blocks alone) and the non-finite count. Numbers:
docs/performance.md, "Any-gate diagonal blocks". Built: `fp32-pairwise` (2026-12-04) as `templates/tile_intra.py`'s
`exact_diagonal`, then `3xtf32-rows` with it for the slow rows (safe_gate=False).
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

C, K, BLOCK = 64, 128, 16
GATES = ("safe", "x1", "x10", "x10-zeros", "x40")
CANDIDATES = ("tf32-shift", "fp32-pairwise", "fp32-halving", "3xtf32-rows")
FAST_SPREAD = 150.0  # `3xtf32-rows`: the largest gate drop (log2) from a block's first row that a row may factor


def tf32(x: torch.Tensor) -> torch.Tensor:
    """Truncation to TF32 (the tensor core reads fp32 operands without their low 13 mantissa bits)."""
    return (x.view(torch.int32) & ~0x1FFF).view(torch.float32)


def inputs(gate: str, tiles: int, gen: torch.Generator):
    q, k = (F.normalize(torch.randn(tiles, C, K, generator=gen), dim=-1).bfloat16().float() for _ in range(2))
    raw = F.logsigmoid(torch.randn(tiles, C, K, generator=gen))
    if gate == "safe":
        raw = raw.clamp_min(-5.0)
    elif gate == "x1":
        pass
    elif gate == "x40":
        raw = raw * 40
    else:
        raw = raw * 10
        if gate == "x10-zeros":
            raw[torch.rand(tiles, C, K, generator=gen) < 0.5] = 0.0
    return q, k, (raw / math.log(2)).cumsum(1).float()


def exact(x: torch.Tensor, k: torch.Tensor, g: torch.Tensor, strict: bool) -> torch.Tensor:
    gd = g.double()
    diff = (gd[:, :, None, :] - gd[:, None, :, :]).clamp(max=0)
    keep = torch.tril(torch.ones(C, C, dtype=torch.bool), diagonal=-1 if strict else 0)[None, :, :, None]
    return torch.einsum("nid,njd,nijd->nij", x.double(), k.double(), torch.exp2(diff) * keep)


def pairwise(x, k, g):
    """sum_d x_id k_jd 2^(g_id - g_jd) for j <= i of one block, fp32 (j > i gives 0)."""
    n = x.shape[1]
    diff = g[:, :, None, :] - g[:, None, :, :]
    lower = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, :, :, None]
    return torch.einsum("nid,njd,nijd->nij", x, k, torch.exp2(torch.where(lower, diff, torch.full_like(diff, -1e30))))


def halving(x, k, g):
    """The same sums by recursive midpoint factorisation (both factors <= 1), fp32 products."""
    n = x.shape[1]
    if n == 1:
        return (x * k).sum(-1)[..., None]
    m = n // 2
    out = torch.zeros(x.shape[0], n, n)
    out[:, :m, :m] = halving(x[:, :m], k[:, :m], g[:, :m])
    out[:, m:, m:] = halving(x[:, m:], k[:, m:], g[:, m:])
    ref = g[:, m:m + 1]
    out[:, m:, :m] = (x[:, m:] * torch.exp2(g[:, m:] - ref)) @ (k[:, :m] * torch.exp2(ref - g[:, :m])).transpose(1, 2)
    return out


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x = hi + lo exactly, hi its TF32 bits (3xTF32)."""
    hi = tf32(x)
    return hi, x - hi


def fast_rows(x, k, g):
    """Rows whose gate drops at most FAST_SPREAD from the block's first row (then no factor over- or underflows):
    the safe path's shifted factors, multiplied as 3xTF32 (lo.hi + hi.lo + hi.hi); other rows pairwise."""
    r = g[:, :1] - 54.0
    a_hi, a_lo = split(x * torch.exp2(g - r))
    b_hi, b_lo = split(k * torch.exp2(r - g))
    products = tf32(a_lo) @ b_hi.transpose(1, 2) + a_hi @ tf32(b_lo).transpose(1, 2) + a_hi @ b_hi.transpose(1, 2)
    fast = ((g[:, :1] - g).amax(-1) <= FAST_SPREAD)[:, :, None]
    return torch.where(fast, torch.tril(products), pairwise(x, k, g))


def blocked(x, k, g, candidate: str, strict: bool) -> torch.Tensor:
    out = torch.zeros(x.shape[0], C, C)
    for a in range(C // BLOCK):
        rows = slice(BLOCK * a, BLOCK * a + BLOCK)
        for b in range(a):
            cols = slice(BLOCK * b, BLOCK * b + BLOCK)
            r = g[:, BLOCK * a][:, None]
            out[:, rows, cols] = tf32(x[:, rows] * torch.exp2(g[:, rows] - r)) @ \
                tf32(k[:, cols] * torch.exp2(r - g[:, cols])).transpose(1, 2)
        xa, ka, ga = x[:, rows], k[:, rows], g[:, rows]
        if candidate == "tf32-shift":
            r = ga[:, :1] - 54.0
            diag = torch.tril(tf32(xa * torch.exp2(ga - r)) @ tf32(ka * torch.exp2(r - ga)).transpose(1, 2))
        elif candidate == "fp32-pairwise":
            diag = pairwise(xa, ka, ga)
        elif candidate == "3xtf32-rows":
            diag = fast_rows(xa, ka, ga)
        else:
            diag = torch.tril(halving(xa, ka, ga))
        out[:, rows, rows] = torch.tril(diag, diagonal=-1) if strict else diag
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", type=int, default=48, help="64-row chunks per gate family")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    diagonal = torch.block_diag(*[torch.ones(BLOCK, BLOCK, dtype=torch.bool)] * (C // BLOCK))
    print("Norm-wise error against fp64, whole output (in brackets: over the diagonal blocks alone); the gate's last "
          f"column: rows whose gate drops at most {FAST_SPREAD:g} from their block's first row (`3xtf32-rows`)\n")
    print("| gate | output | " + " | ".join(CANDIDATES) + " | fast rows |")
    print("|---|---|" + "---|" * len(CANDIDATES) + "---|")
    for gate in GATES:
        q, k, g = inputs(gate, args.tiles, gen)
        blocks = g.view(g.shape[0], C // BLOCK, BLOCK, K)
        fast = ((blocks[:, :, :1] - blocks).amax(-1) <= FAST_SPREAD).double().mean().item()
        for name, x, strict in (("Aqk", q, False), ("L", k, True)):
            ref = exact(x, k, g, strict)
            cells = []
            for candidate in CANDIDATES:
                got = blocked(x, k, g, candidate, strict).double()
                bad = int((~torch.isfinite(got)).sum())
                err = (got - ref).norm().item() / ref.norm().item()
                diag = (got - ref)[:, diagonal].norm().item() / ref[:, diagonal].norm().item()
                cells.append(f"{err:.2e} ({diag:.1e})" + (f" ({bad} non-finite)" if bad else ""))
            print(f"| {gate} | {name} | " + " | ".join(cells) + f" | {fast:.0%} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
