"""What a new user meets first: `kdajit --version`, the demo's arguments, a bad KDAJIT_ARCH, no GPU, no numpy.

Everything runs in this process (no compile): the demo's compile step is replaced by a recorder where a
test only needs to see what the demo would run with.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import kdajit
from kdajit import cache, cli, demo, keys


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`kdajit ARGV` in this process: (exit code, stdout, stderr); argparse's exits are exit codes too."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_version(capsys):
    rc, out, _ = run_cli(capsys, "--version")
    assert rc == 0 and out.strip() == f"kdajit {kdajit.__version__}"


@pytest.mark.parametrize("argv,words", [
    (["--heads", "0"], ["--heads", "'0'", "at least 1"]),
    (["--heads", "two"], ["--heads", "'two'", "not an integer"]),
    (["--lengths", "abc"], ["--lengths", "'abc'", "comma-separated"]),
    (["--lengths", "5,-1"], ["--lengths", ">= 0"]),
    (["--lengths", "0,0"], ["--lengths", "at least one token"]),
    (["--beta", "fp64"], ["--beta", "fp64", "bf16"]),
    (["--gate", "steep"], ["--gate", "steep", "any"]),
])
def test_demo_refuses_bad_arguments(capsys, argv, words):
    rc, out, err = run_cli(capsys, "demo", *argv)
    assert rc == 2 and "Traceback" not in err
    assert all(w in err for w in words), err


def test_demo_takes_cache_dir_and_runs_with_it(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("KDAJIT_CACHE_DIR", raising=False)  # restored after the test, like the demo's setting
    monkeypatch.delenv("KDAJIT_ARCH", raising=False)
    seen = {}

    def record(args, arch):
        seen.update(root=cache.cache_root(), arch=arch, lengths=args.lengths, heads=args.heads, gate=args.gate)
        return 0

    monkeypatch.setattr(demo, "_compile_only", record)
    monkeypatch.setattr(demo, "_run_on_gpu", record)
    rc, _, err = run_cli(capsys, "demo", "--cache-dir", str(tmp_path / "c"), "--lengths", "3,0,70", "--heads", "2",
                         "--gate", "any")
    assert rc == 0, err
    assert seen.pop("arch") in keys.ARCHS
    assert seen == {"root": tmp_path / "c", "lengths": [3, 0, 70], "heads": 2, "gate": "any"}


def test_bad_kdajit_arch_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setenv("KDAJIT_ARCH", "sm_12")
    rc, out, err = run_cli(capsys, "demo")
    assert rc == 2 and "Traceback" not in err
    assert "KDAJIT_ARCH='sm_12'" in err and "sm_90a" in err, err
    rc, out, _ = run_cli(capsys, "env", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["arch"] is None and doc["arch_source"] == "KDAJIT_ARCH"
    assert "KDAJIT_ARCH='sm_12'" in doc["arch_error"] and "sm_100a" in doc["arch_error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without a GPU shows")
def test_cpu_tensors_point_to_the_reference():
    x = {n: torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16) for n in ("q", "k", "v")}
    with pytest.raises(ValueError, match="q must be a CUDA tensor") as info:
        kdajit.forward(x["q"], x["k"], x["v"], torch.zeros(1, 64, 1, 128), torch.zeros(1, 64, 1, dtype=torch.bfloat16))
    assert "kdajit.reference.forward_reference" in str(info.value)


def test_no_numpy_warning_on_import():
    # torch's CPU wheel warns "Failed to initialize NumPy" while importing when numpy is missing;
    # kdajit declares numpy so an installed kdajit never shows it.
    code = "import kdajit, kdajit.reference, kdajit.cli, torch; torch.zeros(2).tolist()"
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
