"""Backward walk of the state adjoint dS, chunk by chunk from each fragment's end.

    dh[c]   = dS                                   (adjoint of the chunk's end state)
    dVn     = dVn_local + diag(gamma_C / gamma) K dS
    dS_prev = gamma_C dS + scale (diag(gamma) Q)^T dO - W^T dVn

Fragments walk together, last chunk first (``index.max_frag_chunks`` steps).
"""

from __future__ import annotations

import torch

from ..chunk_index import CROSSING_IN, CROSSING_OUT, ChunkIndex
from ..precision import accumulator_dtype
from ._chunks import chunk_rows, from_chunks, put_rows, to_chunks
from ._walk import adjoint_step, q_decayed_do, walk_operands
from .tape_walk import carried, gather_states, write_end_states


def end_adjoints(
    index: ChunkIndex, like: torch.Tensor, d_final_state: torch.Tensor | None, lam_end: torch.Tensor | None,
    carry_in: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[F, HV, K, V]``: the fragment's final-state gradient (or zero), and
    ``lam_end[0]`` for the crossing-out fragment (always the last fragment)."""
    dS = gather_states(index, d_final_state, CROSSING_OUT, like.new_zeros((index.n_frag,) + like.shape[1:]))
    if lam_end is not None:
        crossing_out = ((index.frag_flags & CROSSING_OUT) != 0)[:, None, None, None]
        dS = torch.where(crossing_out, lam_end[:1].to(dS.dtype), dS)
    return carried(index, dS, carry_in)


def adjoint_walk(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    g: torch.Tensor,
    do: torch.Tensor,
    dv_local: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    scale: float,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    d_final_state: torch.Tensor | None,
    lam_end: torch.Tensor | None,
    dh_out: torch.Tensor,
    dv_out: torch.Tensor,
    d_initial_state_out: torch.Tensor | None,
    carry_in: torch.Tensor | None = None,
    k_decayed: torch.Tensor | None = None,
    q_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> None:
    """Walk the adjoints.

    q, k ``[T, H_qk, K]``; w ``[T, HV, K]``; g ``[T, HV]``; do, dv_local
    ``[T, HV, V]``; d_final_state ``[N_end, HV, K, V]`` (as the tape walk's final
    states) or None; lam_end ``[1, HV, K, V]``, the end adjoint of the crossing-out fragment,
    or None. Writes dh_out ``[NC, HV, K, V]``, dv_out ``[T, HV, V]`` (the whole
    dVn) and ``d_initial_state_out`` ``[N_start, HV, K, V]`` (rows as the initial
    states). With segments, carry_in ``[n_sum, HV, K, V]`` holds the end
    adjoints of the ``SEGMENT`` rows of ``index`` (see ``tape_walk``). KDA's
    decays may come formed (``k_decayed``, ``q_decayed`` from raw q,
    ``chunk_decay``: :func:`.channel_decays.channel_decays`).
    """
    cdt = accumulator_dtype(k.dtype)
    HV, K, V = w.shape[1], w.shape[2], do.shape[2]
    rows = chunk_rows(index)
    ops = walk_operands(k, k_rstd, w, g, rows, cdt, gate_params, k_decayed, chunk_decay)
    pull = q_decayed_do(q, q_rstd, do, g, rows, cdt, scale, gate_params, q_decayed)
    dvl = to_chunks(dv_local, rows, cdt)
    dv_new = torch.empty_like(dvl)
    dS = end_adjoints(index, dvl.new_empty((1, HV, K, V)), d_final_state, lam_end, carry_in)
    last_chunk = max(index.n_chunks - 1, 0)
    for j in reversed(range(index.max_frag_chunks)):
        active = index.frag_n_chunks > j
        c = (index.frag_first_chunk.long() + j).clamp(max=last_chunk)
        put_rows(dh_out, c, active, dS)
        dvn, dS_prev = adjoint_step(ops, dvl, pull, c, dS)
        put_rows(dv_new, c, active, dvn)
        dS = torch.where(active[:, None, None, None], dS_prev, dS)
    from_chunks(dv_new, rows, dv_out)
    write_end_states(index, dS, d_initial_state_out, CROSSING_IN)
