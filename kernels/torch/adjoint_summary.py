"""KCP adjoint summary: ``nu``, the start adjoint of the crossing-in fragment
walked back from a zero end adjoint. With the true end adjoint ``lambda_end``
the start adjoint is ``M^T lambda_end + nu``, which the owners compose."""

from __future__ import annotations

import torch

from ..chunk_index import CROSSING_IN, CROSSING_OUT, ChunkIndex, crosses
from ..precision import accumulator_dtype
from ._chunks import chunk_rows, to_chunks
from ._walk import adjoint_step, q_decayed_do, walk_operands
from .tape_walk import gather_states


def adjoint_summary(
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
    nu_out: torch.Tensor,
    k_decayed: torch.Tensor | None = None,
    q_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> None:
    """Walk fragment 0 (the crossing-in one) of ``index`` backwards from zero,
    or from its final-state gradient when it ends its document here.

    q, k ``[T, H_qk, K]``; w ``[T, HV, K]``; g ``[T, HV]``; do, dv_local
    ``[T, HV, V]``; d_final_state ``[N_end, HV, K, V]`` (rows as the tape
    walk's final states) or None. Writes nu_out ``[1, HV, K, V]`` (compute dtype).
    KDA's decays may come formed (``k_decayed``, ``q_decayed`` of the raw q,
    ``chunk_decay``: ``channel_decays``' pools).
    """
    cdt = accumulator_dtype(k.dtype)
    rows = chunk_rows(index)
    ops = walk_operands(k, k_rstd, w, g, rows, cdt, gate_params, k_decayed, chunk_decay)
    pull = q_decayed_do(q, q_rstd, do, g, rows, cdt, scale, gate_params, q_decayed)
    dvl = to_chunks(dv_local, rows, cdt)
    # fragment 0 starts at chunk 0; on a capped index it may not cross in: nu = 0 (the identity)
    crosses_in = crosses(index.frag_flags[:1], CROSSING_IN)
    n = torch.where(crosses_in, index.frag_n_chunks[:1].long(), 0)
    dS = gather_states(index, d_final_state, CROSSING_OUT, nu_out.new_zeros((index.n_frag,) + nu_out.shape[1:]))[:1]
    dS = torch.where(crosses_in[:, None, None, None], dS, 0)
    for j in reversed(range(index.max_frag_chunks)):
        c = torch.full_like(n, j).clamp(max=index.n_chunks - 1)
        _, dS_prev = adjoint_step(ops, dvl, pull, c, dS)
        dS = torch.where((n > j)[:, None, None, None], dS_prev, dS)
    nu_out.copy_(dS)
