"""The tuner's bitwise guard: a candidate configuration may be timed only if every output it writes is
byte for byte the reference configuration's, on the tuning inputs and on seeded probes that hit the
edges of the specialization (a partial last chunk, sequence boundaries, 1-token sequences, the
steepest gate the safe bound allows).

Outputs are filled with NaN before every run, so an element a candidate leaves unwritten is a
mismatch. Nothing here launches a kernel itself: candidates come as launchers (see `kdajit.tuner`),
so the logic runs with stand-in kernels on the CPU too.
"""
from __future__ import annotations

from typing import Callable

import torch

from kdajit import reference
from kdajit.keys import ForwardSpec
from kdajit.outputs import BETA_TORCH_DTYPES, CU_SEQLENS_TORCH_DTYPES, IO_TORCH_DTYPES, ForwardOutput
from kdajit.validate import SAFE_GATE_LOWER_BOUND as SAFE_GATE_BOUND

Inputs = dict[str, torch.Tensor]
# (probe name, B, T or None, H, varlen lengths or None, gate): T None with varlen lengths.
_DENSE_PROBES = (("partial-last-chunk", 2, 1000, 3, None, "random"), ("one-token", 1, 1, 2, None, "random"),
                 ("steepest-safe-gate", 1, 256, 2, None, "steepest"))
_VARLEN_PROBES = (("sequence-boundaries", 1, None, 3, (1, 63, 65, 64, 127, 1, 300), "random"),
                  ("one-token-sequences", 1, None, 2, (1, 1, 1), "random"),
                  ("steepest-safe-gate", 1, None, 2, (200, 56), "steepest"))


def make_problem(spec: ForwardSpec, batch: int, heads: int, *, tokens: int | None = None,
                 lengths: tuple[int, ...] | None = None, gate: str = "random", seed: int = 0,
                 device: str | torch.device = "cuda") -> Inputs:
    """Seeded inputs of `spec`'s kind: dense [batch, tokens] or, for a varlen spec, `lengths` packed
    with cu_seqlens of its dtype. `gate="steepest"` sets every per-token gate to the safe bound."""
    gen = torch.Generator().manual_seed(seed)
    beta_dtype = BETA_TORCH_DTYPES[spec.beta_dtype]
    cu = None
    if spec.varlen != "dense":
        if lengths is None:
            lengths = (tokens,) * batch
        cu = torch.tensor((0,) + tuple(lengths)).cumsum(0).to(CU_SEQLENS_TORCH_DTYPES[spec.varlen])
        batch, tokens = 1, sum(lengths)
    x = reference.make_inputs(batch, tokens, heads, spec.head_k, spec.head_v, beta_dtype=beta_dtype,
                              io_dtype=IO_TORCH_DTYPES[spec.io_dtype], cu_seqlens=cu, generator=gen,
                              chunk_size=spec.chunk)
    if gate == "steepest":
        x["g_raw"] = torch.full_like(x["g_raw"], SAFE_GATE_BOUND)
        x["gk"] = reference.chunk_local_cumsum(x["g_raw"], spec.chunk, cu_seqlens=cu, scale=reference.RCP_LN2)
    return {name: t.to(device) for name, t in x.items() if name != "g_raw"}


def probe_problems(spec: ForwardSpec, device: str | torch.device = "cuda") -> list[tuple[str, Inputs]]:
    """The edge-case probes for `spec` (seeded, so every process probes the same inputs)."""
    probes = _VARLEN_PROBES if spec.varlen != "dense" else _DENSE_PROBES
    return [(name, make_problem(spec, b, h, tokens=t, lengths=lens, gate=gate, seed=1000 + i, device=device))
            for i, (name, b, t, h, lens, gate) in enumerate(probes)]


def poisoned_outputs(x: Inputs, output_qg: bool, chunk: int) -> ForwardOutput:
    """Output buffers for the problem `x` (in q's dtype), filled with NaN."""
    q, v = x["q"], x["v"]
    B, T, H, _ = q.shape

    def nan(*shape: int) -> torch.Tensor:
        return torch.full(shape, float("nan"), dtype=q.dtype, device=q.device)

    return ForwardOutput(nan(B, T, H, chunk), nan(B, T, H, chunk), nan(*q.shape), nan(*v.shape), nan(*q.shape),
                         nan(*q.shape) if output_qg else None)


def first_difference(expected: ForwardOutput, got: ForwardOutput) -> str | None:
    """None when every output is bitwise equal, else the first differing output, its first
    differing index (row-major), both bit patterns and how many elements differ."""
    for name, a, b in zip(ForwardOutput._fields, expected, got, strict=True):
        if a is None:
            continue
        bits_a, bits_b = a.view(torch.int16), b.view(torch.int16)
        differs = bits_a != bits_b
        count = int(differs.sum())
        if count:
            flat = int(differs.flatten().nonzero()[0])
            index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape))
            return (f"{name}{list(index)}: reference 0x{int(bits_a.flatten()[flat]) & 0xFFFF:04x}, candidate "
                    f"0x{int(bits_b.flatten()[flat]) & 0xFFFF:04x} ({count} of {a.numel()} elements differ)")
    return None


Launch = Callable[[], None]
Prepare = Callable[[object, Inputs, ForwardOutput], Launch]  # (config, inputs, out) -> a launch


def reference_outputs(prepare: Prepare, config, problems: list[tuple[str, Inputs]], output_qg: bool,
                      chunk: int) -> list[ForwardOutput]:
    """The reference configuration's outputs on every problem."""
    outs = []
    for _, x in problems:
        out = poisoned_outputs(x, output_qg, chunk)
        prepare(config, x, out)()
        outs.append(out)
    return outs


def guard(prepare: Prepare, config, problems: list[tuple[str, Inputs]], expected: list[ForwardOutput],
          output_qg: bool, chunk: int) -> str | None:
    """None if `config` reproduces `expected` bit for bit on every problem; else "<problem>: <first
    difference>" of the first problem that differs."""
    for (name, x), want in zip(problems, expected, strict=True):
        out = poisoned_outputs(x, output_qg, chunk)
        prepare(config, x, out)()
        diff = first_difference(want, out)
        if diff is not None:
            return f"{name}: {diff}"
    return None
