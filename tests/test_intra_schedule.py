"""CPU: every intra warp schedule computes and stores each block of the tile exactly once.

A schedule (templates/tile_intra.py) lists per warp the groups it runs: (row block a, diagonal?, column blocks; a
diagonal group's last one is a). A block left out would leave Aqk and L unwritten there (the GPU tests poison
outputs, but only on the shapes and configurations they run); a block listed twice would be written by two warps.
This checks every schedule `warp_schedule` can return against the tile's lower-triangular block set, and that each
has an unroll factor for both of its loops, without a GPU; and that the intra chains sum over whole steps that cover
every real head column.
"""
import collections

import pytest

from kdajit import compiler

compiler._cute()  # CuTe DSL with the arch pinned, before the template module imports it
from kdajit.templates import tile_intra  # noqa: E402

SCHEDULES = {(warps, safe_gate, chunk): tile_intra.warp_schedule(warps, safe_gate, chunk)
             for warps in (4, 8) for safe_gate in (True, False) for chunk in (32, 64)}


@pytest.mark.parametrize("warps, safe_gate, chunk", sorted(SCHEDULES))
def test_each_block_is_written_once(warps, safe_gate, chunk):
    schedule = SCHEDULES[(warps, safe_gate, chunk)]
    assert len(schedule) == warps
    count = collections.Counter()
    for groups in schedule:
        for a, diagonal, col_blocks in groups:
            # a diagonal group ends with its own block a (the one the epilogue masks); the others lie left of it
            off_diagonal = col_blocks[:-1] if diagonal else col_blocks
            assert not diagonal or col_blocks[-1] == a, f"diagonal group {a} lists columns {col_blocks}"
            assert all(b < a for b in off_diagonal), f"group {a} lists {col_blocks}"
            # the any-gate path shifts a diagonal block's reference: its A side serves no other block
            assert safe_gate or not diagonal or len(col_blocks) == 1, f"any-gate diagonal group {a}: {col_blocks}"
            count.update((a, b) for b in col_blocks)
    blocks = chunk // tile_intra.SUB
    expected = {(a, b) for a in range(blocks) for b in range(a + 1)}
    assert set(count) == expected, f"missing {sorted(expected - set(count))}, extra {sorted(set(count) - expected)}"
    assert all(n == 1 for n in count.values()), {block: n for block, n in count.items() if n > 1}
    unrolls = tile_intra.EXACT_UNROLL if not safe_gate else tile_intra.MAINLOOP_UNROLL
    assert schedule in tile_intra.MAINLOOP_UNROLL and schedule in unrolls


@pytest.mark.parametrize("head_k", range(4, 257, 4))
def test_summed_columns_cover_the_head_within_the_tile(head_k):
    """The intra chains sum over `summed_cols(K)` columns: all K real ones (fewer would drop terms), whole steps of
    both mainloops (MMA_K, EXACT_STEP), and no column past the padded tile (which holds other data)."""
    from kdajit.keys import padded_head_dim

    cols = tile_intra.summed_cols(head_k)
    assert head_k <= cols <= padded_head_dim(head_k)
    assert cols % tile_intra.MMA_K == 0 and cols % tile_intra.EXACT_STEP == 0
    assert cols < head_k + tile_intra.MMA_K
