"""CPU: benchmarks/rounds_table.py reads the `repeat` stage's rounds per tree and compares each tree with main's.

The table decides whether an experiment is faster than main: a round filed under the wrong tree, a median taken over
the wrong times or a ratio against the wrong row would rank experiments wrongly, and a file that does not follow the
naming would silently drop a tree.
"""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "rounds_table.py")


def write_round(tmp_path, round_number: int, tree: str, ms_by_variant: dict) -> str:
    path = tmp_path / f"repeat_{round_number}_{tree}.json"
    path.write_text(json.dumps([{"config": "persistent-c2-head-a1", "variant": variant, "ms": ms}
                                for variant, ms in ms_by_variant.items()]))
    return str(path)


def run_table(*paths):
    return subprocess.run([sys.executable, SCRIPT, *paths], capture_output=True, text=True)


def test_medians_spreads_and_ratios_per_tree(tmp_path):
    paths = [write_round(tmp_path, 1, "main", {"all": 1.00, "compute-only": 0.70}),
             write_round(tmp_path, 2, "main", {"all": 1.02, "compute-only": 0.70}),
             write_round(tmp_path, 3, "main", {"all": 0.98, "compute-only": 0.70}),
             write_round(tmp_path, 1, "exp_two", {"all": 0.90}),
             write_round(tmp_path, 2, "exp_two", {"all": 0.95}),
             write_round(tmp_path, 3, "exp_two", {"all": 0.91, "intra": 0.30}),
             write_round(tmp_path, 1, "a_exp", {"all": 1.10})]
    out = run_table(*paths)
    assert out.returncode == 0, out.stderr
    keys = [tuple(cell.strip() for cell in line.strip("|").split("|")[1:3]) for line in out.stdout.splitlines()[2:]]
    rows = dict(zip(keys, out.stdout.splitlines()[2:]))
    # by variant, main's row first, then the other trees by name
    assert keys == [("all", "main"), ("all", "a_exp"), ("all", "exp_two"), ("compute-only", "main"),
                    ("intra", "exp_two")]
    # main: median 1.000 of three rounds, spread (1.02 - 0.98) / 1.00
    assert "| 3 | 1.000 | 4.0% |  |" in rows[("all", "main")]
    # the experiment (an underscore in its name): median 0.910, spread 0.05 / 0.91, 9% below main's median
    assert "| 3 | 0.910 | 5.5% | -9.0% |" in rows[("all", "exp_two")]
    assert "| 3 | 0.700 | 0.0% |  |" in rows[("compute-only", "main")]
    assert "| 1 | 0.300 | 0.0% | n/a |" in rows[("intra", "exp_two")]  # main has no intra row
    assert "| 1 | 1.100 | 0.0% | +10.0% |" in rows[("all", "a_exp")]


@pytest.mark.parametrize("name", ["repeat_main.json", "rounds_1_main.json", "repeat_x_main.json", "repeat_1_.json"])
def test_a_misnamed_file_is_refused(tmp_path, name):
    path = tmp_path / name
    path.write_text("[]")
    out = run_table(str(path))
    assert out.returncode != 0
    assert name in out.stderr and "repeat_ROUND_TREE.json" in out.stderr
