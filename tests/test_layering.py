"""Code-shape rules that keep the package maintainable (see docs/style-anchors in shared/)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("kdajit", "templates", "cache_tools") for p in (ROOT / d).rglob("*.py"))


def imported_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_sources_found():
    assert len(SOURCES) >= 8


def test_templates_import_only_leaves():
    # API -> tuner -> cache -> compiler -> templates -> keys: templates never reach back up.
    upward = ("kdajit.api", "kdajit.cache", "kdajit.compiler", "kdajit.tuner", "kdajit.cli", "kdajit.cache_tools",
              "torch")
    for path in (ROOT / "templates").glob("*.py"):
        bad = {m for m in imported_modules(path) if m.startswith(upward)}
        assert not bad, f"{path.name} imports {bad}"


RUNTIME_CACHE = sorted(p.name for p in (ROOT / "kdajit").glob("cache*.py")) + ["hints.py"]


def test_cache_does_not_import_the_api_or_the_tools():
    assert len(RUNTIME_CACHE) >= 8, RUNTIME_CACHE
    for name in RUNTIME_CACHE + ["compiler.py", "keys.py", "env.py"]:
        mods = imported_modules(ROOT / "kdajit" / name)
        upward = ("kdajit.api", "kdajit.cli", "kdajit.cache_tools", "kdajit.tuner", "kdajit.tune_")
        assert not {m for m in mods if m.startswith(upward)}, name


TUNER = sorted(p.name for p in (ROOT / "kdajit").glob("tune*.py"))


def test_tuner_sits_between_the_api_and_the_cache():
    # API -> tuner -> cache: the tuner's modules never import the API, the CLI or the tools.
    assert TUNER == ["tune_guard.py", "tune_records.py", "tune_timing.py", "tuner.py"], TUNER
    for name in TUNER:
        mods = imported_modules(ROOT / "kdajit" / name)
        assert not {m for m in mods if m.startswith(("kdajit.api", "kdajit.cli", "kdajit.cache_tools"))}, name


def test_cache_layout_is_parsed_in_one_place():
    # Only kdajit/cache_layout.py spells the layout's path patterns; everyone else asks it.
    for path in SOURCES:
        if path.name == "cache_layout.py":
            continue
        text = path.read_text()
        for pattern in ("/kernels/", "tc-[0-9a-f]", "tc-*", "[3:]", ".split(\"/\")[2]", "parts[2]", "v1/"):
            assert pattern not in text, f"{path.relative_to(ROOT)} parses cache paths itself ({pattern!r})"


def test_runtime_cache_writes_no_cli_syntax():
    for name in RUNTIME_CACHE:
        if name == "hints.py":
            continue
        text = (ROOT / "kdajit" / name).read_text()
        assert '"kdajit", "precompile"' not in text and '"--' not in text, f"{name} builds command lines"


def test_environment_is_read_only_in_env_module():
    for path in SOURCES:
        if path.name == "env.py":
            continue
        text = path.read_text()
        assert "os.environ" not in text and "os.getenv" not in text, f"{path} reads the environment"


def test_cute_compile_is_called_in_one_place():
    callers = [p.name for p in SOURCES if "cute.compile(" in p.read_text()]
    assert callers == ["compiler.py"], callers


def test_one_kernel_class_per_template_file():
    for path in (ROOT / "templates").glob("*.py"):
        if path.name in ("__init__.py", "common.py"):
            continue
        if path.name.startswith("tile_"):
            # Per-tile device functions shared by several kernels: no kernel of their own.
            assert "@cute.kernel" not in path.read_text(), f"{path.name} must hold device functions only"
            continue
        text = path.read_text()
        assert text.count("@cute.kernel") == 1, f"{path.name} must hold exactly one @cute.kernel"
        classes = [n for n in ast.parse(text).body if isinstance(n, ast.ClassDef)]
        assert len(classes) == 1, f"{path.name} must hold exactly one class, has {[c.name for c in classes]}"
