"""Every bad input raises before any kernel runs, with a message naming the argument.

CPU tensors suffice: the device check is the last rule, so each case below is rejected by the rule it
targets (the final case checks that valid CPU inputs are rejected for their device).
"""
import pytest
import torch

import kdajit
from kdajit import api, validate
from kdajit.keys import HEAD_DIMS, PADDED_HEAD_DIM_EXAMPLES
from kdajit.outputs import IO_TORCH_DTYPES

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
    ("K unsupported", dict(q=torch.randn(B, T, H, 98).to(torch.bfloat16)), NotImplementedError, ["K", "98", "multiple of 4"]),
    ("k shape", dict(k=torch.randn(B, T, H + 1, K).to(torch.bfloat16)), ValueError, ["k", "[1, 130, 3, 128]"]),
    ("gk shape", dict(gk=torch.randn(B, T - 1, H, K)), ValueError, ["gk", "[1, 129, 2, 128]"]),
    ("beta shape", dict(beta=torch.rand(B, T, H, 1).to(torch.bfloat16)), ValueError, ["beta", "[B, T, HV]"]),
    ("gk heads not a multiple of H", dict(gk=torch.randn(B, T, H + 1, K)), ValueError,
     ["gk", "multiple of H=2", "[1, 130, 3, 128]"]),
    ("beta heads not gk's", dict(gk=torch.randn(B, T, 2 * H, K)), ValueError, ["beta", "[1, 130, 4]", "HV"]),
    ("v shape", dict(v=torch.randn(B, T, H + 1, V).to(torch.bfloat16)), ValueError, ["v", "[1, 130, 3, 128]"]),
    ("V unsupported", dict(v=torch.randn(B, T, H, 98).to(torch.bfloat16)), NotImplementedError, ["V", "98"]),
    ("q non-contiguous", dict(q=torch.randn(B, T, K, H).to(torch.bfloat16).transpose(2, 3)), ValueError,
     ["q", "contiguous"]),
    ("k misaligned view", dict(k=torch.randn(B * T * H * K + 1).to(torch.bfloat16)[1:].view(B, T, H, K)),
     ValueError, ["k", "aligned"]),
    ("chunk 16", dict(chunk_size=16), NotImplementedError, ["chunk_size", "16", "[32, 64]"]),
    ("scale nan", dict(scale=float("nan")), ValueError, ["scale", "nan"]),
    ("scale tensor", dict(scale=torch.tensor(0.1)), ValueError, ["scale"]),
    ("gate path not a bool", dict(safe_gate=1), TypeError, ["safe_gate=1", "bool", "-5"]),
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


@pytest.mark.parametrize("call, expected", [
    (lambda a: kdajit.chunk_kda_fwd_intra(a["q"], a["k"], a["v"], a["gk"], a["beta"], 0.1), False),
    (lambda a: kdajit.forward(a["q"], a["k"], a["v"], a["gk"], a["beta"]), True),
    (lambda a: kdajit.forward(a["q"], a["k"], a["v"], a["gk"], a["beta"], safe_gate=False), False),
    (lambda a: kdajit.intra(a["q"], a["k"], a["gk"], a["beta"], safe_gate=False), False),
], ids=["fla-default", "forward-default", "forward-any-gate", "intra-any-gate"])
def test_gate_path_reaches_the_kernel_lookup(monkeypatch, call, expected):
    """FLA's default safe_gate=False runs kdajit's any-gate path; kdajit's own entry points default to the
    safe-gate path. The lookup is stopped before any kernel is needed."""
    seen = []

    def lookup(*args, safe_gate=True, **kwargs):
        seen.append(safe_gate)
        raise LookupError("stop before the launch")

    monkeypatch.setattr(validate, "check_devices", lambda **tensors: torch.device("cpu"))
    monkeypatch.setattr(api, "_device_index", lambda t: 0)
    monkeypatch.setattr(api, "_kernels", lookup)
    with pytest.raises(LookupError):
        call(inputs())
    assert seen == [expected]


def test_recompute_rejects_bad_akk_and_q():
    args = inputs()
    akk = torch.zeros(B, T, H, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"Akk must have dtype bfloat16 \(the dtype of k\), got float32"):
        kdajit.recompute_w_u(args["k"], args["v"], args["beta"], akk.float(), args["gk"])
    with pytest.raises(ValueError, match=r"Akk must have shape \[1, 130, 2, 64\]"):
        kdajit.recompute_w_u(args["k"], args["v"], args["beta"], akk[:, :, :, :32], args["gk"])
    with pytest.raises(TypeError, match="q must have dtype bfloat16"):
        kdajit.recompute_w_u(args["k"], args["v"], args["beta"], akk, args["gk"], q=args["q"].float())
    with pytest.raises(ValueError, match="k must be a CUDA tensor"):
        kdajit.recompute_w_u(args["k"], args["v"], args["beta"], akk, args["gk"])


def test_intra_checks_without_v():
    args = inputs()
    with pytest.raises(ValueError, match=r"gk must have shape \[B, T, HV, K\] = \[1, 130, HV, 128\] with HV a "
                                         r"multiple of H=2"):
        kdajit.intra(args["q"], args["k"], args["gk"][:, :, :1], args["beta"])


# Issue 11, part 3: each case passed validation (or failed with the wrong error) before the fix.

def beta_at_offset(offset_bytes, dtype=torch.bfloat16):
    """A contiguous [B, T, H] beta whose data starts `offset_bytes` into a fresh allocation."""
    skip = offset_bytes // torch.empty(0, dtype=dtype).element_size()
    return torch.rand(B * T * H + skip).to(dtype)[skip:].view(B, T, H)


def test_bf16_beta_at_a_2_byte_offset_is_refused():
    # The kernels assume 4-byte aligned beta (fake tensor assumed_align=4); TVM-FFI used to reject it deep inside.
    with pytest.raises(ValueError, match=r"beta must start at a 4-byte aligned address"):
        call_forward(beta=beta_at_offset(2))
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        call_forward(beta=beta_at_offset(4))


def test_a_remembered_signature_still_checks_addresses_and_cu_seqlens_values(monkeypatch):
    """A valid call's signature (dtypes, shapes, strides, devices) skips the full checks next time; what the
    signature does not hold (where the data starts, what cu_seqlens holds) is checked on every call."""
    monkeypatch.setattr(validate, "check_devices", lambda **tensors: None)
    full_checks = []
    value_heads = validate._value_heads
    monkeypatch.setattr(validate, "_value_heads", lambda *a: full_checks.append(1) or value_heads(*a))
    x = inputs()
    cu = torch.tensor([0, 64, 130], dtype=torch.int32)
    first = validate.check_forward_inputs(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu, 64)
    again = validate.check_forward_inputs(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu, 64)
    assert again == first and len(full_checks) == 1, "the second call of the same signature ran the full checks"
    with pytest.raises(ValueError, match=r"beta must start at a 4-byte aligned address"):
        validate.check_forward_inputs(x["q"], x["k"], x["v"], x["gk"], beta_at_offset(2), cu, 64)
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing"):
        validate.check_forward_inputs(x["q"], x["k"], x["v"], x["gk"], x["beta"],
                                      torch.tensor([0, 140, 130], dtype=torch.int32), 64)
    assert len(full_checks) == 1
    with pytest.raises(TypeError, match=r"beta must have dtype"):
        validate.check_forward_inputs(x["q"], x["k"], x["v"], x["gk"], x["beta"].double(), cu, 64)
    assert len(full_checks) == 2, "another signature must take the full checks"


@pytest.fixture
def cu_reads(monkeypatch):
    """Every read of cu_seqlens' values (`validate._cu_values`), from a fresh memo; devices unchecked (CPU)."""
    monkeypatch.setattr(validate, "check_devices", lambda **tensors: None)
    monkeypatch.setattr(validate, "_checked_cu", (None, None, None))
    reads = []
    cu_values = validate._cu_values
    monkeypatch.setattr(validate, "_cu_values", lambda cu: reads.append(1) or cu_values(cu))
    return reads


def check_cu(cu, tokens=130):
    x = inputs()
    return validate.check_forward_inputs(x["q"], x["k"], x["v"], x["gk"], x["beta"], cu, 64) if tokens == 130 \
        else validate._check_cu_values(cu, tokens)


def test_cu_seqlens_values_cross_to_the_host_once_per_tensor_and_write(cu_reads):
    """A model's layers share one cu_seqlens per step: its values are read (a host synchronisation) on its first call
    only, until torch records a write to it; a new tensor with the same values, an in-place write, another T and an
    inference tensor (no version counter) are read again, and values that failed are never remembered."""
    cu = torch.tensor([0, 64, 130], dtype=torch.int32)
    for _ in range(3):
        check_cu(cu)
    assert len(cu_reads) == 1, "an unwritten cu_seqlens was read again"
    check_cu(cu.clone())
    assert len(cu_reads) == 2, "another tensor with the same values must be read"
    with pytest.raises(ValueError, match="end at T=131"):
        check_cu(cu, tokens=131)  # the same tensor, another T
    cu = torch.tensor([0, 64, 130], dtype=torch.int32)
    check_cu(cu)
    assert len(cu_reads) == 4
    cu[1] = 140  # in place: the version counter moves
    for _ in range(2):  # a tensor that failed is read (and fails) again
        with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing, got cu_seqlens\[1\]=140"):
            check_cu(cu)
    cu[1] = 64
    check_cu(cu)
    cu[1:2].fill_(131)  # through a view: the same counter
    with pytest.raises(ValueError, match=r"non-decreasing"):
        check_cu(cu)
    cu_reads.clear()
    with torch.inference_mode():
        frozen = torch.tensor([0, 64, 130], dtype=torch.int32)
        check_cu(frozen)
        check_cu(frozen)
    assert len(cu_reads) == 2, "an inference tensor has no version counter: its values must be read every call"


def test_strict_validation_reads_cu_seqlens_on_every_call(cu_reads, monkeypatch):
    """KDAJIT_VALIDATE=strict also catches writes the version counter misses (collectives, `.data`, raw kernels)."""
    cu = torch.tensor([0, 64, 130], dtype=torch.int32)
    check_cu(cu)
    cu.data[1] = 140  # not recorded by the version counter
    check_cu(cu)  # full: remembered
    monkeypatch.setenv("KDAJIT_VALIDATE", "strict")
    with pytest.raises(ValueError, match=r"non-decreasing"):
        check_cu(cu)
    assert len(cu_reads) == 2


def test_compiled_validation_reads_every_cu_seqlens(cu_reads):
    """Under torch.compile the tensor's identity is not guarded, so a remembered tensor must not let another through
    (intra / recompute_w_u with out= trace the validation itself)."""
    compiled = torch.compile(check_cu, backend="eager")
    good = torch.tensor([0, 64, 130], dtype=torch.int32)
    compiled(good)
    compiled(good)
    with pytest.raises(ValueError, match=r"non-decreasing"):
        compiled(torch.tensor([0, 200, 130], dtype=torch.int32))


def test_validation_checks_the_alignment_every_kernel_assumes():
    # Validation and the templates' fake tensors must agree on every tensor argument of every kernel.
    from kdajit import compiler, validate
    from kdajit.keys import BETA_DTYPES, VARLEN_MODES, ForwardSpec

    # What the kernels' accesses need: 16-byte vector loads/stores of [B, T, H, D] rows; beta and the
    # cu_seqlens are read element by element (4 bytes covers fp32 and int32; int64 is checked by size).
    expected = {**dict.fromkeys(("q", "k", "v", "gk", "Akk", "L", "Aqk", "w", "u", "kg", "qg"), 16),
                "beta": 4, "cu_seqlens": 4}
    assert validate.ALIGNMENT == expected
    checked = set()
    for spec in (ForwardSpec(b, m, 128, 128, 64, True, "sm_90a") for b in BETA_DTYPES for m in VARLEN_MODES):
        for key in spec.kernel_keys():
            tensors = [a.name for a in key.ARGS if a.kind != "scalar"]
            fakes = [a for a in compiler.template_class(key)(key).fake_args() if hasattr(a, "_assumed_align")]
            assert len(fakes) == len(tensors), key
            for name, fake in zip(tensors, fakes):
                assert validate.ALIGNMENT[name] == fake._assumed_align, (key.TEMPLATE, name)
                checked.add(name)
    assert checked == set(validate.ALIGNMENT)


class IndexLike:
    """An integer-like object that compares equal to 64 (numpy integers behave so)."""

    def __index__(self):
        return 64

    def __eq__(self, other):
        return other == 64

    __hash__ = None


@pytest.mark.parametrize("chunk_size", [64.0, True, IndexLike(), "64"], ids=["float", "bool", "index-like", "str"])
def test_chunk_size_must_be_a_python_int(chunk_size):
    with pytest.raises(TypeError, match=r"chunk_size must be a Python int.*got"):
        call_forward(chunk_size=chunk_size)


@pytest.mark.parametrize("scale", [10**400, 1e39, -1e39, float("inf")], ids=["huge-int", "1e39", "-1e39", "inf"])
def test_scale_must_be_finite_in_fp32(scale):
    with pytest.raises(ValueError, match=r"scale must be a finite .*float32"):
        call_forward(scale=scale)


@pytest.mark.parametrize("scale", [3.4e38, 10**38, 1e-50, -0.5], ids=["3.4e38", "int", "tiny", "negative"])
def test_scale_inside_fp32_range_is_accepted(scale):
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):  # the device rule: every other rule passed
        call_forward(scale=scale)


def fresh_out(qg=True):
    nan = lambda *shape: torch.full(shape, float("nan"), dtype=torch.bfloat16)
    return kdajit.ForwardOutput(nan(B, T, H, 64), nan(B, T, H, 64), nan(B, T, H, K), nan(B, T, H, V),
                                nan(B, T, H, K), nan(B, T, H, K) if qg else None)


def forward_with_out(args, out, output_qg=True):
    return kdajit.forward(args["q"], args["k"], args["v"], args["gk"], args["beta"], out=out, output_qg=output_qg)


def test_out_buffers_are_accepted_when_disjoint():
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        forward_with_out(inputs(), fresh_out())
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):  # out.qg is ignored without output_qg
        forward_with_out(inputs(), fresh_out()._replace(qg=inputs()["q"]), output_qg=False)


def test_out_aliasing_an_input_is_refused():
    args = inputs()
    with pytest.raises(ValueError, match=r"out\.w overlaps k"):
        forward_with_out(args, fresh_out()._replace(w=args["k"]))
    with pytest.raises(ValueError, match=r"out\.qg overlaps q"):
        forward_with_out(args, fresh_out()._replace(qg=args["q"]))
    # A partial overlap: out.Aqk's bytes start inside gk's storage.
    aqk = args["gk"].view(-1).view(torch.bfloat16)[64:64 + B * T * H * 64].view(B, T, H, 64)
    with pytest.raises(ValueError, match=r"out\.Aqk overlaps gk"):
        forward_with_out(args, fresh_out()._replace(Aqk=aqk))
    akk, w = overlapping((B, T, H, 64), (B, T, H, K))
    with pytest.raises(ValueError, match=r"out\.w overlaps Akk"):
        kdajit.recompute_w_u(args["k"], args["v"], args["beta"], akk, args["gk"], out=fresh_out()._replace(w=w))


def overlapping(first, second, shared=64):
    """Two contiguous bf16 tensors of the given shapes whose storages share `shared` elements."""
    n1, n2 = torch.Size(first).numel(), torch.Size(second).numel()
    storage = torch.zeros(n1 + n2 - shared, dtype=torch.bfloat16)
    return storage[:n1].view(first), storage[n1 - shared:].view(second)


def test_out_buffers_aliasing_each_other_are_refused():
    out = fresh_out()
    with pytest.raises(ValueError, match=r"out\.Akk overlaps out\.Aqk"):
        forward_with_out(inputs(), out._replace(Akk=out.Aqk))
    w, kg = overlapping((B, T, H, K), (B, T, H, K))
    with pytest.raises(ValueError, match=r"out\.kg overlaps out\.w"):
        forward_with_out(inputs(), out._replace(w=w, kg=kg))


@pytest.mark.parametrize("dim,name", [(2, "H"), (0, "B")])
def test_grid_limits_on_heads_and_batch(dim, name):
    shape = [B, 1, H, K]
    shape[dim] = 65536
    big = torch.empty(1, 1, 1, K, dtype=torch.bfloat16).expand(*shape)  # no memory; the grid rule comes first
    with pytest.raises(ValueError, match=rf"{name}=65536 .*65535"):
        kdajit.forward(big, big, big, big.float(), big[..., 0])


def test_grid_limit_on_varlen_chunk_count():
    cu = torch.zeros(1, dtype=torch.int32).expand(2**31)  # N = 2**31 - 1 sequences: grid x = T // 64 + N
    with pytest.raises(ValueError, match=r"cu_seqlens.*2147483647"):
        call_forward(cu_seqlens=cu)


@pytest.mark.parametrize("head_dim", HEAD_DIMS + PADDED_HEAD_DIM_EXAMPLES)
@pytest.mark.parametrize("io", sorted(IO_TORCH_DTYPES))
def test_every_covered_io_dtype_and_head_size_is_accepted(io, head_dim, monkeypatch):
    monkeypatch.setattr(validate, "check_devices", lambda **tensors: None)  # the last rule: CPU tensors pass
    dtype = IO_TORCH_DTYPES[io]
    x = {n: torch.randn(B, T, H, head_dim).to(dtype) for n in ("q", "k", "v")}
    gk, beta = -torch.rand(B, T, H, head_dim), torch.rand(B, T, H).to(dtype)
    problem = validate.check_recompute_inputs(x["k"], x["v"], beta, torch.zeros(B, T, H, 64, dtype=dtype), gk,
                                              x["q"], None, 64)
    assert (problem.io_dtype, problem.head_k, problem.head_v) == (io, head_dim, head_dim)
    # Every output is in the inputs' dtype: an out= buffer of the other 16-bit dtype is refused by name.
    other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
    wrong = torch.zeros(B, T, H, 64, dtype=other)
    with pytest.raises(ValueError, match=rf"out\.Aqk must be .* {str(dtype)[6:]} tensor"):
        validate.check_forward_inputs(x["q"], x["k"], x["v"], gk, beta, None, 64, {"Aqk": wrong})
    with pytest.raises(TypeError, match=rf"Akk must have dtype {str(dtype)[6:]} \(the dtype of q\)"):
        validate.check_recompute_inputs(x["k"], x["v"], beta, wrong, gk, x["q"], None, 64)


@pytest.mark.parametrize("group", [2, 4])
def test_grouped_value_heads_are_accepted(group, monkeypatch):
    """q, k with H heads and v, gk, beta with HV = group * H (FLA's grouped value heads): every output has HV heads."""
    monkeypatch.setattr(validate, "check_devices", lambda **tensors: None)
    HV = group * H
    q, k = (torch.randn(B, T, H, K).to(torch.bfloat16) for _ in range(2))
    v, gk, beta = torch.randn(B, T, HV, V).to(torch.bfloat16), -torch.rand(B, T, HV, K), torch.rand(B, T, HV)
    problem = validate.check_forward_inputs(q, k, v, gk, beta, None, 64)
    assert (problem.heads, problem.qk_heads) == (HV, H)
    akk = torch.zeros(B, T, HV, 64, dtype=torch.bfloat16)
    assert validate.check_recompute_inputs(k, v, beta, akk, gk, q, None, 64).heads == HV
    with pytest.raises(ValueError, match=rf"Akk must have shape \[1, 130, {HV}, 64\]"):
        validate.check_recompute_inputs(k, v, beta, akk[:, :, :H].contiguous(), gk, q, None, 64)
    with pytest.raises(ValueError, match=rf"out\.w must be .* of shape \[1, 130, {HV}, 128\]"):
        validate.check_forward_inputs(q, k, v, gk, beta, None, 64, {"w": torch.zeros(B, T, H, K, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=rf"v must have shape \[B, T, HV, V\] = \[1, 130, {HV}, V\]"):
        validate.check_forward_inputs(q, k, v[:, :, :H].contiguous(), gk, beta, None, 64)
