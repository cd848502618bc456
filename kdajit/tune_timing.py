"""How the tuner times candidates, and how it picks one from the times.

Timing: CUDA events around batches of launches on the current stream, after warm-up; each
candidate walks its own input sets in turn, enough of them that one pass reads more than twice the
GPU's L2 (so no candidate is timed on inputs the previous one left in cache); the candidates take
turns, repeat by repeat, so clock and thermal drift hit every candidate alike; a candidate's time is
the median over repeats. Choice: the fastest, except that every candidate within `TIE_FRACTION` of
the fastest ties and the earliest of them in the configuration space wins, so processes that time
the same space agree unless one configuration is clearly faster.
"""
from __future__ import annotations

import math
import statistics
from typing import Callable, Sequence, TypeVar

TIE_FRACTION = 0.01
WARMUP = 3
REPEATS = 21
BATCH_MS = 1.0  # aim per timed batch of launches (short kernels are launched several times per event pair)
MAX_INPUT_SETS = 16

C = TypeVar("C")


def input_sets_needed(bytes_per_set: int, l2_bytes: int) -> int:
    """Input sets a candidate rotates through so that one pass over them exceeds twice the L2."""
    return max(1, min(MAX_INPUT_SETS, math.ceil(2 * l2_bytes / max(1, bytes_per_set))))


def time_launches(launches: dict[str, Sequence[Callable[[], None]]], *, repeats: int = REPEATS,
                  warmup: int = WARMUP) -> dict[str, float]:
    """Median milliseconds per launch of each candidate; `launches[name]` holds one launch per input set."""
    import torch

    def run(name: str, n: int) -> None:
        sets = launches[name]
        for i in range(n):
            sets[i % len(sets)]()

    batch = {}
    for name, sets in launches.items():  # warm up, then size each candidate's batch from one timed pass
        run(name, warmup * len(sets))
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(name, len(sets))
        end.record()
        end.synchronize()
        per_launch = max(start.elapsed_time(end) / len(sets), 1e-3)
        batch[name] = max(len(sets), math.ceil(BATCH_MS / per_launch))
    events = {name: [] for name in launches}
    for _ in range(repeats):
        for name in launches:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(name, batch[name])
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) / batch[name] for s, e in pairs)
            for name, pairs in events.items()}


def choose(order: Sequence[C], times: dict[C, float]) -> C:
    """The winner among the timed candidates (`times`), ties within TIE_FRACTION of the fastest going to
    the earliest in `order` (the configuration space's order, reference first)."""
    if not times:
        raise ValueError("no candidate was timed")
    best = min(times.values())
    return next(c for c in order if c in times and times[c] <= best * (1 + TIE_FRACTION))
