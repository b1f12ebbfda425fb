"""Forward: the tape walk and the output in one walk, for a forward that keeps
no tape (``save_mode`` light or inverse): per chunk of every fragment, from its
state S0 at the chunk start,

    Vn  = U - W S0
    O   = scale [diag(gamma) Q S0 + P Vn]              (P: :func:`scores`)
    S_C = gamma_C S0 + (diag(gamma_C / gamma) K)^T Vn

so neither the states at the chunk starts (``h``) nor v_new is written. Each
product rounds its operands as :func:`tape_walk` then :func:`output` do (S0 and
Vn to the input dtype), so o is the same up to the products' summation order.
"""

from __future__ import annotations

import torch

from ..chunk_index import CROSSING_OUT, ChunkIndex
from ..precision import accumulator_dtype, matmul_mode, mm
from ._chunks import chunk_gates, chunk_rows, from_chunks, load_qk, lower_matmul, put_rows, to_chunks
from ._walk import forward_steps, state_step, walk_operands
from .tape_walk import start_states, write_end_states


def walk_output(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g: torch.Tensor,
    scores: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    scale: float,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    s_in: torch.Tensor | None,
    o_out: torch.Tensor,
    final_state_out: torch.Tensor | None,
    carry_in: torch.Tensor | None = None,
    k_decayed: torch.Tensor | None = None,
    q_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> None:
    """q, k ``[T, H_qk, K]``; w ``[T, HV, K]``, u ``[T, HV, V]``, g ``[T, HV]``,
    scores ``[T, HV, C]`` (:func:`scores`); initial_state, s_in, carry_in and
    final_state_out as for :func:`tape_walk`; KDA's decays formed once a chunk
    (``k_decayed``, ``q_decayed`` from normalised q, ``chunk_decay``:
    :func:`.channel_decays.channel_decays`) or None. Writes o_out ``[T, HV, V]``."""
    cdt = accumulator_dtype(k.dtype)
    HV, K, V = w.shape[1], w.shape[2], u.shape[2]
    mode = matmul_mode(q.dtype)
    rows = chunk_rows(index)
    ops = walk_operands(k, k_rstd, w, g, rows, cdt, gate_params, k_decayed, chunk_decay)
    uc = to_chunks(u, rows, cdt)
    if q_decayed is not None:
        q_decayed = to_chunks(q_decayed, rows, cdt)
    else:
        gates = chunk_gates(g, rows, cdt, gate_params)
        q_decayed = gates.rows(torch.exp(gates.cum)) * load_qk(q, q_rstd, rows, cdt, HV)
    pc = to_chunks(scores, rows, cdt)
    oc = torch.empty_like(uc)
    S = start_states(index, uc.new_empty((1, HV, K, V)), initial_state, s_in, carry_in)
    for active, c in forward_steps(index):
        vn, S_next = state_step(ops, uc, c, S)
        put_rows(oc, c, active, mm(q_decayed[c], S, mode) + lower_matmul(pc[c], vn, mode))
        S = torch.where(active[:, None, None, None], S_next, S)
    from_chunks(scale * oc, rows, o_out)
    write_end_states(index, S, final_state_out, CROSSING_OUT)
