"""Test tiers for per-key test cases: a fast tier that CI runs, and the full sweep (`pytest --full`).

A test parametrized over many kernel keys (every template x every specialization x every config)
grows multiplicatively as specializations are added. `tiered(keys, reference)` keeps it linear by
default: the fast tier holds each template's reference key plus a deterministic sample of the rest,
chosen so that every value of every key field (config fields included) is compiled at least once per
template. Every other key is a case marked `full`, which tests/conftest.py skips unless pytest runs
with `--full` (the sweep to run before submitting kernel changes). Nothing here knows the templates:
it works from the keys' canonical JSON, so new templates, fields and config spaces join on their own.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import pytest


def field_values(key) -> set[tuple]:
    """(template, field path, value) for every leaf of the key's JSON form (config fields included)."""
    out = set()

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for name, item in value.items():
                walk(f"{prefix}.{name}" if prefix else name, item)
        else:
            out.add((key.TEMPLATE, prefix, repr(value)))

    walk("", key.to_json())
    return out


def fast_tier(keys: Sequence, reference: Iterable) -> list:
    """The reference keys that occur in `keys`, then a greedy, deterministic cover of every field value.

    Each step adds the first key (in `keys` order) that covers the most values not yet covered, so the
    result depends only on `keys` and `reference`, and grows with the number of values, not with
    their product.
    """
    chosen = [k for k in dict.fromkeys(reference) if k in keys]
    covered = set().union(*(field_values(k) for k in chosen))
    remaining = [k for k in dict.fromkeys(keys) if k not in chosen]
    while remaining:
        gains = [len(field_values(k) - covered) for k in remaining]
        best = max(gains)
        if best == 0:
            break
        key = remaining.pop(gains.index(best))
        chosen.append(key)
        covered |= field_values(key)
    return chosen


def tiered(keys: Sequence, reference: Iterable, ids=None) -> list:
    """`keys` as pytest params in their order; those outside `fast_tier(keys, reference)` marked `full`."""
    fast = set(fast_tier(keys, reference))
    return [pytest.param(k, id=ids(k) if ids else None, marks=() if k in fast else pytest.mark.full)
            for k in dict.fromkeys(keys)]
