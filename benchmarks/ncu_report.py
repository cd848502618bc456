"""Summarize one kernel's SASS-level Nsight Compute data: where the instructions, the stall samples and the
shared-memory wavefronts go.

    ncu --profile-from-start off --clock-control none --set full -o OUT \\
        python3 benchmarks/fused_phases.py --objects DIR --only tile-w8.all --profile
    ncu -i OUT.ncu-rep --page source --csv --print-source sass | gzip > sass.csv.gz
    python benchmarks/ncu_report.py sass.csv.gz [--kernel 0] [--top 25]

(`bash benchmarks/h200_session.sh ncu` runs the first two on the device machine.) Reads the per-instruction
table of the first (or `--kernel`-th) kernel in the CSV and prints markdown: the opcode mix (executed warp
instructions and share of stall samples), the stall samples by reason over the whole kernel, the code cut into
segments at every `BAR` (a CTA or named barrier: the phases of the fused kernel), each with its instructions,
samples, shared-memory wavefronts (and those beyond the ideal: bank conflicts), main opcodes and stall reasons,
and the instructions that hold the most samples (a barrier's or a wait's samples land on the instruction after it).
Needs no GPU and no third-party package.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import re
import sys

KEPT_SUFFIXES = ("MUFU", "HMMA", "LDS", "STS", "LDG", "STG", "LDSM", "LDGSTS", "F2FP", "BAR")


def read_kernel(path: str, index: int) -> tuple[str, list[dict]]:
    """(kernel name, rows of its per-instruction table) of the index-th kernel in an ncu source CSV."""
    opener = gzip.open if path.endswith(".gz") else open
    name, header, rows, seen = "", None, [], -1
    with opener(path, "rt", newline="") as f:
        for row in csv.reader(f):
            if row and row[0] == "Kernel Name":
                seen += 1
                if seen > index:
                    break
                name, header, rows = row[1], None, []
            elif row and row[0] == "Address":
                header = row
            elif header and seen == index and len(row) == len(header):
                rows.append(dict(zip(header, row)))
    if not rows:
        raise SystemExit(f"{path}: no per-instruction table for kernel {index} (expected `ncu -i REP --page source "
                         f"--csv --print-source sass` output)")
    return name, rows


def number(text: str) -> float:
    text = text.replace(",", "").strip()
    return float(text) if text and text != "-" else 0.0


def opcode(source: str) -> str:
    """The opcode of one SASS line, predicate removed; modifiers kept for the opcodes in KEPT_SUFFIXES."""
    words = re.sub(r"^@!?U?P\w+\s+", "", source.strip()).split()
    op = words[0] if words else "?"
    return op if op.split(".")[0] in KEPT_SUFFIXES else op.split(".")[0]


def report(path: str, index: int, top: int) -> str:
    name, rows = read_kernel(path, index)
    stall_columns = [h for h in rows[0] if h.startswith("stall_") and "Not Issued" not in h]
    executed = [number(r["Instructions Executed"]) for r in rows]
    samples = [number(r["Warp Stall Sampling (All Samples)"]) for r in rows]
    ops = [opcode(r["Source"]) for r in rows]
    wavefronts = [number(r.get("L1 Wavefronts Shared", "")) for r in rows]
    excess = [number(r.get("L1 Wavefronts Shared Excessive", "")) for r in rows]
    total, total_samples = sum(executed) or 1.0, sum(samples) or 1.0
    out = [f"# {name[:100]}", "",
           f"{total / 1e6:.1f} M warp instructions executed, {total_samples:.0f} stall samples, "
           f"{sum(wavefronts) / 1e6:.1f} M shared-memory wavefronts ({sum(excess) / 1e6:.1f} M beyond the ideal: "
           "bank conflicts)", ""]

    mix: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for op, e, s in zip(ops, executed, samples):
        mix[op][0] += e
        mix[op][1] += s
    out += ["| opcode | executed (M) | share | stall samples |", "|---|---|---|---|"]
    for op, (e, s) in sorted(mix.items(), key=lambda kv: -kv[1][0])[:top]:
        out.append(f"| {op} | {e / 1e6:.2f} | {100 * e / total:.1f}% | {100 * s / total_samples:.1f}% |")

    reasons = collections.Counter()
    for row in rows:
        for column in stall_columns:
            reasons[column[len("stall_"):]] += number(row[column])
    reason_total = sum(reasons.values()) or 1.0
    out += ["", "| stall reason (whole kernel) | samples | share |", "|---|---|---|"]
    for reason, count in reasons.most_common(top):
        if count:
            out.append(f"| {reason} | {count:.0f} | {100 * count / reason_total:.1f}% |")

    out += ["", "| lines | executed | stall samples | shared wavefronts (M), beyond ideal | main opcodes (M) | "
            "main stall reasons |", "|---|---|---|---|---|---|"]
    start = 0
    for i, op in enumerate(ops):
        if not (op.startswith("BAR") or i == len(ops) - 1):
            continue
        seg = range(start, i + 1)
        e, s = sum(executed[j] for j in seg), sum(samples[j] for j in seg)
        start = i + 1
        if e / total < 0.003:
            continue
        seg_mix = collections.Counter()
        stalls = collections.Counter()
        for j in seg:
            seg_mix[ops[j]] += executed[j]
            for column in stall_columns:
                stalls[column[len("stall_"):]] += number(rows[j][column])
        stall_total = sum(stalls.values()) or 1.0
        out.append(f"| {seg.start}-{seg.stop - 1} | {100 * e / total:.1f}% | {100 * s / total_samples:.1f}% | "
                   f"{sum(wavefronts[j] for j in seg) / 1e6:.2f}, {sum(excess[j] for j in seg) / 1e6:.2f} | "
                   + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in seg_mix.most_common(6)) + " | "
                   + ", ".join(f"{k} {100 * v / stall_total:.0f}%" for k, v in stalls.most_common(4)) + " |")

    out += ["", "| line | executed | stall samples | instruction |", "|---|---|---|---|"]
    for j in sorted(range(len(rows)), key=lambda j: -samples[j])[:top]:
        out.append(f"| {j} | {executed[j]:.0f} | {100 * samples[j] / total_samples:.1f}% | "
                   f"`{rows[j]['Source'].strip()[:80]}` |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="`ncu -i REP --page source --csv --print-source sass` output (.csv or .csv.gz)")
    parser.add_argument("--kernel", type=int, default=0, help="which kernel of the report (default 0, the first)")
    parser.add_argument("--top", type=int, default=25, help="rows of the opcode and hot-instruction tables")
    args = parser.parse_args(argv)
    print(report(args.csv, args.kernel, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
