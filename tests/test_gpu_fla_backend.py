"""GPU: FLA's whole `chunk_kda` (forward and backward) with kdajit as its backend, against FLA's naive recurrence.

Shapes and tolerances are those of FLA's own KDA tests (tests/ops/test_kda.py: `test_chunk`,
`test_chunk_varlen`) with bf16 inputs and safe gates (per-token log-gate >= -5), and FLA's default
safe_gate=False with unclamped logsigmoid gates (kdajit's any-gate path). The test also checks that
the kdajit backend really ran (the forward intra stage once, the backward's W/U recompute once) and that
switching it off gives FLA's own result within the same tolerances.
"""
import pytest
import torch
import torch.nn.functional as F

import kdajit.api
from kdajit.integrations import fla as kdajit_fla

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
fla_kda = pytest.importorskip("fla.ops.kda", reason="flash-linear-attention is not installed")
from fla.ops.kda.naive import naive_recurrent_kda  # noqa: E402
from fla.utils import assert_close  # noqa: E402

# FLA's tolerances (relative error ratio) for test_chunk / test_chunk_varlen.
TOLERANCES = {"o": 0.005, "ht": 0.005, "dq": 0.008, "dk": 0.008, "dv": 0.008, "dg": 0.02, "db": 0.02, "dh0": 0.008}


@pytest.fixture
def counted(monkeypatch):
    """Counts of kdajit entry points the backend calls."""
    counts = {"chunk_kda_fwd_intra": 0, "recompute_w_u": 0}
    for name in counts:
        real = getattr(kdajit.api, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(kdajit.api, name, wrapper)
    return counts


def kda_inputs(B, T, H, D, N, seed, clamp=True, gate_scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = F.normalize(torch.rand(B, T, H, D, device="cuda", generator=g), dim=-1).bfloat16()
    k = F.normalize(torch.rand(B, T, H, D, device="cuda", generator=g), dim=-1).bfloat16()
    v = torch.rand(B, T, H, D, device="cuda", generator=g).bfloat16()
    gate = F.logsigmoid(torch.randn(B, T, H, D, device="cuda", generator=g)) * gate_scale
    gate = gate.clamp_min(-5.0) if clamp else gate
    beta = torch.rand(B, T, H, device="cuda", generator=g).sigmoid().bfloat16()
    h0 = torch.randn(N, H, D, D, device="cuda", generator=g)
    return [x.requires_grad_() for x in (q, k, v, gate, beta, h0)]


def grads_of(fn, tensors, do, dht):
    o, ht = fn()
    ((o * do).sum() + (ht * dht).sum()).backward()
    grads = [t.grad for t in tensors]
    for t in tensors:
        t.grad = None
    return o.detach(), ht.detach(), grads


def reference(q, k, v, gate, beta, h0, scale, cu):
    if cu is None:
        return naive_recurrent_kda(q, k, v, gate, beta, scale, initial_state=h0, output_final_state=True)
    outs, states = [], []
    for i, (a, b) in enumerate(zip(cu.tolist(), cu.tolist()[1:])):
        o, ht = naive_recurrent_kda(q[:, a:b], k[:, a:b], v[:, a:b], gate[:, a:b], beta[:, a:b], scale,
                                    initial_state=h0[i:i + 1], output_final_state=True)
        outs.append(o)
        states.append(ht)
    return torch.cat(outs, 1), torch.cat(states, 0)


# D = 60 and 100 are FLA's own padded head sizes: test_chunk's (2, 500, 3, 60) and (3, 1024, 4, 100) with gates
# 10x steeper (gate_logit_normalizer 0.1), test_chunk_varlen's D = 100 lengths.
@pytest.mark.parametrize("B, T, H, D, cu, safe_gate, gate_scale", [
    (4, 1024, 4, 128, None, True, 1), (2, 1000, 3, 128, None, True, 1), (1, 1000, 4, 128, [0, 256, 500, 1000], True, 1),
    (2, 1000, 3, 128, None, False, 1), (1, 1000, 4, 128, [0, 256, 500, 1000], False, 1),
    (2, 500, 3, 60, None, True, 1), (3, 1024, 4, 100, None, False, 10),
    (1, 2000, 4, 100, [0, 15, 100, 300, 1200, 2000], False, 1)],
    ids=["B4-T1024-H4", "B2-T1000-H3", "varlen-256-500-1000", "B2-T1000-H3-any-gate", "varlen-any-gate",
         "B2-T500-H3-D60", "B3-T1024-H4-D100-any-gate-x10", "varlen-D100-any-gate"])
def test_chunk_kda_with_kdajit_backend_matches_naive(counted, B, T, H, D, cu, safe_gate, gate_scale):
    cu = torch.tensor(cu, dtype=torch.long, device="cuda") if cu is not None else None
    N = B if cu is None else len(cu) - 1
    tensors = kda_inputs(B, T, H, D, N, seed=42, clamp=safe_gate, gate_scale=gate_scale)
    q, k, v, gate, beta, h0 = tensors
    scale = D ** -0.5
    do = torch.randn_like(v, dtype=torch.float32).bfloat16()
    dht = torch.randn_like(h0)

    def run_fla():
        return fla_kda.chunk_kda(q, k, v, gate, beta, scale=scale, initial_state=h0, output_final_state=True,
                                 safe_gate=safe_gate, cu_seqlens=cu)

    ref_o, ref_ht, ref_grads = grads_of(lambda: reference(*(t.float() for t in tensors[:5]), h0, scale, cu),
                                        tensors, do.float(), dht)
    with kdajit_fla.enabled():
        ours_o, ours_ht, ours_grads = grads_of(run_fla, tensors, do, dht)
    assert counted == {"chunk_kda_fwd_intra": 1, "recompute_w_u": 1}, counted
    fla_o, fla_ht, fla_grads = grads_of(run_fla, tensors, do, dht)
    assert counted == {"chunk_kda_fwd_intra": 1, "recompute_w_u": 1}, "backend still active after the block"

    for label, (o, ht, grads) in (("kdajit", (ours_o, ours_ht, ours_grads)), ("fla", (fla_o, fla_ht, fla_grads))):
        assert_close(f"{label} o", ref_o, o, TOLERANCES["o"])
        assert_close(f"{label} ht", ref_ht, ht, TOLERANCES["ht"])
        for name, r, t in zip(("dq", "dk", "dv", "dg", "db", "dh0"), ref_grads, grads):
            assert_close(f"{label} {name}", r, t, TOLERANCES[name])


def test_backend_declines_what_kdajit_does_not_cover_and_takes_any_gate(counted):
    q, k, v, gate, beta, h0 = kda_inputs(1, 128, 2, 98, 1, seed=0)  # K = 98: not a multiple of 4
    with kdajit_fla.enabled(), torch.no_grad():
        fla_kda.chunk_kda(q, k, v, gate, beta, initial_state=h0, output_final_state=True, safe_gate=True)
        assert counted == {"chunk_kda_fwd_intra": 0, "recompute_w_u": 0}
        q, k, v, gate, beta, h0 = kda_inputs(1, 128, 2, 128, 1, seed=0, clamp=False)
        o, ht = fla_kda.chunk_kda(q, k, v, gate * 10, beta, initial_state=h0, output_final_state=True,
                                  safe_gate=False)
    # FLA's default safe_gate=False (here with gates 10x steeper than logsigmoid) runs kdajit's any-gate intra.
    assert counted["chunk_kda_fwd_intra"] == 1, counted
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()


@pytest.mark.parametrize("cu", [None, [0, 1, 63, 65, 300]], ids=["dense", "varlen"])
def test_forward_and_backward_recompute_give_the_same_w_u_bits(counted, cu):
    """FLA's forward takes W, U, KG from `chunk_kda_fwd_intra`; its backward recomputes them with
    `recompute_w_u_fwd` from the forward's Akk. Through the backend both must give the same bits."""
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.kda.wy_fast import recompute_w_u_fwd

    from kdajit import reference

    cu_t = torch.tensor(cu, dtype=torch.int32) if cu is not None else None
    T = 300 if cu is None else cu[-1]
    x = reference.make_inputs(1 if cu else 2, T, 4, cu_seqlens=cu_t, device="cuda",
                              generator=torch.Generator().manual_seed(int(torch.randint(1 << 30, ()))))
    cu_gpu = cu_t.cuda().long() if cu_t is not None else None
    with kdajit_fla.enabled(), torch.no_grad():
        w, u, qg, kg, Aqk, Akk = chunk_kda_fwd_intra(x["q"], x["k"], x["v"], gk=x["gk"], beta=x["beta"],
                                                     scale=128 ** -0.5, cu_seqlens=cu_gpu, safe_gate=True)
        w2, u2, _, kg2 = recompute_w_u_fwd(k=x["k"], v=x["v"], beta=x["beta"], A=Akk, gk=x["gk"],
                                           cu_seqlens=cu_gpu)
    assert counted == {"chunk_kda_fwd_intra": 1, "recompute_w_u": 1}, counted
    for name, a, b in (("w", w, w2), ("u", u, u2), ("kg", kg, kg2)):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name}: forward and recompute differ"
