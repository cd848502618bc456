"""The `repeat` stage's timings (benchmarks/h200_session.sh) as one table.

    python benchmarks/rounds_table.py OUT/repeat_*.json

Each file is `fused_phases.py --json` output of one tree in one round, named repeat_ROUND_TREE.json. Per tree,
configuration and variant: the median over the rounds, the spread (largest - smallest, as % of the median) and the
median's ratio to tree `main`'s (n/a where main has no such row). A difference within either tree's spread is not
one.
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib
import statistics
import sys


def read_rounds(paths: list[str]) -> dict:
    """{(tree, config, variant): [ms of each round]} from files named repeat_ROUND_TREE.json."""
    times = collections.defaultdict(list)
    for path in paths:
        stem = pathlib.Path(path).stem
        prefix, _, rest = stem.partition("_")
        round_name, _, tree = rest.partition("_")
        if prefix != "repeat" or not round_name.isdigit() or not tree:
            raise SystemExit(f"rounds_table: {path}: expected a file named repeat_ROUND_TREE.json")
        for row in json.loads(pathlib.Path(path).read_text()):
            times[(tree, row["config"], row["variant"])].append(row["ms"])
    return times


def table(times: dict) -> str:
    """A markdown table of `read_rounds`' times, by configuration and variant, main first."""
    lines = ["| config | variant | tree | rounds | median ms | spread | vs main |", "|---|---|---|---|---|---|---|"]
    for tree, config, variant in sorted(times, key=table_order):
        ms = times[(tree, config, variant)]
        median = statistics.median(ms)
        spread = (max(ms) - min(ms)) / median * 100
        base = times.get(("main", config, variant))
        if tree == "main":
            ratio = ""
        elif base:
            ratio = f"{(median / statistics.median(base) - 1) * 100:+.1f}%"
        else:
            ratio = "n/a"
        lines.append(f"| {config} | {variant} | {tree} | {len(ms)} | {median:.3f} | {spread:.1f}% | {ratio} |")
    return "\n".join(lines)


def table_order(key: tuple) -> tuple:
    """Rows by configuration and variant, main's first, then the other trees by name."""
    tree, config, variant = key
    return config, variant, tree != "main", tree


def main(argv=None) -> int:
    """Print the table of the files named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="repeat_ROUND_TREE.json files")
    print(table(read_rounds(parser.parse_args(argv).files)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
