"""Backward: dq, dk, dw and the gate-cumsum gradient of the output and walk terms.

With S0 = h[c], dS = dh[c], P = (Q K^T) * exp(G_i - G_j) * [i >= j]:

    dQ = scale diag(gamma) dO S0^T + (dP * D) K,       dP = scale dO Vn^T
    dK = (dP * D)^T Q + diag(gamma_C / gamma) Vn dS^T
    dW = -dVn S0^T
    dG = <dQ_state_i, Q_i> + rows(dP * P) - columns(dP * P) - <dK_end_i, K_i>
         (the chunk's last row also takes gamma_C <dS, S0> and the decay of the
         end-state term)

The score terms of dG are the row and column sums of one fp32 matrix dP * P,
so each entry enters both sums as the same number and their difference (and
its reverse cumsum into dg) cancels exactly where the math cancels. The
identity ``rows(dP * P)_i = <((dP * D) K)_i, Q_i>`` would save the ``Q K^T``
product, but its two sides are then differently rounded sums: at bf16, K = 128
and a decay of e^-6 to e^-14 per token the gate gradient came out 6.2 times
its own size in error (tests/precision_grid.py; 4.4e-3 with the sums of one
matrix).
"""

from __future__ import annotations

import torch

from ..chunk_index import ChunkIndex
from ..precision import accumulator_dtype, matmul_mode, mm
from ._channel import channel_pulls
from ._chunks import ChunkGates, causal_mask, causal_scores, chunk_gates, chunk_rows, from_chunks, load_qk, to_chunks


def bwd_dqkwg(
    q: torch.Tensor,
    k: torch.Tensor,
    g: torch.Tensor,
    h: torch.Tensor,
    v_new: torch.Tensor,
    do: torch.Tensor,
    dh: torch.Tensor,
    dv_new: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    scale: float,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    dq_out: torch.Tensor,
    dk_out: torch.Tensor,
    dw_out: torch.Tensor,
    dg_out: torch.Tensor,
) -> None:
    """q, k ``[T, H_qk, K]``; g ``[T, HV]``; h, dh ``[NC, HV, K, V]``; v_new,
    do, dv_new ``[T, HV, V]``. Writes, per value head (computed in the compute
    dtype, rounded once to each output's dtype), dq_out, dk_out, dw_out
    ``[T, HV, K]`` and dg_out ``[T, HV]`` (gradient of the gate cumsum). With a
    gate per key channel (KDA), g and dg_out are ``[T, HV, K]``."""
    cdt = accumulator_dtype(k.dtype)
    HV = v_new.shape[1]
    rows = chunk_rows(index)
    qc, kc = load_qk(q, q_rstd, rows, cdt, HV), load_qk(k, k_rstd, rows, cdt, HV)
    gates = chunk_gates(g, rows, cdt, gate_params)
    vn, doc, dvn = to_chunks(v_new, rows, cdt), to_chunks(do, rows, cdt), to_chunks(dv_new, rows, cdt)
    h, dh = h.to(cdt), dh.to(cdt)  # h is a tape in the input dtype
    mode = matmul_mode(q.dtype)
    if gates.per_channel:
        dq, dk, dw, dG = channel_dqkwg(qc, kc, gates, h, dh, vn, doc, dvn, rows.last, scale, mode)
        for x, out in ((dq, dq_out), (dk, dk_out), (dw, dw_out), (dG, dg_out)):
            from_chunks(x, rows, out)
        return
    gamma = torch.exp(gates.cum)
    gamma_ratio = torch.exp(gates.tail)  # gamma_C / gamma

    dq_state = scale * gamma[..., None] * mm(doc, h.mT, mode)
    dscores = scale * causal_scores(doc, vn, gates, mode=mode)  # dP * D
    dk_end = gamma_ratio[..., None] * mm(vn, dh.mT, mode)
    from_chunks(dq_state + mm(dscores, kc, mode), rows, dq_out)
    from_chunks(mm(dscores.mT, qc, mode) + dk_end, rows, dk_out)
    from_chunks(-mm(dvn, h.mT, mode), rows, dw_out)

    through_scores = dscores * mm(qc, kc.mT, mode)  # dP * P, one fp32 matrix
    through_end = (dk_end * kc).sum(-1)  # <dKd_i, Kd_i>
    dG = (dq_state * qc).sum(-1) + through_scores.sum(-1) - through_scores.sum(-2) - through_end
    d_last = through_end.sum(-1) + torch.exp(gates.cum[..., -1]) * (dh * h).sum((-2, -1))
    dG = dG + rows.last[:, None, :] * d_last[..., None]
    from_chunks(dG, rows, dg_out)


def channel_dqkwg(qc, kc, gates: ChunkGates, h, dh, vn, doc, dvn, last_row, scale: float, mode: str):
    """:func:`bwd_dqkwg` in chunk layout for a gate per key channel (KDA):
    ``(dq, dk, dw, dG)``, each ``[NC, HV, C, K]``. With
    ``P_ij = sum_d q_id k_jd exp(G_id - G_jd)`` and ``dP = scale dO Vn^T`` (causal),
    ``dQ_P = dP . K`` and ``dK_P = dP^T . Q`` through the anchored blocks of
    :mod:`._channel`, and the gate cumsum takes ``Q * dQ_P - K * dK_P`` per
    channel beside the state and end terms of the head-gate form (``last_row``
    ``[NC, C]``: the chunk's last row, which takes the whole-chunk decay's terms)."""
    gamma = torch.exp(gates.cum)
    d_scores = scale * mm(doc, vn.mT, mode)
    d_scores = torch.where(causal_mask(d_scores.shape[-1], False, d_scores.device), d_scores,
                           torch.zeros((), dtype=d_scores.dtype, device=d_scores.device))
    dq_scores, dk_scores = channel_pulls(d_scores, kc, qc, gates.g, mode)
    dq_state = scale * gamma * mm(doc, h.mT, mode)
    dk_end = torch.exp(gates.tail) * mm(vn, dh.mT, mode)
    through_end = dk_end * kc
    dG = dq_state * qc + dq_scores * qc - dk_scores * kc - through_end
    d_last = through_end.sum(-2) + torch.exp(gates.last) * (dh * h).sum(-1)  # [NC, HV, K]
    dG = dG + last_row[:, None, :, None] * d_last[..., None, :]
    return dq_state + dq_scores, dk_scores + dk_end, -mm(dvn, h.mT, mode), dG
