"""Run a script with `kdajit` imported from another checkout of this repository instead of the installed one.

    git worktree add /tmp/base <commit>
    python benchmarks/other_tree.py /tmp/base benchmarks/fused_phases.py --export DIR ...

The editable install maps this checkout's top-level `kdajit/`, `templates/` and `cache_tools/` to the packages
`kdajit`, `kdajit.templates` and `kdajit.cache_tools`; this does the same for TREE, in this process only, then runs
SCRIPT (a path, read from this checkout unless it is under TREE) with the remaining arguments. For exporting an
earlier commit's kernels beside this tree's (`benchmarks/compare_objects.py`) without reinstalling.
"""
from __future__ import annotations

import importlib.util
import os
import runpy
import sys

PACKAGES = (("kdajit", "kdajit"), ("kdajit.templates", "templates"), ("kdajit.cache_tools", "cache_tools"))


def import_tree(tree: str) -> None:
    """Import the packages of PACKAGES from `tree`, ahead of any installed or editable copy."""
    for name, directory in PACKAGES:
        path = os.path.join(tree, directory)
        spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                      submodule_search_locations=[path])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:  # what the import system does for a submodule it loads itself
            setattr(sys.modules[parent], child, module)
        spec.loader.exec_module(module)


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    tree, script = os.path.abspath(sys.argv[1]), sys.argv[2]
    if not os.path.isdir(os.path.join(tree, "kdajit")):
        raise SystemExit(f"TREE={tree!r}: expected a checkout of this repository (a kdajit/ directory)")
    import_tree(tree)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
