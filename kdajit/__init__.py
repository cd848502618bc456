"""kdajit: JIT-compiled, disk-cached CuTe DSL kernels for the forward intra stage of Kimi Delta Attention.

Public API: `forward`, `intra`, `recompute_w_u`, `chunk_kda_fwd_intra` (FLA's signature),
`ForwardOutput`, and the tuner's `tune` and `share_tuning_records` (docs/tuning.md).
`kdajit.reference` holds the PyTorch reference. Importing kdajit does not import
CuTe DSL; the first call of a specialization does.
"""
from kdajit.api import chunk_kda_fwd_intra, forward, intra, recompute_w_u, tune
from kdajit.outputs import ForwardOutput
from kdajit.tuner import share_records as share_tuning_records

__version__ = "0.1.0"


def _enable_fla_backend_from_env() -> None:
    from kdajit import env

    if env.fla_backend():
        import warnings

        from kdajit.integrations import fla
        try:
            fla.enable()
        except ImportError as error:
            warnings.warn(f"KDAJIT_FLA_BACKEND=1 but the FLA backend cannot be enabled: {error}", stacklevel=2)


_enable_fla_backend_from_env()
__all__ = ["ForwardOutput", "chunk_kda_fwd_intra", "forward", "intra", "recompute_w_u", "share_tuning_records", "tune",
           "__version__"]
