"""CPU tests of the FLA backend: verifier decisions, the switch, and kdajit without FLA installed.

Device checks come last in kdajit's validation, so the accepting cases stand the check in for CPU tensors.
Registration into a real FLA runs where FLA is importable (the GPU machine's bundle has FLA 0.6.0).
"""
import importlib.util
import sys

import pytest
import torch

from kdajit import reference, validate
from kdajit.integrations import fla as kdajit_fla

VERSION = kdajit_fla.SUPPORTED_FLA_VERSIONS[0]
HAS_FLA = importlib.util.find_spec("fla") is not None


@pytest.fixture
def inputs():
    return reference.make_inputs(1, 130, 2, generator=torch.Generator().manual_seed(0))


@pytest.fixture
def any_device(monkeypatch):
    monkeypatch.setattr(validate, "check_devices", lambda **tensors: torch.device("cpu"))


def intra_reason(x, **overrides):
    kwargs = dict(scale=0.1, safe_gate=True, fla_version=VERSION)
    kwargs.update(overrides)
    return kdajit_fla.intra_decline_reason(x["q"], x["k"], x["v"], x["gk"], x["beta"], **kwargs)


def test_accepts_what_kdajit_covers(inputs, any_device):
    assert intra_reason(inputs) is None
    assert intra_reason(inputs, lower_bound=-5.0, chunk_indices=torch.zeros(3), use_graph=True,
                        disable_recompute=True) is None
    akk = torch.zeros(1, 130, 2, 64, dtype=torch.bfloat16)
    assert kdajit_fla.recompute_decline_reason(inputs["k"], inputs["v"], inputs["beta"], akk, inputs["gk"],
                                               q=inputs["q"], fla_version=VERSION) is None


def test_accepts_any_gate_and_routes_it_to_the_any_gate_path(inputs, any_device):
    """FLA's default safe_gate=False and a lower_bound steeper than kdajit's bound run kdajit's any-gate path;
    only safe_gate=True within the bound runs the safe-gate fast path."""
    assert intra_reason(inputs, safe_gate=False) is None
    assert intra_reason(inputs, lower_bound=-6.0) is None
    assert kdajit_fla.kdajit_safe_gate(True, None) is True
    assert kdajit_fla.kdajit_safe_gate(True, -5.0) is True
    assert kdajit_fla.kdajit_safe_gate(True, -6.0) is False
    assert kdajit_fla.kdajit_safe_gate(False, None) is False
    assert kdajit_fla.kdajit_safe_gate(False, -1.0) is False


@pytest.mark.parametrize("overrides, words", [
    ({"safe_gate": None}, "safe_gate=None"),
    ({"lower_bound": "steep"}, "lower_bound='steep'"),
    ({"fla_version": "0.7.0"}, "0.7.0"),
    ({"new_flag": True}, "new_flag"),
    ({"chunk_size": 128}, "chunk_size"),
    ({"scale": float("inf")}, "scale"),
])
def test_declines_with_a_reason(inputs, any_device, overrides, words):
    reason = intra_reason(inputs, **overrides)
    assert reason is not None and words in reason, reason


@pytest.mark.parametrize("head_k, head_v", [(64, 64), (128, 128), (256, 256), (64, 128), (256, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_accepts_every_covered_dtype_and_head_size(any_device, dtype, head_k, head_v):
    # FLA's fp16 tests draw beta in the input dtype too.
    x = reference.make_inputs(1, 130, 2, head_k, head_v, beta_dtype=dtype, io_dtype=dtype,
                              generator=torch.Generator().manual_seed(0))
    assert intra_reason(x) is None
    akk = torch.zeros(1, 130, 2, 64, dtype=dtype)
    assert kdajit_fla.recompute_decline_reason(x["k"], x["v"], x["beta"], akk, x["gk"], q=x["q"],
                                               fla_version=VERSION) is None


def test_accepts_grouped_value_heads(any_device):
    """FLA's grouped value heads (v, gk, beta with HV = 2H heads, q and k with H): both entry points take them."""
    x = reference.make_inputs(1, 130, 2, value_heads=4, generator=torch.Generator().manual_seed(0))
    assert intra_reason(x) is None
    akk = torch.zeros(1, 130, 4, 64, dtype=torch.bfloat16)
    assert kdajit_fla.recompute_decline_reason(x["k"], x["v"], x["beta"], akk, x["gk"], q=x["q"],
                                               fla_version=VERSION) is None
    assert "Akk must have shape [1, 130, 4, 64]" in kdajit_fla.recompute_decline_reason(
        x["k"], x["v"], x["beta"], akk[:, :, :2].contiguous(), x["gk"], fla_version=VERSION)


def test_declines_other_inputs(inputs, any_device):
    x = dict(inputs)
    assert "float16" in intra_reason({**x, "q": x["q"].half()})  # q fp16, k bf16
    assert "float32" in intra_reason({**x, **{n: x[n].float() for n in ("q", "k", "v")}})
    assert "K" in intra_reason({**x, **{n: x[n][..., :98].contiguous() for n in ("q", "k", "gk")}})
    assert "V (v.shape[-1])=98" in intra_reason({**x, "v": x["v"][..., :98].contiguous()})
    assert intra_reason({**x, **{n: x[n][..., :100].contiguous() for n in ("q", "k", "v", "gk")}}) is None  # FLA's K
    # HV = 3 value heads cannot group the 2 query / key heads
    ungroupable = {**x, "v": x["v"][:, :, :1].repeat(1, 1, 3, 1), "gk": x["gk"][:, :, :1].repeat(1, 1, 3, 1),
                   "beta": x["beta"][:, :, :1].repeat(1, 1, 3)}
    assert "multiple of H=2" in intra_reason(ungroupable)
    batch2 = {n: torch.cat([x[n], x[n]]) for n in ("q", "k", "v", "gk", "beta")}
    assert "batch size must be 1" in intra_reason(batch2, cu_seqlens=torch.tensor([0, 130], dtype=torch.int32))


def test_declines_cpu_tensors_without_the_stand_in(inputs):
    assert "CUDA" in intra_reason(inputs)


def test_switch_and_context_manager(monkeypatch):
    monkeypatch.setattr(kdajit_fla, "_state", {"enabled": False, "registered": True})
    assert not kdajit_fla.is_enabled()
    if not HAS_FLA:
        monkeypatch.setitem(sys.modules, "fla.backends", type(sys)("fla.backends"))
        sys.modules["fla.backends"].register = None
    with kdajit_fla.enabled():
        assert kdajit_fla.is_enabled()
    assert not kdajit_fla.is_enabled()
    kdajit_fla.enable()
    assert kdajit_fla.is_enabled()
    kdajit_fla.disable()
    assert not kdajit_fla.is_enabled()


def test_enable_without_fla_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.setitem(sys.modules, "fla.backends", None)
    with pytest.raises(ImportError, match="flash-linear-attention"):
        kdajit_fla.enable()


@pytest.mark.skipif(not HAS_FLA, reason="FLA is not installed")
def test_registers_into_fla_and_matches_its_signatures(monkeypatch):
    from fla.backends import _get_operation_registry

    monkeypatch.setattr(kdajit_fla, "_state", {"enabled": False, "registered": False})
    kdajit_fla._check_signatures()
    kdajit_fla.enable()
    backend = _get_operation_registry("kda")._backends[kdajit_fla.BACKEND_NAME]
    assert backend.is_enabled()
    kdajit_fla.disable()
    assert not backend.is_enabled()


def test_environment_switch_at_import():
    import os
    import subprocess

    code = ("import warnings; warnings.simplefilter('always')\n"
            "import kdajit\nfrom kdajit.integrations import fla\nprint('enabled', fla.is_enabled())")
    env = dict(os.environ, KDAJIT_FLA_BACKEND="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if HAS_FLA:
        assert "enabled True" in done.stdout
    else:
        assert "enabled False" in done.stdout and "KDAJIT_FLA_BACKEND=1" in done.stderr


def test_fla_version_is_looked_up_once(monkeypatch):
    """Each importlib.metadata lookup scans the installed distributions; the verifiers run on every
    dispatched call, so the version is looked up once per process."""
    import importlib.metadata

    calls = []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: calls.append(name) or "0.6.0")
    kdajit_fla._fla_version.cache_clear()
    try:
        assert kdajit_fla._fla_version() == kdajit_fla._fla_version() == "0.6.0"
        assert calls == ["fla-core"]
    finally:
        kdajit_fla._fla_version.cache_clear()
