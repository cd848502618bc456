"""CPU tests of kdajit's torch.library ops: fake shapes, torch.compile without graph breaks, dynamic shapes.

On the CPU the kernels cannot run, so the compile tests register a stand-in CPU kernel for each op that
returns zeros of the fake shapes; what is tested is the tracing: one graph, no breaks, no recompile for
new B, T, H, and the API's autograd refusal. (The stand-ins stay registered for this test process; they
serve only CPU calls of the raw ops, which nothing else makes.) The GPU suite runs the real kernels compiled.
"""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

import kdajit
from kdajit import ops, reference


def inputs(B, T, H, requires_grad=False, dtype=torch.bfloat16, head_dim=128):
    x = reference.make_inputs(B, T, H, head_dim, head_dim, io_dtype=dtype, generator=torch.Generator().manual_seed(T))
    return [x[n].requires_grad_(requires_grad) for n in ("q", "k", "v", "gk", "beta")]


@pytest.fixture(scope="module")
def stand_in_kernels():
    for op, fake in ((ops.forward, ops._forward_fake), (ops.intra, ops._intra_fake),
                     (ops.recompute_w_u, ops._recompute_fake)):
        op.register_kernel("cpu")(lambda *args, _fake=fake: [t.zero_() for t in _fake(*args)])
    ops.forward_out.register_kernel("cpu")(lambda *args: [t.fill_(1) for t in args[8:13]] and None)


@pytest.mark.parametrize("dtype, head_dim", [(torch.bfloat16, 128), (torch.float16, 64)], ids=["bf16-128", "fp16-64"])
def test_fake_shapes_and_dtypes(dtype, head_dim):
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        q, k, v, gk, beta = (mode.from_tensor(t) for t in inputs(2, 130, 3, dtype=dtype, head_dim=head_dim))
        Aqk, Akk, w, u, kg, qg = torch.ops.kdajit.forward(q, k, v, gk, beta, 0.1, None, 64, True)
        assert Aqk.shape == Akk.shape == (*q.shape[:3], 64)
        assert all(t.dtype == dtype for t in (Aqk, Akk, w, u, kg, qg))
        assert w.shape == kg.shape == qg.shape == q.shape and u.shape == v.shape
        *_, no_qg = torch.ops.kdajit.forward(q, k, v, gk, beta, 0.1, None, 64, False)
        assert no_qg.numel() == 0


def test_fake_shapes_of_grouped_value_heads():
    """q, k with H = 2 heads, v, gk, beta with HV = 4: every output has HV heads."""
    x = reference.make_inputs(1, 70, 2, value_heads=4, generator=torch.Generator().manual_seed(0))
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        q, k, v, gk, beta = (mode.from_tensor(x[n]) for n in ("q", "k", "v", "gk", "beta"))
        Aqk, Akk, w, u, kg, qg = torch.ops.kdajit.forward(q, k, v, gk, beta, 0.1, None, 64, True)
        assert Aqk.shape == Akk.shape == (1, 70, 4, 64) and w.shape == kg.shape == qg.shape == gk.shape
        assert u.shape == v.shape
        assert [t.shape for t in torch.ops.kdajit.intra(q, k, gk, beta, 0.1, None, 64)] == [Aqk.shape] * 2
        w2, u2, kg2, qg2 = torch.ops.kdajit.recompute_w_u(k, v, beta, Akk, gk, None, 64, q)
        assert w2.shape == kg2.shape == qg2.shape == gk.shape and u2.shape == v.shape


def compile_counting(fn):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=True), graphs


def test_forward_compiles_to_one_graph_for_every_length(stand_in_kernels):
    def model(q, k, v, gk, beta):
        out = kdajit.forward(q, k, v, gk, beta, output_qg=True)
        return out.w * 2 + out.kg, out.Aqk.float().sum()

    compiled, graphs = compile_counting(model)
    # B, T, H >= 2: PyTorch gives sizes 0 and 1 graphs of their own (its 0/1 specialisation).
    for B, T, H in ((2, 100, 3), (3, 300, 2), (4, 65, 5)):  # distinct sizes (no duck-sizing guard)
        w, _ = compiled(*inputs(B, T, H))
        assert w.shape == (B, T, H, 128)
    assert len(graphs) == 1, f"{len(graphs)} graphs: recompiled for a new shape"
    assert "kdajit.forward" in str(graphs[0].graph)
    explanation = torch._dynamo.explain(model)(*inputs(1, 64, 1))
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)


def test_intra_recompute_and_out_variant_trace_as_ops(stand_in_kernels):
    def model(q, k, v, gk, beta, buffers):
        Aqk, Akk = kdajit.intra(q, k, gk, beta)
        w, u, kg, qg = kdajit.recompute_w_u(k, v, beta, Akk, gk)
        kdajit.forward(q, k, v, gk, beta, out=buffers)
        return Aqk, w, qg is None

    compiled, graphs = compile_counting(model)
    x = inputs(1, 70, 2)
    buffers = kdajit.ForwardOutput(*(torch.zeros_like(t) for t in (x[0][..., :64], x[0][..., :64], x[0], x[2], x[0])),
                                   None)
    _, w, qg_is_none = compiled(*x, buffers)
    assert qg_is_none and w.shape == x[0].shape
    assert len(graphs) == 1
    assert all((t == 1).all() for t in buffers[:5]), "forward_out did not write the given buffers"
    text = str(graphs[0].graph)
    assert all(name in text for name in ("kdajit.intra", "kdajit.recompute_w_u", "kdajit.forward_out"))


def test_autograd_is_refused_with_a_pointer_to_fla():
    with pytest.raises(RuntimeError, match="no autograd.*q, k, v, gk, beta.*no_grad.*integrations.fla"):
        kdajit.forward(*inputs(1, 64, 1, requires_grad=True))
    with torch.no_grad(), pytest.raises(ValueError, match="CUDA"):  # past the refusal, on to validation
        kdajit.forward(*inputs(1, 64, 1, requires_grad=True))
