"""CPU: benchmarks/other_tree.py runs a script with another checkout's kdajit, never this one's.

`compare_objects.py` compares kernels exported from two trees; if `other_tree.py` silently imported this checkout's
packages instead of the named tree's, both exports would be the same code and the comparison would report "same bits"
for any change. This runs a probe script through it on a copy of the packages whose kernel module carries a marker.
"""
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = """
import kdajit, kdajit.templates.tile_intra as tile_intra, kdajit.cache_tools
print(kdajit.__file__)
print(kdajit.cache_tools.__file__)
print(getattr(tile_intra, "OTHER_TREE_MARKER", None))
"""


def run_probe(tmp_path, *prefix):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    out = subprocess.run([sys.executable, *prefix, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         check=True, env={**os.environ, "CUTE_DSL_ARCH": "sm_90a"})
    return out.stdout.split()


def test_the_named_tree_is_imported(tmp_path):
    tree = tmp_path / "tree"
    for package in ("kdajit", "templates", "cache_tools"):
        shutil.copytree(os.path.join(REPO, package), tree / package, ignore=shutil.ignore_patterns("__pycache__"))
    with open(tree / "templates" / "tile_intra.py", "a") as f:
        f.write("\nOTHER_TREE_MARKER = 'other'\n")
    kdajit_file, cache_tools_file, marker = run_probe(tmp_path, os.path.join(REPO, "benchmarks", "other_tree.py"),
                                                       str(tree))
    assert kdajit_file.startswith(str(tree)) and cache_tools_file.startswith(str(tree))
    assert marker == "other"
    # and without it, this checkout's (installed) packages
    assert run_probe(tmp_path)[2] == "None"
