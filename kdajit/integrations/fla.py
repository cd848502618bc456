"""kdajit as a backend of flash-linear-attention (FLA): one switch for FLA's `chunk_kda` users.

FLA 0.6 dispatches `chunk_kda_fwd_intra` (fla/ops/kda/chunk_intra.py, the forward) and
`recompute_w_u_fwd` (fla/ops/kda/wy_fast.py, used again by the backward) through its backend
registry for the operation "kda". `enable()` registers a kdajit backend there; for each call, a
verifier accepts exactly what kdajit covers and otherwise declines with a reason, and FLA falls back to
its own Triton kernels (the reason is logged once at DEBUG on the "kdajit.integrations.fla" logger,
and by FLA itself at INFO on its first rejection).

    import kdajit.integrations.fla as kdajit_fla
    kdajit_fla.enable()                 # or: with kdajit_fla.enabled(): ...
    # or set KDAJIT_FLA_BACKEND=1 before `import kdajit`

FLA is optional: without it, `enable()` raises ImportError naming the package, and nothing else in
kdajit changes. Supported FLA versions: `SUPPORTED_FLA_VERSIONS`; calls under any other version are
declined (the entry points' signatures are version-specific), as are keyword arguments this module
does not know.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Iterator

import torch

from kdajit import api, validate

SUPPORTED_FLA_VERSIONS = ("0.6.0",)
BACKEND_NAME = "kdajit"

logger = logging.getLogger(__name__)
_state = {"enabled": False, "registered": False}
_logged_reasons: set[str] = set()


@functools.lru_cache(maxsize=1)
def _fla_version() -> str | None:
    """The installed FLA's version, looked up once: each importlib.metadata lookup scans the installed
    distributions (~0.2 ms on the CPU machine; the verifiers run on every dispatched FLA call)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("fla-core", "flash-linear-attention"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def _common_reason(fla_version: str | None, unknown: dict) -> str | None:
    if fla_version not in SUPPORTED_FLA_VERSIONS:
        return f"FLA version {fla_version!r} is not one kdajit's backend supports ({list(SUPPORTED_FLA_VERSIONS)})"
    if unknown:
        return f"unknown keyword arguments {sorted(unknown)}"
    return None


def _validation_reason(check, *args) -> str | None:
    try:
        check(*args)
    except (TypeError, ValueError, NotImplementedError) as error:
        return str(error)
    return None


def intra_decline_reason(q, k, v, gk=None, beta=None, scale=None, cu_seqlens=None, chunk_size=64,
                         chunk_indices=None, safe_gate=False, lower_bound=None, disable_recompute=False,
                         use_graph=False, *, fla_version: str | None = None, **unknown) -> str | None:
    """Why kdajit cannot run FLA's `chunk_kda_fwd_intra` call with these arguments, or None if it can.

    `fla_version` defaults to the installed FLA's. `chunk_indices` and `use_graph` are accepted and not
    needed (kdajit's tiles find their sequences in cu_seqlens, CUDA-graph safe).
    """
    reason = _common_reason(fla_version or _fla_version(), unknown)
    if reason:
        return reason
    if not isinstance(safe_gate, bool):
        return f"safe_gate={safe_gate!r} must be a bool"
    if lower_bound is not None and not isinstance(lower_bound, (int, float)):
        return f"lower_bound={lower_bound!r} must be a number or None"
    if gk is None or beta is None:
        return "gk and beta are required"
    if not isinstance(disable_recompute, bool):
        return f"disable_recompute={disable_recompute!r} must be a bool"
    return (_validation_reason(validate.check_scale, scale)
            or _validation_reason(validate.check_forward_inputs, q, k, v, gk, beta, cu_seqlens, chunk_size))


def kdajit_safe_gate(safe_gate: bool, lower_bound: float | None) -> bool:
    """kdajit's gate path for FLA's arguments: the safe-gate fast path only where FLA's call promises kdajit's
    bound (safe_gate with no lower_bound, or one >= validate.SAFE_GATE_LOWER_BOUND); the any-gate path otherwise
    (FLA's default safe_gate=False, or a steeper lower_bound)."""
    return safe_gate and (lower_bound is None or lower_bound >= validate.SAFE_GATE_LOWER_BOUND)


def recompute_decline_reason(k, v, beta, A, gk, q=None, cu_seqlens=None, chunk_indices=None, use_graph=False,
                             *, fla_version: str | None = None, **unknown) -> str | None:
    """Why kdajit cannot run FLA's `recompute_w_u_fwd` call with these arguments, or None if it can."""
    reason = _common_reason(fla_version or _fla_version(), unknown)
    if reason:
        return reason
    chunk = A.shape[-1] if isinstance(A, torch.Tensor) and A.dim() == 4 else 64
    return _validation_reason(validate.check_recompute_inputs, k, v, beta, A, gk, q, cu_seqlens, chunk)


def _decision(reason: str | None, entry: str) -> tuple[bool, str | None]:
    if reason is not None and reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.debug("kdajit backend declined FLA %s: %s", entry, reason)
    return reason is None, reason


def _backend_class():
    from fla.backends import BaseBackend

    class KdajitBackend(BaseBackend):
        """FLA backend running the KDA forward intra stage and the W/U recompute with kdajit."""

        backend_type = BACKEND_NAME
        package_name = "kdajit"
        priority = 1

        def is_enabled(self) -> bool:
            return _state["enabled"]

        def chunk_kda_fwd_intra_verifier(self, *args, **kwargs):
            return _decision(intra_decline_reason(*args, **kwargs), "chunk_kda_fwd_intra")

        def chunk_kda_fwd_intra(self, q, k, v, gk=None, beta=None, scale=None, cu_seqlens=None, chunk_size=64,
                                chunk_indices=None, safe_gate=False, lower_bound=None, disable_recompute=False,
                                use_graph=False):
            return api.chunk_kda_fwd_intra(q, k, v, gk, beta, scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                           safe_gate=kdajit_safe_gate(safe_gate, lower_bound),
                                           disable_recompute=disable_recompute)

        def recompute_w_u_fwd_verifier(self, *args, **kwargs):
            return _decision(recompute_decline_reason(*args, **kwargs), "recompute_w_u_fwd")

        def recompute_w_u_fwd(self, k, v, beta, A, gk, q=None, cu_seqlens=None, chunk_indices=None,
                              use_graph=False):
            w, u, kg, qg = api.recompute_w_u(k, v, beta, A, gk, cu_seqlens=cu_seqlens, chunk_size=A.shape[-1], q=q)
            return w, u, qg, kg  # FLA's order

    return KdajitBackend


def _check_signatures() -> None:
    """The FLA entry points must have the parameters the verifiers above are written for."""
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra
    from fla.ops.kda.wy_fast import recompute_w_u_fwd

    for fla_fn, ours in ((chunk_kda_fwd_intra, intra_decline_reason), (recompute_w_u_fwd, recompute_decline_reason)):
        theirs = list(inspect.signature(inspect.unwrap(fla_fn)).parameters)
        known = [p for p in inspect.signature(ours).parameters if p not in ("fla_version", "unknown")]
        if theirs != known:
            raise RuntimeError(f"FLA's {fla_fn.__name__} has parameters {theirs}; kdajit's backend was written for "
                               f"{known} (FLA {_fla_version()}, supported {list(SUPPORTED_FLA_VERSIONS)})")


def enable() -> None:
    """Register kdajit as FLA's backend for the "kda" operation (idempotent) and switch it on."""
    try:
        from fla.backends import register
    except ImportError as error:
        raise ImportError("kdajit.integrations.fla.enable() needs flash-linear-attention (pip install "
                          f"flash-linear-attention=={SUPPORTED_FLA_VERSIONS[-1]}): {error}") from None
    if not _state["registered"]:
        _check_signatures()
        register("kda")(_backend_class())
        _state["registered"] = True
    _state["enabled"] = True


def disable() -> None:
    """Switch the backend off: FLA runs its own kernels again (the registration stays, inert)."""
    _state["enabled"] = False


def is_enabled() -> bool:
    """Whether FLA's "kda" dispatch currently offers its calls to kdajit."""
    return _state["enabled"]


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """Context manager: the backend is on inside the block and back to its previous state after."""
    before = _state["enabled"]
    enable()
    try:
        yield
    finally:
        _state["enabled"] = before
