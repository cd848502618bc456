"""Sizes, durations, times and tables as the `kdajit cache` verbs print and parse them."""
from __future__ import annotations

import re
from datetime import datetime, timezone


def iso(ts: float | None) -> str | None:
    if not ts:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def short_time(text_or_ts) -> str:
    if text_or_ts is None or text_or_ts == 0:
        return "-"
    if isinstance(text_or_ts, (int, float)):
        return datetime.fromtimestamp(text_or_ts, timezone.utc).strftime("%Y-%m-%d %H:%M")
    return str(text_or_ts).replace("T", " ")[:16]


def human_size(n: int) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024 or unit == "G":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"


_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_TIME_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """'5G', '500M', '64K', '1000' (bytes); binary units."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"size {text!r} is not like 5G, 500M, 64K or 1000")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def parse_duration(text: str) -> float:
    """'30d', '12h', '90m', '45s', '2w' (seconds)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not m:
        raise ValueError(f"duration {text!r} is not like 30d, 12h, 90m, 45s or 2w")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def print_table(rows: list[list[str]], header: list[str]) -> None:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for r in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
