"""Triton programs: the CUDA path, testable on CPU with ``TRITON_INTERPRET=1``.

One file per program (kernels + one thin launcher), the same signatures as
``kernels.torch``. Packed varlen through the chunk index (no host sync), K and V
up to 128 in one tile, bf16/fp16/fp32 inputs with fp32 accumulation, fp32 (or
fp64) states and M.
"""

from .adjoint_summary import adjoint_summary
from .adjoint_walk import adjoint_walk
from .bwd_dqkwg import bwd_dqkwg
from .bwd_gate_cumsum import bwd_gate_cumsum
from .bwd_local_dv import bwd_local_dv
from .bwd_qk_norm import bwd_qk_norm
from .bwd_wy import bwd_wy
from .output import output
from .prep import prep
from .short_conv import short_conv_bwd, short_conv_fwd
from .summary_walk import summary_walk
from .tape_walk import tape_walk

__all__ = [
    "adjoint_summary",
    "adjoint_walk",
    "bwd_dqkwg",
    "bwd_gate_cumsum",
    "bwd_local_dv",
    "bwd_qk_norm",
    "bwd_wy",
    "output",
    "prep",
    "short_conv_bwd",
    "short_conv_fwd",
    "summary_walk",
    "tape_walk",
]
