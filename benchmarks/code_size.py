"""SASS code size of cached kernels: the `.text` sections of the cubins embedded in each cached object (CPU).

    python benchmarks/code_size.py CACHE_DIR [PATTERN]

PATTERN (a regular expression over the kernel's cache path, default: every kernel) picks the objects. Code size
is a budget of its own beside registers and shared memory: on the H200 a fused kernel whose SASS grew from
109 to 153 KB ran 2.2x slower with the same registers and no spills (docs/performance.md, blocked inverse).
"""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

from kdajit.cubins import embedded_cubins, text_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache_dir", type=pathlib.Path)
    parser.add_argument("pattern", nargs="?", default="", help="regular expression over the kernel's cache path")
    args = parser.parse_args(argv)
    rows = []
    for obj in sorted(args.cache_dir.rglob("kernel.o")):
        path = str(obj.relative_to(args.cache_dir).parent)
        if re.search(args.pattern, path):
            sizes = [text_bytes(c) for c in embedded_cubins(obj.read_bytes())]
            rows.append((path.split("/kernels/")[-1], sizes))
    if not rows:
        print(f"no kernel.o under {args.cache_dir} matches {args.pattern!r}")
        return 1
    print("| kernel (cache path) | SASS bytes |\n|---|---|")
    for path, sizes in rows:
        print(f"| {path} | {', '.join(f'{n:,}' for n in sizes) or 'no cubin found'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
