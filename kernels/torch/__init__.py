"""Device-agnostic torch programs: the CPU path and the reference speed.

Forward: :func:`prep` (#1), :func:`summary_walk`, :func:`tape_walk` (#2),
:func:`output` (#5); in a forward that keeps no tape at K <= 128
(``gdn_kcp.options.walks_with_output``), :func:`scores` and :func:`walk_output`
(the tape walk and the output in one walk) instead of the last two; with a
gate per key channel (KDA), :func:`channel_decays` before the walks (their
decays once a chunk, in both directions).
Backward: :func:`w_u` (prep's second half, from the A that
``save_mode="inverse"`` saves), :func:`bwd_local_dv`, :func:`adjoint_summary`,
:func:`adjoint_walk`, :func:`bwd_dqkwg`, :func:`bwd_wy`,
:func:`bwd_gate_cumsum`, :func:`bwd_qk_norm`. Segments (P > 1):
:func:`segment_summary`, :func:`compose_segments` (forward phases 1 and 2),
:func:`adjoint_segment_summary`, :func:`compose_adjoints` (backward).
Batched over chunks, heads and fragments; only the walks loop, over the chunk
position inside a fragment.
"""

import torch

from .bwd_dqkwg import bwd_dqkwg
from .channel_decays import channel_decays
from .compose_adjoints import compose_adjoints
from .compose_segments import compose_segments
from .bwd_gate_cumsum import bwd_gate_cumsum
from .bwd_local_dv import bwd_local_dv
from .bwd_qk_norm import bwd_qk_norm
from .bwd_wy import bwd_wy
from .adjoint_segment_summary import adjoint_segment_summary
from .adjoint_summary import adjoint_summary
from .adjoint_walk import adjoint_walk
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


def _settle_vector_math() -> None:
    """One small serial ``exp`` per float dtype, once, before any program runs.
    CPU ``exp`` goes to MKL's vector math, and the first multi-threaded call
    of a process (prep's scores of a few chunks, split over the threads) could
    return other bits than every later call on the same input: one thread's
    half off by up to 3.3e-9 (relative, fp64), in about 8 % of fresh
    processes, which made a first step differ from every later one. After a
    serial call first, 0 of 40 processes differed (and 0 of 40 with one
    thread), so the programs are bitwise reproducible from the first call."""
    for dtype in (torch.float64, torch.float32):
        torch.exp(torch.zeros(8, dtype=dtype))


_settle_vector_math()

