"""kdajit: JIT-compiled, disk-cached CuTe DSL kernels for the forward intra stage of Kimi Delta Attention.

Public API: `forward`, `intra`, `recompute_w_u`, `chunk_kda_fwd_intra` (FLA's signature) and
`ForwardOutput`. `kdajit.reference` holds the PyTorch reference. Importing kdajit does not import
CuTe DSL; the first call of a specialization does.
"""
from kdajit.api import chunk_kda_fwd_intra, forward, intra, recompute_w_u
from kdajit.outputs import ForwardOutput

__version__ = "0.1.0"
__all__ = ["ForwardOutput", "chunk_kda_fwd_intra", "forward", "intra", "recompute_w_u", "__version__"]
