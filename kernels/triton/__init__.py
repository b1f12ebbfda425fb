"""Triton programs: the CUDA path, testable on CPU with ``TRITON_INTERPRET=1``.

One file per program (kernels + one thin launcher), the same signatures as
``kernels.torch``. Packed varlen through the chunk index (no host sync), K up to
256 and V up to 512 in key slices and value tiles, bf16/fp16/fp32 inputs with
fp32 accumulation, fp32 (or fp64) states and M. Decode: :func:`recurrent`,
:func:`conv_step` and :func:`decode_step` (the two fused).

Segments (P > 1, :mod:`gdn_kcp.kernels.segments`): :func:`segment_summary`,
:func:`compose_segments` (forward phases 1 and 2), :func:`adjoint_segment_summary`,
:func:`compose_adjoints` (backward); phase 3 is :func:`walk_output` (or
:func:`tape_walk`) / :func:`adjoint_walk` on the segmented index with ``carry_in``.
Forward: :func:`prep`, then :func:`scores` and :func:`walk_output` when the
forward keeps no tape at K <= 128, else :func:`tape_walk` and :func:`output`; with a gate per key
channel (KDA) :func:`channel_decays` first forms the walks' decays once a chunk. The compositions
multiply exactly in the compute dtype (fp32 FMA, no tensor cores): states and M
are never rounded.
"""

from .adjoint_segment_summary import adjoint_segment_summary
from .adjoint_summary import adjoint_summary
from .adjoint_walk import adjoint_walk
from .bwd_dqkwg import bwd_dqkwg
from .channel_decays import channel_decays
from .bwd_gate_cumsum import bwd_gate_cumsum
from .bwd_local_dv import bwd_local_dv
from .bwd_qk_norm import bwd_qk_norm
from .bwd_wy import bwd_wy
from .compose_adjoints import compose_adjoints
from .compose_segments import compose_segments
from .output import output
from .prep import prep, w_u
from .recurrent import decode_step, recurrent
from .scores import scores
from .segment_summary import segment_summary
from .short_conv import conv_step, short_conv_bwd, short_conv_fwd
from .summary_walk import summary_walk
from .tape_walk import tape_walk
from .walk_output import walk_output

__all__ = [
    "adjoint_segment_summary",
    "adjoint_summary",
    "adjoint_walk",
    "bwd_dqkwg",
    "bwd_gate_cumsum",
    "bwd_local_dv",
    "bwd_qk_norm",
    "bwd_wy",
    "channel_decays",
    "compose_adjoints",
    "compose_segments",
    "conv_step",
    "decode_step",
    "output",
    "prep",
    "recurrent",
    "scores",
    "segment_summary",
    "short_conv_bwd",
    "short_conv_fwd",
    "summary_walk",
    "tape_walk",
    "w_u",
    "walk_output",
]
