"""The walks' decayed operands with a gate per key channel (KDA), once a chunk
and value head:

    k_decayed = K exp(G_C - G)      (k L2-normalised when k_rstd is given)
    q_decayed = Q exp(G)            (q normalised when q_rstd is given, raw else)
    chunk_decay = exp(G_C)          (the state's row decay over the chunk)

each exponent a sum of exactly the gates it spans (at most 0), the two
operands rounded as the products read them (:func:`precision.round_operands`
under the rule of k's dtype). A walk program of value tile ``BV`` forms these
for every one of its ``V / BV`` tiles otherwise: written once here, the
walks read them (``k_decayed=``, ``q_decayed=``, ``chunk_decay=``). The
forward's walk with the output reads q normalised, the adjoint walk raw (its
norm and scale go on dO's side, :func:`._walk.q_decayed_do`).
"""

from __future__ import annotations

import torch

from ..chunk_index import ChunkIndex
from ..precision import accumulator_dtype, matmul_mode, round_operands
from ._chunks import chunk_gates, chunk_rows, from_chunks, load_qk


def channel_decays(
    q: torch.Tensor | None,
    k: torch.Tensor,
    g: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    k_decayed_out: torch.Tensor,
    q_decayed_out: torch.Tensor | None,
    chunk_decay_out: torch.Tensor,
) -> None:
    """q, k ``[T, H_qk, K]`` (q None: no ``q_decayed``), g ``[T, HV, K]`` (a
    gate per key channel; with ``gate_params`` ``[2, HV, K]`` the raw input).
    Writes k_decayed_out and q_decayed_out ``[T, HV, K]`` (the input dtype, or
    the compute dtype for fp32 inputs) and chunk_decay_out ``[NC, HV, K]``
    (compute dtype)."""
    if g.dim() != 3:
        raise ValueError(f"channel_decays takes a gate per key channel [T, HV, K], got g of shape {tuple(g.shape)}")
    if index.n_chunks == 0:
        return
    cdt = accumulator_dtype(k.dtype)
    HV = g.shape[1]
    mode = matmul_mode(k.dtype)
    rows = chunk_rows(index)
    gates = chunk_gates(g, rows, cdt, gate_params)
    kd, = round_operands(mode, load_qk(k, k_rstd, rows, cdt, HV) * torch.exp(gates.tail))
    from_chunks(kd, rows, k_decayed_out)
    if q is not None:
        qd, = round_operands(mode, load_qk(q, q_rstd, rows, cdt, HV) * torch.exp(gates.cum))
        from_chunks(qd, rows, q_decayed_out)
    chunk_decay_out.copy_(torch.exp(gates.last))
