"""Public API: validate, pick the specialization, fetch compiled kernels, allocate outputs, launch.

The first call of a specialization compiles (or loads from the disk cache); a later call of the same validated
shapes finds its kernels in one memo lookup (`_kernels`; else one lookup in the cache's kernel table per kernel)
and launches through TVM-FFI on the caller's current CUDA stream.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from kdajit import cache, compiler, env, ops, tune_records, tuner, validate
from kdajit.keys import KEY_TYPES, AkkInverseKey, ForwardSpec, FusedConfig, FusedForwardKey, IntraKey, RecomputeWUKey
from kdajit.outputs import ForwardOutput


class _Kernels(NamedTuple):
    intra: Callable | None
    inverse: Callable | None
    recompute: Callable | None
    fused: Callable | None
    fused_max_ctas: int  # the fused kernel's grid bound (persistent configs), SMs x CTAs per SM


@functools.lru_cache(maxsize=None)
def _spec(beta_dtype: str, varlen: str, head_k: int, head_v: int, chunk: int, output_qg: bool,
          device_index: int, io_dtype: str = "bf16", safe_gate: bool = True) -> ForwardSpec:
    """The specialization of a call (memoized: building it costs more than the lookups)."""
    return ForwardSpec(beta_dtype, varlen, head_k, head_v, chunk, output_qg, compiler.current_arch(device_index),
                       io_dtype, safe_gate)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


# `_kernels`' answers by call, valid while the tuner's and the cache's generations are `_kernels_memo_stamp`: a repeated
# call then costs one lookup instead of its spec, its tuned configuration, its key and the kernel table's lookups (host
# cost, docs/performance.md). A changed choice or a cleared kernel table empties it. Bounded like kdajit.validate's
# signatures.
_KERNELS_MEMO: dict[tuple, tuple[_Kernels, int]] = {}  # -> (the kernels, how many of them the call runs)
_kernels_memo_stamp: tuple[int, int] = (-1, -1)
_MAX_KERNELS_MEMO = 1024


def _kernels(problem, chunk: int, output_qg: bool, device_index: int, *, intra: bool, recompute: bool,
             fused_config: FusedConfig | None = None, seqs: int = 0,
             shape: Callable[[], tuner.TuneShape] | None = None, safe_gate: bool = True) -> _Kernels:
    """The kernels a call runs, fetched together (one table lookup each): the fused kernel when both
    stages run on an arch that has one and KDAJIT_FORWARD_ROUTE allows it, else intra + inverse
    and/or recompute. The fused kernel runs in `fused_config`, else in the configuration the tuner
    picks for the workload (`seqs` sequences; `shape` describes the call if it has to be tuned). `safe_gate`:
    the intra products' gate path (kdajit.keys.ForwardSpec). Memoized per call (`_KERNELS_MEMO`)."""
    global _kernels_memo_stamp
    spec = _spec(problem.beta_dtype, problem.varlen, problem.head_k, problem.head_v, chunk, output_qg, device_index,
                 problem.io_dtype, safe_gate)
    route = env.forward_route() if intra and recompute and spec.uses_fused else None  # only where it picks the route
    stamp = (tuner.generation(), cache.generation())
    if stamp != _kernels_memo_stamp:
        _KERNELS_MEMO.clear()
        _kernels_memo_stamp = stamp
    memo = (problem, chunk, output_qg, device_index, intra, recompute, fused_config, seqs, safe_gate, route)
    known = _KERNELS_MEMO.get(memo)
    if known is not None:
        cache.count_memory_hits(known[1])
        return known[0]
    kernels = _look_up_kernels(spec, problem, device_index, intra, recompute, fused_config, seqs, shape, safe_gate,
                               route)
    # Kept only if nothing changed meanwhile (a demotion, another thread's clear), and not for a choice made under
    # CUDA-graph capture, which the tuner does not keep either (it tunes on a later call).
    unchanged = (tuner.generation(), cache.generation()) == stamp
    if unchanged and (fused_config is not None or kernels.fused is None or tuner.may_tune()):
        if len(_KERNELS_MEMO) >= _MAX_KERNELS_MEMO:
            _KERNELS_MEMO.clear()
        _KERNELS_MEMO[memo] = (kernels, sum(fn is not None for fn in kernels[:4]))
    return kernels


def _look_up_kernels(spec: ForwardSpec, problem, device_index: int, intra: bool, recompute: bool,
                     fused_config: FusedConfig | None, seqs: int, shape: Callable[[], tuner.TuneShape] | None,
                     safe_gate: bool, route: str | None) -> _Kernels:
    """`_kernels` without its memo, for the call's `spec`, under KDAJIT_FORWARD_ROUTE `route` (None where it does not
    pick the route: a call of one stage, or an arch without the fused kernel)."""
    fused_route = intra and recompute and spec.uses_fused and route == "auto"
    if fused_config is None and spec.untuned_fused_config is None:
        fused_route = False  # the standalone kernels are faster here; a given fused_config still runs the fused kernel
    if fused_config is not None and not fused_route:
        raise ValueError(f"fused_config={fused_config} was given, but this call runs the standalone kernels "
                         f"(arch {spec.arch}, KDAJIT_FORWARD_ROUTE={env.forward_route()}); expected a call of the "
                         f"fused route")
    if fused_route:
        tuned = fused_config is None
        if tuned:
            tokens = problem.batch * problem.tokens
            fused_config = tuner.config_for(spec, device_index, tokens, problem.heads, seqs,
                                            _FUSED_LAUNCHERS[safe_gate], shape)
        key = spec.fused_key(fused_config)
        try:
            fused, = cache.get_kernels((key,))
        except cache.KernelNotCached:  # KDAJIT_DISABLE_JIT and a record whose winner was never shipped
            if not tuned or fused_config == tuner.REFERENCE:
                raise
            tuner.demote(spec, device_index, tokens, problem.heads, seqs, f"{cache.describe(key)} is not cached")
            key = spec.fused_key()
            fused, = cache.get_kernels((key,))
        max_ctas = _sm_count(device_index) * key.config.ctas_per_sm if key.config.persistent else 1
        return _Kernels(None, None, None, fused, max_ctas)
    wanted = (spec.intra_key(), spec.inverse_key()) * intra + (spec.recompute_key(),) * recompute
    fns = cache.get_kernels(wanted)
    fns = (None, None) * (not intra) + tuple(fns) + (None,) * (not recompute)
    return _Kernels(*fns, None, 0)


@functools.lru_cache(maxsize=None)
def _dummy(device: torch.device, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Placeholders for arguments a specialization never reads (cu_seqlens when dense, q/qg without QG)."""
    return torch.zeros(shape, dtype=dtype, device=device)


def _cu_seqlens_arg(cu_seqlens: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The kernels' cu_seqlens argument: the caller's tensor as it is (each tile finds its sequence
    by binary search over it and clamps what it reads, templates/common.py), or a dummy when dense."""
    return _dummy(device, torch.int32, (1,)) if cu_seqlens is None else cu_seqlens


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _given_outputs(out: ForwardOutput | None, names: tuple[str, ...]) -> dict:
    """The caller's `out` fields that this call writes (kdajit.validate checks them), or {} without `out`."""
    if out is None:
        return {}
    if not isinstance(out, ForwardOutput):
        raise TypeError(f"out must be a kdajit.ForwardOutput, got {type(out).__name__}")
    return {name: getattr(out, name) for name in names}


def _output(out: ForwardOutput | None, name: str, shape, like: torch.Tensor) -> torch.Tensor:
    """The caller's (validated) `out` field, or a fresh output tensor in `like`'s dtype."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return getattr(out, name)


def _intra_outputs(out: ForwardOutput | None, problem, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (problem.batch, problem.tokens, problem.heads, problem.chunk)
    return _output(out, "Aqk", shape, like), _output(out, "Akk", shape, like)


def _recompute_outputs(out: ForwardOutput | None, gk: torch.Tensor, v: torch.Tensor, like: torch.Tensor,
                       output_qg: bool):
    """w, u, kg, qg (None unless `output_qg`): W, KG and QG have gk's shape [B, T, HV, K], U has v's."""
    qg = _output(out, "qg", gk.shape, like) if output_qg else None
    return _output(out, "w", gk.shape, like), _output(out, "u", v.shape, like), _output(out, "kg", gk.shape, like), qg


# Each kernel's argument names in launch order (kdajit.keys: the same definition its template compiles with).
_ARG_NAMES = {key_type: tuple(arg.name for arg in key_type.ARGS) for key_type in KEY_TYPES.values()}


def _launch(kernel: Callable, key_type: type, **args) -> None:
    """Call a compiled kernel with its arguments by name, in the order its key declares (no positional swaps)."""
    kernel(*[args[name] for name in _ARG_NAMES[key_type]])


def _run_intra(q, k, gk, beta, scale, cu, kernels, Aqk, Akk) -> None:
    if Aqk.numel():
        L = torch.empty(Aqk.shape, dtype=torch.float32, device=q.device)
        _launch(kernels.intra, IntraKey, q=q, k=k, gk=gk, beta=beta, Aqk=Aqk, L=L, cu_seqlens=cu, scale=scale)
        _launch(kernels.inverse, AkkInverseKey, L=L, Akk=Akk, cu_seqlens=cu)


def _run_recompute(k, v, beta, Akk, gk, q, cu, kernels, w, u, kg, qg) -> None:
    if k.numel():
        q_arg = q if q is not None else _dummy(k.device, k.dtype, (1, 1, 1, k.shape[-1]))
        qg_arg = qg if qg is not None else q_arg
        _launch(kernels.recompute, RecomputeWUKey, k=k, v=v, beta=beta, Akk=Akk, gk=gk, q=q_arg, w=w, u=u, kg=kg,
                qg=qg_arg, cu_seqlens=cu)


def _run_fused(q, k, v, gk, beta, scale, cu, kernels, Aqk, Akk, w, u, kg, qg) -> None:
    if k.numel():
        qg_arg = qg if qg is not None else _dummy(k.device, k.dtype, (1, 1, 1, k.shape[-1]))
        _launch(kernels.fused, FusedForwardKey, q=q, k=k, v=v, gk=gk, beta=beta, Aqk=Aqk, Akk=Akk, w=w, u=u, kg=kg,
                qg=qg_arg, cu_seqlens=cu, scale=scale, max_ctas=kernels.fused_max_ctas)


def _refuse_autograd(entry: str, **tensors: torch.Tensor | None) -> None:
    """kdajit has no autograd of its own: refuse a call that autograd would record."""
    if not torch.is_grad_enabled():
        return
    needing = [n for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if needing:
        raise RuntimeError(f"kdajit.{entry} has no autograd, but {', '.join(needing)} require(s) grad with grad mode "
                           f"on. Call it under torch.no_grad() or torch.inference_mode(), or train through FLA's "
                           f"chunk_kda with kdajit as its backend (kdajit.integrations.fla.enable()).")


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, beta: torch.Tensor,
            scale: float | None = None, *, cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
            output_qg: bool = False, safe_gate: bool = True, out: ForwardOutput | None = None) -> ForwardOutput:
    """The whole KDA forward intra stage: Aqk, Akk = (I+L)^-1, W, U, KG (and QG if `output_qg`).

    q, k: bf16 or fp16 [B, T, H, K], K in {64, 128, 256}; v: [B, T, HV, V], V in {64, 128, 256}, in q's dtype;
    gk: fp32 chunk-local cumulative log2 gate [B, T, HV, K] (non-increasing within a chunk); beta: bf16, fp16 or
    fp32 [B, T, HV]. `safe_gate=True` (the default) promises KDA's lower-bound gate (every per-token log-gate
    >= -5) and runs the fast path; `safe_gate=False` runs the any-gate path, finite and accurate for every
    gate (docs/numerics.md), with its own bits. HV = H, or
    a multiple of H for grouped value heads (value head h uses q, k head h // (HV / H), as FLA). The
    outputs have q's dtype and HV heads (Aqk, Akk with `chunk_size` columns: 32 or 64); scale defaults to
    K ** -0.5; cu_seqlens: int32 or int64 [N+1] with B == 1 for packed sequences. On sm_90a one fused kernel
    computes everything (but at K = 256 with QG, where the standalone kernels are faster:
    `ForwardSpec.untuned_fused_config`); elsewhere (or with KDAJIT_FORWARD_ROUTE=standalone) intra, inverse and
    recompute run in turn. Both
    routes are bitwise equal to `recompute_w_u(k, v, beta, intra(...)[1], gk, q=...)`. `out`:
    preallocated outputs to write into (e.g. static buffers for CUDA graphs); `out.qg` is needed only
    with `output_qg`. Under torch.compile it traces as the custom
    ops `kdajit::forward` / `kdajit::forward_out` (kdajit.ops).
    """
    _refuse_autograd("forward", q=q, k=k, v=v, gk=gk, beta=beta)
    if torch.compiler.is_compiling():
        validate.check_safe_gate(safe_gate)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if out is None:
            Aqk, Akk, w, u, kg, qg = ops.forward(q, k, v, gk, beta, scale, cu_seqlens, chunk_size, output_qg,
                                                 safe_gate)
            return ForwardOutput(Aqk, Akk, w, u, kg, qg if output_qg else None)
        ops.forward_out(q, k, v, gk, beta, scale, cu_seqlens, chunk_size, out.Aqk, out.Akk, out.w, out.u, out.kg,
                        out.qg if output_qg else None, safe_gate)
        return ForwardOutput(*out[:5], out.qg if output_qg else None)
    return _forward(q, k, v, gk, beta, scale, cu_seqlens, chunk_size, output_qg, safe_gate, out)


def _forward(q, k, v, gk, beta, scale, cu_seqlens, chunk_size, output_qg, safe_gate, out,
             fused_config: FusedConfig | None = None) -> ForwardOutput:
    """`forward` outside torch.compile; `fused_config` picks the fused kernel's configuration (every
    configuration gives the same bits; the tests and the tuner run them all)."""
    validate.check_safe_gate(safe_gate)
    validate.check_scale(scale)
    written = ("Aqk", "Akk", "w", "u", "kg") + ("qg",) * bool(output_qg)
    problem = validate.check_forward_inputs(q, k, v, gk, beta, cu_seqlens, chunk_size, _given_outputs(out, written))
    scale = problem.head_k ** -0.5 if scale is None else float(scale)
    seqs = problem.batch if cu_seqlens is None else cu_seqlens.numel() - 1
    kernels = _kernels(problem, chunk_size, bool(output_qg), _device_index(q), intra=True, recompute=True,
                       fused_config=fused_config, seqs=seqs, shape=lambda: _tune_shape(problem, cu_seqlens),
                       safe_gate=safe_gate)
    cu = _cu_seqlens_arg(cu_seqlens, q.device)
    q_for_qg = q if output_qg else None
    Aqk, Akk = _intra_outputs(out, problem, q)
    w, u, kg, qg = _recompute_outputs(out, gk, v, q, bool(output_qg))
    if kernels.fused is not None:
        _run_fused(q, k, v, gk, beta, scale, cu, kernels, Aqk, Akk, w, u, kg, qg)
    else:
        _run_intra(q, k, gk, beta, scale, cu, kernels, Aqk, Akk)
        _run_recompute(k, v, beta, Akk, gk, q_for_qg, cu, kernels, w, u, kg, qg)
    return ForwardOutput(Aqk, Akk, w, u, kg, qg)


def _tune_shape(problem, cu_seqlens: torch.Tensor | None) -> tuner.TuneShape:
    """The shape of a call that tunes its workload bucket (reads cu_seqlens: a host synchronisation)."""
    lengths = None if cu_seqlens is None else tuple(int(n) for n in cu_seqlens.diff().clamp(min=0).tolist())
    return tuner.TuneShape(problem.batch, problem.tokens, problem.heads, lengths)


def _fused_launcher(config: FusedConfig, x: dict, out: ForwardOutput, safe_gate: bool = True) -> Callable[[], None]:
    """One launch of the fused kernel in `config` on the inputs `x` into `out`, validated and looked up
    once (the tuner guards and times these; QG is written when `out.qg` is given)."""
    output_qg = out.qg is not None
    chunk = out.Aqk.shape[-1]
    q, k, v, gk, beta, cu_seqlens = (x.get(n) for n in ("q", "k", "v", "gk", "beta", "cu_seqlens"))
    written = ("Aqk", "Akk", "w", "u", "kg") + ("qg",) * output_qg
    problem = validate.check_forward_inputs(q, k, v, gk, beta, cu_seqlens, chunk, _given_outputs(out, written))
    kernels = _kernels(problem, chunk, output_qg, _device_index(q), intra=True, recompute=True, fused_config=config,
                       safe_gate=safe_gate)
    cu = _cu_seqlens_arg(cu_seqlens, q.device)
    return functools.partial(_run_fused, q, k, v, gk, beta, problem.head_k ** -0.5, cu, kernels, *out[:5],
                             out.qg)


# The tuner's launchers by gate path (what it guards and times is the kernel of the spec being tuned).
_FUSED_LAUNCHERS = {gate: functools.partial(_fused_launcher, safe_gate=gate) for gate in (True, False)}


def tune(batch: int, tokens: int, heads: int, *, beta_dtype: str = "bf16", varlen: str = "dense",
         lengths: tuple[int, ...] | None = None, head_k: int = 128, head_v: int = 128, chunk_size: int = 64,
         output_qg: bool = False, io_dtype: str = "bf16", safe_gate: bool = True, force: bool = False,
         device: int | None = None, progress: tuner.Progress | None = None) -> tune_records.TuningRecord:
    """Tune the fused kernel for one specialization and workload on this GPU, and store the record.

    The workload is dense [batch, tokens] with `heads` heads or, for varlen "cu32"/"cu64", the
    sequences `lengths` packed together (batch must be 1; `tokens` is then their sum and ignored).
    Every candidate configuration is first proven bitwise equal to the reference configuration on
    the tuning inputs and edge-case probes; only those are timed; the winner (ties within 1% go to
    the earlier configuration) is stored for the workload's bucket, where `forward` finds it
    (KDAJIT_AUTOTUNE=cached, the default). Already timed candidates are kept unless `force`.
    `io_dtype` is the dtype of q, k, v ("bf16" or "fp16"); `safe_gate` the gate path (`forward`'s). Returns the
    record (`kdajit cache ls` lists it).
    """
    validate.check_safe_gate(safe_gate)
    if varlen != "dense" and (lengths is None or batch != 1):
        raise ValueError(f"varlen={varlen!r} tunes packed sequences: pass lengths=(...) and batch=1 "
                         f"(got lengths={lengths!r}, batch={batch})")
    if varlen == "dense" and lengths is not None:
        raise ValueError(f"lengths={lengths!r} needs varlen='cu32' or 'cu64' (got varlen='dense')")
    sizes = (("batch", batch), ("heads", heads)) + ((("tokens", tokens),) if lengths is None else ())
    for name, value in sizes:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if lengths is not None and (not all(type(n) is int and n >= 0 for n in lengths) or sum(lengths) < 1):
        raise ValueError(f"lengths={lengths!r} must be ints >= 0 with a positive sum")
    if not torch.cuda.is_available():
        raise RuntimeError("kdajit.tune needs a CUDA GPU: it times the kernels on the GPU the records are for "
                           "(`kdajit precompile` works without one)")
    if device is not None and (type(device) is not int or not 0 <= device < torch.cuda.device_count()):
        raise ValueError(f"device={device!r} must be a CUDA device index in [0, {torch.cuda.device_count()})")
    device_index = torch.cuda.current_device() if device is None else device
    spec = _spec(beta_dtype, varlen, head_k, head_v, chunk_size, bool(output_qg), device_index, io_dtype, safe_gate)
    if not spec.uses_fused or env.forward_route() != "auto":
        raise ValueError(f"nothing to tune on arch {spec.arch} with KDAJIT_FORWARD_ROUTE={env.forward_route()}: "
                         f"the standalone kernels have one configuration each; expected an sm_90a GPU and the "
                         f"fused route")
    if spec.untuned_fused_config is None:
        raise ValueError(f"nothing to tune at head_k={head_k} with output_qg={bool(output_qg)}: forward runs the "
                         f"standalone kernels there (one configuration each); expected a specialization of "
                         f"kdajit.untuned_configs that runs the fused kernel")
    shape = tuner.TuneShape(batch, sum(lengths) if lengths else tokens, heads, tuple(lengths) if lengths else None)
    key = tuner.tuning_key(spec, device_index, shape.total_tokens, heads, shape.seqs)
    with torch.cuda.device(device_index):
        return tuner.tune(key, shape, _FUSED_LAUNCHERS[safe_gate], force=force, device_index=device_index,
                          progress=progress)


def intra(q: torch.Tensor, k: torch.Tensor, gk: torch.Tensor, beta: torch.Tensor, scale: float | None = None, *,
          cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
          safe_gate: bool = True, out: ForwardOutput | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Aqk ([B, T, HV, chunk]) and Akk = (I + L)^-1 ([B, T, HV, chunk]), in q's dtype; see `forward`.

    `out`: optional preallocated outputs (only its Aqk and Akk are used).
    """
    _refuse_autograd("intra", q=q, k=k, gk=gk, beta=beta)
    validate.check_safe_gate(safe_gate)
    if torch.compiler.is_compiling() and out is None:
        Aqk, Akk = ops.intra(q, k, gk, beta, q.shape[-1] ** -0.5 if scale is None else scale, cu_seqlens, chunk_size,
                             safe_gate)
        return Aqk, Akk
    validate.check_scale(scale)
    problem = validate.check_forward_inputs(q, k, None, gk, beta, cu_seqlens, chunk_size,
                                            _given_outputs(out, ("Aqk", "Akk")))
    scale = problem.head_k ** -0.5 if scale is None else float(scale)
    kernels = _kernels(problem, chunk_size, False, _device_index(q), intra=True, recompute=False, safe_gate=safe_gate)
    cu = _cu_seqlens_arg(cu_seqlens, q.device)
    Aqk, Akk = _intra_outputs(out, problem, q)
    _run_intra(q, k, gk, beta, scale, cu, kernels, Aqk, Akk)
    return Aqk, Akk


def recompute_w_u(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, Akk: torch.Tensor, gk: torch.Tensor, *,
                  cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
                  q: torch.Tensor | None = None, out: ForwardOutput | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """W, U, KG (and QG when `q` is given) from a saved Akk: (w, u, kg, qg); see `forward`.

    `out`: optional preallocated outputs (its w, u, kg and, with `q`, qg are used).
    """
    _refuse_autograd("recompute_w_u", k=k, v=v, beta=beta, Akk=Akk, gk=gk, q=q)
    if torch.compiler.is_compiling() and out is None:
        w, u, kg, qg = ops.recompute_w_u(k, v, beta, Akk, gk, cu_seqlens, chunk_size, q)
        return w, u, kg, qg if q is not None else None
    written = ("w", "u", "kg") + ("qg",) * (q is not None)
    problem = validate.check_recompute_inputs(k, v, beta, Akk, gk, q, cu_seqlens, chunk_size,
                                              _given_outputs(out, written))
    kernels = _kernels(problem, chunk_size, q is not None, _device_index(k), intra=False, recompute=True)
    cu = _cu_seqlens_arg(cu_seqlens, k.device)
    w, u, kg, qg = _recompute_outputs(out, gk, v, k, q is not None)
    _run_recompute(k, v, beta, Akk, gk, q, cu, kernels, w, u, kg, qg)
    return w, u, kg, qg


def chunk_kda_fwd_intra(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gk: torch.Tensor, beta: torch.Tensor,
                        scale: float | None, cu_seqlens: torch.Tensor | None = None, chunk_size: int = 64,
                        chunk_indices: torch.Tensor | None = None, safe_gate: bool = False,
                        disable_recompute: bool = False):
    """FLA's `chunk_kda_fwd_intra` signature and defaults: returns (w, u, qg, kg, Aqk, Akk).

    `safe_gate=True` promises the lower-bound gate (the fast path); False (FLA's default) runs the any-gate
    path. `disable_recompute=True` also returns QG (else qg is None).
    `chunk_indices` is accepted for compatibility and not needed: each kdajit tile finds its sequence
    in cu_seqlens itself.
    """
    out = forward(q, k, v, gk, beta, scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                  output_qg=disable_recompute, safe_gate=safe_gate)
    return out.w, out.u, out.qg, out.kg, out.Aqk, out.Akk
