"""The torch-side vocabulary shared by the API and the reference: the output tuple and the dtype maps.

A leaf module (it imports only torch), so `kdajit.reference` builds outputs without importing the
API, and every torch-side user of the beta dtype names (validation, the demo, the tests) reads them
from one map.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class ForwardOutput(NamedTuple):
    """Outputs of `forward` (in q's dtype, bf16 or fp16) and of `kdajit.reference` (fp64/fp32); `qg` is None
    unless requested."""

    Aqk: torch.Tensor
    Akk: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    kg: torch.Tensor
    qg: torch.Tensor | None


# The torch dtype of each beta dtype name of kdajit.keys.BETA_DTYPES (the names keys and the CLI use).
BETA_TORCH_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The torch dtype of each io dtype name of kdajit.keys.IO_DTYPES: q, k, v and every output.
IO_TORCH_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The cu_seqlens dtype of each varlen mode of kdajit.keys.VARLEN_MODES but "dense".
CU_SEQLENS_TORCH_DTYPES: dict[str, torch.dtype] = {"cu32": torch.int32, "cu64": torch.int64}
