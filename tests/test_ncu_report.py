"""CPU: benchmarks/ncu_report.py on a tiny Nsight Compute source-page CSV (no ncu needed).

The report is how a profile's bank conflicts are found per phase (docs/performance.md, twenty-fifth session: 35% of
the intra phase's shared-memory wavefronts were beyond the ideal): each segment between barriers must carry its own
wavefronts and excess, and the kernel's totals their sums.
"""
import csv
import gzip
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import ncu_report  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "L1 Wavefronts Shared",
          "L1 Wavefronts Shared Excessive", "stall_wait", "stall_barrier"]
ROWS = [  # (source, samples, executed, wavefronts, excess, wait, barrier)
    ("LDS.64 R2, [R4]", 10, 1_000_000, 4_000_000, 2_000_000, 8, 0),
    ("FMUL R3, R2, R2", 5, 2_000_000, 0, 0, 5, 0),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 20, 1_000_000, 0, 0, 0, 20),
    ("STS [R5], R3", 3, 1_000_000, 1_000_000, 0, 3, 0),
    ("EXIT", 1, 1_000_000, 0, 0, 1, 0),
]


def write_csv(path, header=HEADER, rows=None):
    """A one-kernel source-page CSV: `header`, then `rows` (default: ROWS, as ncu writes them, with addresses)."""
    if rows is None:
        rows = [[hex(16 * n), src, samples, f"{executed:,}", wf, ex, wait, barrier]
                for n, (src, samples, executed, wf, ex, wait, barrier) in enumerate(ROWS)]
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "kernel_test"])
        w.writerow(header)
        w.writerows(rows)


def test_segments_carry_their_shared_wavefronts_and_excess(tmp_path):
    path = tmp_path / "sass.csv.gz"
    write_csv(path)
    text = ncu_report.report(str(path), 0, 10)
    assert "5.0 M shared-memory wavefronts (2.0 M beyond the ideal: bank conflicts)" in text
    segments = [line for line in text.splitlines() if line.startswith("| 0-2 |") or line.startswith("| 3-4 |")]
    assert len(segments) == 2, text
    assert "| 4.00, 2.00 |" in segments[0] and "| 1.00, 0.00 |" in segments[1], segments


def test_a_csv_without_the_memory_columns_still_reports(tmp_path):
    """Sets other than `--set full` leave the shared-memory columns out: the report says 0 rather than failing."""
    path = tmp_path / "sass.csv.gz"
    write_csv(path, [h for h in HEADER if not h.startswith("L1")], [["0x0", "EXIT", 1, 1, 1, 0]])
    assert "0.0 M shared-memory wavefronts" in ncu_report.report(str(path), 0, 10)
