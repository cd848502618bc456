"""Every bad input raises before any kernel runs, with a message naming the argument.

CPU tensors suffice: the device check is the last rule, so each case below is rejected by the rule it
targets (the final case checks that valid CPU inputs are rejected for their device).
"""
import pytest
import torch

import kdajit

B, T, H, K, V = 1, 130, 2, 128, 128


def inputs(beta_dtype=torch.bfloat16):
    return dict(
        q=torch.randn(B, T, H, K).to(torch.bfloat16),
        k=torch.randn(B, T, H, K).to(torch.bfloat16),
        v=torch.randn(B, T, H, V).to(torch.bfloat16),
        gk=-torch.rand(B, T, H, K),
        beta=torch.rand(B, T, H).to(beta_dtype),
    )


def call_forward(**overrides):
    args = inputs()
    kwargs = {k: overrides.pop(k) for k in ("cu_seqlens", "chunk_size", "scale", "safe_gate", "output_qg")
              if k in overrides}
    args.update(overrides)
    return kdajit.forward(args["q"], args["k"], args["v"], args["gk"], args["beta"], **kwargs)


CASES = [
    # (description, overrides, exception type, words the message must contain)
    ("q wrong dtype", dict(q=torch.randn(B, T, H, K)), TypeError, ["q", "bfloat16", "float32"]),
    ("k wrong dtype", dict(k=torch.randn(B, T, H, K, dtype=torch.float16)), TypeError, ["k", "float16"]),
    ("v wrong dtype", dict(v=torch.randn(B, T, H, V)), TypeError, ["v", "float32"]),
    ("gk wrong dtype", dict(gk=torch.randn(B, T, H, K).to(torch.bfloat16)), TypeError, ["gk", "float32"]),
    ("beta wrong dtype", dict(beta=torch.rand(B, T, H, dtype=torch.float64)), TypeError, ["beta", "float64"]),
    ("q not a tensor", dict(q=[1.0]), TypeError, ["q", "torch.Tensor", "list"]),
    ("q 3-D", dict(q=torch.randn(T, H, K).to(torch.bfloat16)), ValueError, ["q", "4-D", "[130, 2, 128]"]),
    ("K unsupported", dict(q=torch.randn(B, T, H, 96).to(torch.bfloat16)), NotImplementedError, ["K", "96", "128"]),
    ("k shape", dict(k=torch.randn(B, T, H + 1, K).to(torch.bfloat16)), ValueError, ["k", "[1, 130, 3, 128]"]),
    ("gk shape", dict(gk=torch.randn(B, T - 1, H, K)), ValueError, ["gk", "[1, 129, 2, 128]"]),
    ("beta shape", dict(beta=torch.rand(B, T, H, 1).to(torch.bfloat16)), ValueError, ["beta", "[B, T, H]"]),
    ("v shape", dict(v=torch.randn(B, T, H + 1, V).to(torch.bfloat16)), ValueError, ["v", "[1, 130, 3, 128]"]),
    ("V unsupported", dict(v=torch.randn(B, T, H, 64).to(torch.bfloat16)), NotImplementedError, ["V", "64"]),
    ("q non-contiguous", dict(q=torch.randn(B, T, K, H).to(torch.bfloat16).transpose(2, 3)), ValueError,
     ["q", "contiguous"]),
    ("k misaligned view", dict(k=torch.randn(B * T * H * K + 1).to(torch.bfloat16)[1:].view(B, T, H, K)),
     ValueError, ["k", "aligned"]),
    ("chunk 32", dict(chunk_size=32), NotImplementedError, ["chunk_size", "32", "64"]),
    ("scale nan", dict(scale=float("nan")), ValueError, ["scale", "nan"]),
    ("scale tensor", dict(scale=torch.tensor(0.1)), ValueError, ["scale"]),
    ("unsafe gate", dict(safe_gate=False), NotImplementedError, ["safe_gate=False", "-5"]),
    ("cu_seqlens float", dict(cu_seqlens=torch.tensor([0.0, 130.0])), TypeError, ["cu_seqlens", "int32", "int64"]),
    ("cu_seqlens 2-D", dict(cu_seqlens=torch.tensor([[0, 130]], dtype=torch.int32)), ValueError,
     ["cu_seqlens", "1-D"]),
    ("cu_seqlens too short", dict(cu_seqlens=torch.tensor([0], dtype=torch.int32)), ValueError,
     ["cu_seqlens", "N >= 1"]),
    ("cu_seqlens first", dict(cu_seqlens=torch.tensor([1, 130], dtype=torch.int32)), ValueError,
     ["cu_seqlens", "start at 0", "first=1"]),
    ("cu_seqlens last", dict(cu_seqlens=torch.tensor([0, 64, 129], dtype=torch.int64)), ValueError,
     ["cu_seqlens", "T=130", "last=129"]),
    ("cu_seqlens decreasing", dict(cu_seqlens=torch.tensor([0, 70, 60, 130], dtype=torch.int32)), ValueError,
     ["cu_seqlens", "non-decreasing", "cu_seqlens[1]=70"]),
    ("cpu tensors", dict(), ValueError, ["q", "CUDA", "cpu"]),
]


@pytest.mark.parametrize("desc,overrides,exc,words", CASES, ids=[c[0] for c in CASES])
def test_forward_rejects(desc, overrides, exc, words):
    with pytest.raises(exc) as info:
        call_forward(**overrides)
    for word in words:
        assert word in str(info.value), f"{desc}: {word!r} not in {info.value}"


def test_cu_seqlens_needs_batch_one():
    args = inputs()
    args = {n: torch.cat([t, t]) for n, t in args.items()}
    with pytest.raises(ValueError, match=r"batch size must be 1.*B=2"):
        kdajit.forward(**args, cu_seqlens=torch.tensor([0, 130], dtype=torch.int32))


def test_chunk_kda_fwd_intra_default_gate_is_refused():
    # FLA's default safe_gate=False means "any gate": kdajit refuses rather than risking overflow.
    args = inputs()
    with pytest.raises(NotImplementedError, match="safe_gate=False"):
        kdajit.chunk_kda_fwd_intra(args["q"], args["k"], args["v"], args["gk"], args["beta"], 0.1)


def test_recompute_rejects_bad_akk_and_q():
    args = inputs()
    akk = torch.zeros(B, T, H, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="Akk must have dtype bfloat16, got float32"):
        kdajit.recompute_w_u(args["k"], args["v"], args["beta"], akk.float(), args["gk"])
    with pytest.raises(ValueError, match=r"Akk must have shape \[1, 130, 2, 64\]"):
        kdajit.recompute_w_u(args["k"], args["v"], args["beta"], akk[:, :, :, :32], args["gk"])
    with pytest.raises(TypeError, match="q must have dtype bfloat16"):
        kdajit.recompute_w_u(args["k"], args["v"], args["beta"], akk, args["gk"], q=args["q"].float())
    with pytest.raises(ValueError, match="k must be a CUDA tensor"):
        kdajit.recompute_w_u(args["k"], args["v"], args["beta"], akk, args["gk"])


def test_intra_checks_without_v():
    args = inputs()
    with pytest.raises(ValueError, match=r"gk must have shape \[1, 130, 2, 128\]"):
        kdajit.intra(args["q"], args["k"], args["gk"][:, :, :1], args["beta"])
