"""Which fused configuration `kdajit.forward` runs where no tuning record applies (KDAJIT_AUTOTUNE=off, or no record
for the call's workload): the tables, as `kdajit.keys.FusedConfig` fields, and the lookup `untuned_fields`, which
`ForwardSpec.untuned_fused_config` calls. This module imports nothing.

Every configuration and route gives the same bits, so this choice is speed only, and changing it changes no
kernel's code. That is why it lives here and not in kdajit/keys.py: the toolchain fingerprint hashes keys.py
(`kdajit.compiler.template_files`), so a new default there would turn every cached kernel into a miss.

Entries are keyed by (chunk, head size, output_qg). FUSED, by K's tile size (`kdajit.keys.padded_head_dim`; K != V
follows its K's entry): the fused kernel in the fastest configuration measured on the H200, or None for the
standalone kernels where they measured faster than every fused configuration; the reference configuration (an
absent entry) elsewhere. Measured at B=2 T=8192 H=64, bf16 (docs/performance.md):
- chunk 32 (2026-12-04): the reference 0.676 ms against tile-w8's 1.054 at K = 128 without QG;
- K = 128 without QG (2026-12-03): tile-w8 1.01 ms against the reference's 1.20; the any-gate path
  (safe_gate=False) makes the same choice, tile-w8 1.37 ms against the reference's 1.57 (2026-12-04);
- K = 256 without QG: tile-w8 2.52 against the standalone kernels' 2.69 (the reference 2.97); K = 256 with QG (no
  8-warp build there): the reference 2.97 against the standalone 2.69;
- K = 60: tile 0.690 ms against tile-w8's 0.765; K = 100: tile-w8 1.083 against tile's 1.206 (H200, 2026-12-04).
compute-sanitizer's racecheck reports hazards in the 8-warp configurations; a minimal kernel with the same barrier
pattern shows that report is the tool's (docs/reliability.md, benchmarks/racecheck_probe.py).

Where K = V without QG, SQUARE (K itself a tile size: 64, 128) and SQUARE_PADDED (K = V padded to that tile size: 60,
100, ...) override FUSED: there the persistent 4-warp configuration that issues the next tile's loads early is the
fastest (B=2 T=8192 H=64, safe gate; H200 unless named): K = V = 128 0.848 ms against tile-w8's 0.949 (any gate
0.990 against 1.032; 2026-12-05, TMA tree); K = V = 64 0.556 against the tile's 0.579; K = V = 60 0.670 against 0.687
(2026-12-05); K = V = 100 (H100, 2026-12-05) 1.037 against tile-w8's 1.136. The two tables are apart because their
sizes load differently (TMA boxes; cp.async pieces) and rank configurations differently (the early gate rows: -7% at
K = 64, +3% at 60 and 100 on the H100). At K = V = 64 the gate rows also go early (gate_rows="early"): 0.540 ms
against 0.579, twice (H100, 2026-12-06; not yet timed on an H200); at K = V = 128 they do not: 0.950 against 0.925
(H100, 2026-12-06). With numerics2 (e1868f6) the same ranking, H100: a1-ge 0.539 against 0.586 at 64, 0.955 against
0.908 at 128, 1.028 against 0.997 at 100, 0.762 against 0.622 at 60 (2026-12-06). Where K = V pads to 128 (100, ...)
Kp waits in Vp's tile (gate_rows="early-vbuf", a1-gv): 0.954 ms against 0.981-0.985 at K = V = 100, twice (H100,
2026-12-07); not at 128 (0.939 against 0.930, H100: near its memory floor; not yet timed on an H200), nor then at 60
(0.623 against 0.621). Since the inverse's forward substitution runs as one copy (twenty-fourth session, H100,
2026-12-07): K = V = 128 plain a1, 0.886 ms against a1-r1's 0.904 in the same tree (a1-r1, the mainloop one head-dim
step per iteration, was the default the session before at 0.893; three interleaved rounds each), a1-r1 computing
4.5% more (0.724 against 0.693 alone, the H200's bound); K = V = 60 a1-gv, 0.618 against a1's 0.631 in the same tree
(one run each; the old tree's a1 0.619). K != V keeps its FUSED entry (a persistent grid of 2 CTAs per SM does not
fit every K != V pair).
"""

# Entries share this dict (untuned_fields hands it out unchanged); one that differs is a dict of its own.
_PERSISTENT_C2_HEAD_A1 = {"persistent": True, "ctas_per_sm": 2, "raster": "head", "loads_ahead": 1}
_KP_IN_VP = {**_PERSISTENT_C2_HEAD_A1, "gate_rows": "early-vbuf"}

FUSED = {(64, 128, False): {"warps": 8}, (64, 256, False): {"warps": 8}, (64, 256, True): None}
SQUARE = {(64, 64, False): {**_PERSISTENT_C2_HEAD_A1, "gate_rows": "early"},
          (64, 128, False): _PERSISTENT_C2_HEAD_A1}
SQUARE_PADDED = {(64, 64, False): _KP_IN_VP, (64, 128, False): _KP_IN_VP}


def untuned_fields(chunk: int, head_k: int, head_v: int, tile_head_k: int, output_qg: bool) -> dict | None:
    """The FusedConfig fields (the table's own dict: read it, do not change it) of what `forward` runs for a spec
    without a tuning record ({}: the reference configuration), or None for the standalone kernels. `tile_head_k`:
    the tile size K runs in (`kdajit.keys.padded_head_dim`)."""
    if head_k == head_v:
        square = SQUARE if head_k == tile_head_k else SQUARE_PADDED
        if (chunk, tile_head_k, output_qg) in square:
            return square[(chunk, tile_head_k, output_qg)]
    return FUSED.get((chunk, tile_head_k, output_qg), {})
