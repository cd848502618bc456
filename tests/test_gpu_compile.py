"""GPU: kdajit under torch.compile (one graph, real kernels) and inside captured CUDA graphs, bit for bit."""
import pytest
import torch

import kdajit
from kdajit import reference
from test_gpu_forward import INPUTS, assert_bitwise, poisoned_out, seed  # noqa: F401  (seed is a fixture)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def model(q, k, v, gk, beta, cu_seqlens):
    return kdajit.forward(q, k, v, gk, beta, cu_seqlens=cu_seqlens, output_qg=True)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_compiled_forward_is_one_graph_and_bitwise_eager(seed, varlen):
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for T in (300, 1000):
        cu = torch.tensor([0, T // 3, T], dtype=torch.int32, device="cuda") if varlen else None
        x = reference.make_inputs(1 if varlen else 2, T, 3, cu_seqlens=cu.cpu() if varlen else None, device="cuda")
        args = [x[n] for n in INPUTS] + [cu]
        assert_bitwise(kdajit.ForwardOutput(*compiled(*args)), model(*args), f"compiled vs eager, T={T}")
    explanation = torch._dynamo.explain(model)(*args)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)


def test_captured_cuda_graph_replays_bitwise(seed):
    x = reference.make_inputs(2, 500, 4, device="cuda")
    args = [x[n] for n in INPUTS]
    static = poisoned_out(2, 500, 4)
    kdajit.forward(*args, output_qg=True, out=static)  # compile/load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kdajit.forward(*args, output_qg=True, out=static)
    for fresh in (x, reference.make_inputs(2, 500, 4, device="cuda")):
        for n, t in zip(INPUTS, args):
            t.copy_(fresh[n])
        expected = model(*args, None)
        for t in static:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(static, expected, "CUDA graph replay")
