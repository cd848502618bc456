"""Hostile inputs (issue 11, part 4): every invalid call raises a clear error before any kernel is fetched.

The table runs on CPU tensors: the device rule is validation's last, so each row is rejected by the rule it
targets, and the kernel lookup is patched to fail, so an error raised after a fetch (or a compile) would show.
`test_lookup_sentinel_is_reachable` proves that valid inputs do reach the patched lookup.
"""
import types

import pytest
import torch

import kdajit
from kdajit import api, cache, compiler, validate

B, T, H, K, V = 1, 130, 2, 128, 128
bf16 = torch.bfloat16


class KernelFetched(AssertionError):
    """Raised by the patched kernel lookup: validation let the call through."""


@pytest.fixture(autouse=True)
def no_kernels(monkeypatch):
    def fetched(*args, **kwargs):
        raise KernelFetched("a kernel was fetched")

    monkeypatch.setattr(api, "_kernels", fetched)
    monkeypatch.setattr(cache, "get_kernel", fetched)
    monkeypatch.setattr(compiler, "compile_key", fetched)


def inputs(batch=B, tokens=T, heads=H):
    return dict(q=torch.randn(batch, tokens, heads, K).to(bf16), k=torch.randn(batch, tokens, heads, K).to(bf16),
                v=torch.randn(batch, tokens, heads, V).to(bf16), gk=-torch.rand(batch, tokens, heads, K),
                beta=torch.rand(batch, tokens, heads).to(bf16))


def at_offset(t, offset_bytes):
    """`t`'s values in a contiguous tensor that starts `offset_bytes` into its allocation."""
    skip = offset_bytes // t.element_size()
    flat = torch.empty(t.numel() + skip, dtype=t.dtype)
    view = flat[skip:].view(t.shape)
    view.copy_(t)
    return view


def huge(dim, size):
    """A [B, T, H, K] bf16 tensor with one huge dimension and no memory (stride 0)."""
    shape = [B, 1, H, K]
    shape[dim] = size
    return torch.empty(1, 1, 1, K, dtype=bf16).expand(*shape)


def cu(*values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


def full_out(**fields):
    nan = lambda *shape: torch.full(shape, float("nan"), dtype=bf16)
    out = kdajit.ForwardOutput(nan(B, T, H, 64), nan(B, T, H, 64), nan(B, T, H, K), nan(B, T, H, V),
                               nan(B, T, H, K), nan(B, T, H, K))
    return out._replace(**fields)


X = inputs()  # shared, read-only
OUT = full_out()
KWARGS = ("cu_seqlens", "chunk_size", "scale", "safe_gate", "output_qg", "out")

CASES = [
    # (id, overrides of the inputs and keyword arguments, exception type, words the message must contain)
    # dtypes
    ("q float32", dict(q=X["q"].float()), TypeError, ["q", "bfloat16 or float16", "float32"]),
    ("q float16, k bfloat16", dict(q=X["q"].half()), TypeError, ["k", "float16", "the dtype of q", "bfloat16"]),
    ("k int8", dict(k=X["k"].to(torch.int8)), TypeError, ["k", "int8"]),
    ("v float32", dict(v=X["v"].float()), TypeError, ["v", "float32"]),
    ("gk float64", dict(gk=X["gk"].double()), TypeError, ["gk", "float32", "float64"]),
    ("beta float64", dict(beta=X["beta"].double()), TypeError, ["beta", "bfloat16 or float16 or float32", "float64"]),
    ("cu_seqlens int16", dict(cu_seqlens=cu(0, T, dtype=torch.int16)), TypeError, ["cu_seqlens", "int16"]),
    ("cu_seqlens float", dict(cu_seqlens=torch.tensor([0.0, T])), TypeError, ["cu_seqlens", "int32 or int64"]),
    # shapes
    ("q 5-D", dict(q=X["q"][None]), ValueError, ["q", "4-D"]),
    ("v 3-D", dict(v=X["v"][0]), ValueError, ["v", "[B, T, HV, V]"]),
    ("beta [B, T]", dict(beta=X["beta"][..., 0]), ValueError, ["beta", "[B, T, HV]", "[1, 130]"]),
    ("gk short T", dict(gk=X["gk"][:, :-1]), ValueError, ["gk", "[1, 129, 2, 128]"]),
    ("k other H", dict(k=X["k"][:, :, :1]), ValueError, ["k", "[1, 130, 1, 128]"]),
    # devices
    ("meta tensors", {n: t.to("meta") for n, t in X.items()}, ValueError, ["q", "CUDA", "meta"]),
    ("cpu tensors", dict(), ValueError, ["q", "CUDA", "cpu"]),
    # strides
    ("q transposed", dict(q=torch.randn(B, H, T, K).to(bf16).transpose(1, 2)), ValueError,
     ["q", "contiguous", "strides"]),
    ("gk broadcast", dict(gk=X["gk"][:, :, :1].expand(B, T, H, K)), ValueError, ["gk", "contiguous"]),
    ("beta strided", dict(beta=torch.rand(B, T, 2 * H).to(bf16)[..., ::2]), ValueError, ["beta", "contiguous"]),
    ("cu_seqlens strided", dict(cu_seqlens=cu(0, 5, 64, 9, T, 0)[::2]), ValueError, ["cu_seqlens", "contiguous"]),
    # alignments (what the kernels assume: 16 bytes for [B, T, H, D] tensors, 4 for beta)
    ("bf16 beta at +2 bytes", dict(beta=at_offset(X["beta"], 2)), ValueError, ["beta", "4-byte aligned"]),
    ("gk at +4 bytes", dict(gk=at_offset(X["gk"], 4)), ValueError, ["gk", "16-byte aligned"]),
    ("v at +8 bytes", dict(v=at_offset(X["v"], 8)), ValueError, ["v", "16-byte aligned"]),
    ("fp32 beta at +4 bytes is fine", dict(beta=at_offset(X["beta"].float(), 4)), ValueError, ["q", "CUDA"]),
    # cu_seqlens values
    ("cu_seqlens unsorted", dict(cu_seqlens=cu(0, 100, 30, T)), ValueError,
     ["cu_seqlens", "non-decreasing", "cu_seqlens[1]=100 > cu_seqlens[2]=30"]),
    ("cu_seqlens beyond T", dict(cu_seqlens=cu(0, 1000000, T)), ValueError, ["cu_seqlens", "non-decreasing"]),
    ("cu_seqlens not ending at T", dict(cu_seqlens=cu(0, 64, 129, dtype=torch.int64)), ValueError,
     ["cu_seqlens", "end at T=130", "last=129"]),
    ("cu_seqlens negative start", dict(cu_seqlens=cu(-1, T)), ValueError, ["cu_seqlens", "start at 0", "first=-1"]),
    ("cu_seqlens 2-D", dict(cu_seqlens=cu(0, T)[None]), ValueError, ["cu_seqlens", "1-D"]),
    ("cu_seqlens empty", dict(cu_seqlens=cu(0)[:0]), ValueError, ["cu_seqlens", "N >= 1"]),
    ("cu_seqlens with B=2", dict(inputs(batch=2), cu_seqlens=cu(0, T)), ValueError, ["batch size must be 1", "B=2"]),
    ("T=0 with cu_seqlens to 64", dict(inputs(tokens=0), cu_seqlens=cu(0, 64)), ValueError,
     ["cu_seqlens", "T=0", "last=64"]),
    # unsupported specializations
    ("K=98", dict(q=torch.zeros(B, T, H, 98, dtype=bf16)), NotImplementedError, ["K", "98", "a multiple of 4"]),
    ("K=260", dict(q=torch.zeros(B, T, H, 260, dtype=bf16)), NotImplementedError, ["K", "260", "to 256"]),
    ("K=256 with k of K=128", dict(q=torch.zeros(B, T, H, 256, dtype=bf16)), ValueError, ["k", "[1, 130, 2, 256]"]),
    ("V=98", dict(v=torch.zeros(B, T, H, 98, dtype=bf16)), NotImplementedError, ["V", "98", "a multiple of 4"]),
    ("chunk 128", dict(chunk_size=128), NotImplementedError, ["chunk_size", "128", "[32, 64]"]),
    ("chunk 64.0", dict(chunk_size=64.0), TypeError, ["chunk_size", "Python int", "float"]),
    ("chunk True", dict(chunk_size=True), TypeError, ["chunk_size", "bool"]),
    ("gate path not a bool", dict(safe_gate=None), TypeError, ["safe_gate=None", "bool", "-5"]),
    # out-of-range sizes
    ("H=65536", dict(q=huge(2, 65536)), ValueError, ["H=65536", "q.shape[2]", "65535"]),
    ("B=65536", dict(q=huge(0, 65536)), ValueError, ["B=65536", "grid z", "65535"]),
    ("T=2**31", dict(q=huge(1, 2**31)), ValueError, ["T=2147483648", "2**31"]),
    ("N=2**31-1 sequences", dict(cu_seqlens=cu(0).expand(2**31)), ValueError, ["cu_seqlens", "2147483647"]),
    ("scale 10**400", dict(scale=10**400), ValueError, ["scale", "float32", "401 characters"]),
    ("scale 1e39", dict(scale=1e39), ValueError, ["scale", "float32", "1e+39"]),
    ("scale -inf", dict(scale=float("-inf")), ValueError, ["scale", "-inf"]),
    ("scale str", dict(scale="0.1"), ValueError, ["scale", "str"]),
    # out= buffers
    ("out not a ForwardOutput", dict(out=(None,) * 6), TypeError, ["out", "ForwardOutput", "tuple"]),
    ("out.Aqk float32", dict(out=full_out(Aqk=torch.zeros(B, T, H, 64))), ValueError, ["out.Aqk", "bfloat16"]),
    ("out.u wrong V", dict(out=full_out(u=torch.zeros(B, T, H, 64, dtype=bf16))), ValueError,
     ["out.u", "[1, 130, 2, 128]"]),
    ("out.qg missing", dict(out=full_out(qg=None), output_qg=True), ValueError, ["out.qg", "NoneType"]),
    ("out.w is k", dict(out=full_out(w=X["k"])), ValueError, ["out.w overlaps k"]),
    ("out.Akk is out.Aqk", dict(out=OUT._replace(Akk=OUT.Aqk)), ValueError, ["out.Akk overlaps out.Aqk"]),
]


def call(overrides):
    args = dict(X)
    args.update({n: t for n, t in overrides.items() if n not in KWARGS})
    kwargs = {n: overrides[n] for n in KWARGS if n in overrides}
    return kdajit.forward(args["q"], args["k"], args["v"], args["gk"], args["beta"], **kwargs)


def test_table_is_large_enough():
    assert len(CASES) >= 25


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_invalid_call_fails_before_any_kernel(case):
    desc, overrides, exc, words = case
    with pytest.raises(exc) as info:
        call(overrides)
    assert not isinstance(info.value, KernelFetched), f"{desc}: validation let it through"
    for word in words:
        assert word in str(info.value), f"{desc}: {word!r} not in {info.value}"


def test_lookup_sentinel_is_reachable(monkeypatch):
    # With the device rule switched off, valid CPU inputs get to the (patched) kernel lookup.
    monkeypatch.setattr(validate, "check_devices", lambda **tensors: torch.device("cpu"))
    monkeypatch.setattr(api, "_device_index", lambda t: 0)
    with pytest.raises(KernelFetched):
        call(dict(out=full_out(), cu_seqlens=cu(0, 1, 64, 65, T)))


def test_cu_seqlens_on_the_cpu_with_cuda_inputs():
    # No CUDA tensor can exist here: the device rule reads only `.device`, so a stand-in emulates one.
    cuda_q = types.SimpleNamespace(device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"cu_seqlens is on cpu but q is on cuda:0"):
        validate.check_devices(q=cuda_q, k=cuda_q, cu_seqlens=cu(0, T))
    with pytest.raises(ValueError, match=r"out\.w is on cpu but q is on cuda:0"):
        validate.check_devices(q=cuda_q, **{"out.w": X["k"]})
