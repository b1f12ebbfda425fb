"""Backward of the WY factors through A to k, v, beta and the gate cumsum.

    W = A diag(beta gamma) K,   U = A diag(beta) V,   A = (I + L)^-1,
    L = strict_lower(diag(beta) K K^T * exp(G_i - G_j))
    dA = dW (beta gamma K)^T + dU (beta V)^T,   dL = -strict_lower(A^T dA A^T)

The gate term of dL is ``rows(dL * L) - columns(dL * L)``, summed from one fp32
matrix so that each entry cancels exactly where the math cancels. Taking the
sums from dk's two products instead (``<(dL K)_i, k_i>`` and
``<((diag(beta) dL)^T K)_j, k_j>``, no ``K K^T``) rounds each side differently:
dg's error at bf16 rose from 6.2e-3 to 12.3e-3 on FLA's GVA in-kernel-norm case
(tests/precision_grid.py).
"""

from __future__ import annotations

import torch

from ..chunk_index import ChunkIndex
from ..precision import accumulator_dtype, matmul_mode, mm
from ._channel import channel_pulls
from ._chunks import ChunkGates, add_from_chunks, causal_decay, chunk_gates, chunk_rows, from_chunks, load_qk
from ._chunks import chunk_beta, to_chunks


def bwd_wy(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor,
    A: torch.Tensor,
    dw: torch.Tensor,
    du: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    beta_sigmoid: bool = False,
    beta_scale: float = 1.0,
    k_rstd: torch.Tensor | None,
    dk_acc: torch.Tensor,
    dv_out: torch.Tensor,
    dbeta_out: torch.Tensor,
    dg_acc: torch.Tensor,
) -> None:
    """k ``[T, H_qk, K]``; v ``[T, HV, V]``; beta, g ``[T, HV]``; A ``[T, HV, C]``;
    dw ``[T, HV, K]``; du ``[T, HV, V]`` (= dv_new). Adds into dk_acc ``[T, HV, K]``
    and dg_acc ``[T, HV]`` (each sum in the compute dtype, rounded once to the
    accumulator's dtype); writes dv_out ``[T, HV, V]`` and dbeta_out ``[T, HV]``
    (rounded to their dtypes). With a gate per key channel (KDA), g and dg_acc
    are ``[T, HV, K]``."""
    cdt = accumulator_dtype(k.dtype)
    HV = v.shape[1]
    rows = chunk_rows(index)
    kc, vc = load_qk(k, k_rstd, rows, cdt, HV), to_chunks(v, rows, cdt)
    bc, dbeta_dinput = chunk_beta(beta, rows, cdt, beta_sigmoid, beta_scale)
    gates = chunk_gates(g, rows, cdt, gate_params)
    Ac, dwc, duc = to_chunks(A, rows, cdt), to_chunks(dw, rows, cdt), to_chunks(du, rows, cdt)
    mode = matmul_mode(k.dtype)
    At_dw, At_du = mm(Ac.mT, dwc, mode), mm(Ac.mT, duc, mode)
    if gates.per_channel:
        dk, dbeta, dG = channel_wy(kc, vc, bc, gates, Ac, dwc, duc, At_dw, At_du, mode)
        add_from_chunks(dk, rows, dk_acc)
        add_from_chunks(dG, rows, dg_acc)
        from_chunks(bc[..., None] * At_du, rows, dv_out)
        from_chunks(dbeta * dbeta_dinput, rows, dbeta_out)
        return
    gamma = torch.exp(gates.cum)
    beta_gamma = bc * gamma
    kb, vb = beta_gamma[..., None] * kc, bc[..., None] * vc
    w_dot_k = (At_dw * kc).sum(-1)

    decay = causal_decay(gates, strict=True)
    dA = mm(dwc, kb.mT, mode) + mm(duc, vb.mT, mode)
    dL = -mm(mm(Ac.mT, dA, mode), Ac.mT, mode).tril(-1)
    dL_decayed = dL * decay
    # dL * L (L = diag(beta) K K^T * decay) as one fp32 matrix (module docstring)
    kkt = mm(kc, kc.mT, mode)
    dL_kkt = dL_decayed * kkt
    through_L = bc[..., None] * dL_kkt  # dL * L

    dKk = bc[..., None] * dL_decayed
    dk = beta_gamma[..., None] * At_dw + mm(dKk + dKk.mT, kc, mode)
    dbeta = gamma * w_dot_k + (At_du * vc).sum(-1) + dL_kkt.sum(-1)
    dG = beta_gamma * w_dot_k + through_L.sum(-1) - through_L.sum(-2)
    add_from_chunks(dk, rows, dk_acc)
    add_from_chunks(dG, rows, dg_acc)
    from_chunks(bc[..., None] * At_du, rows, dv_out)
    from_chunks(dbeta * dbeta_dinput, rows, dbeta_out)


def channel_wy(kc, vc, bc, gates: ChunkGates, Ac, dwc, duc, At_dw, At_du, mode: str):
    """:func:`bwd_wy`'s gradients in chunk layout for a gate per key channel
    (KDA): ``(dk [NC, HV, C, K], dbeta [NC, HV, C], dG [NC, HV, C, K])``. With
    ``L_ij = sum_d (beta_i k_id) k_jd exp(G_id - G_jd)`` (j < i), its gradient
    ``dL`` reaches the left operand as ``dL . K`` and the right one as
    ``dL^T . (beta K)`` (anchored blocks of :mod:`._channel`); the gate cumsum
    takes ``beta K * (dL . K) - K * (dL^T . beta K)`` and W's own decay."""
    gamma = torch.exp(gates.cum)
    kb = bc[..., None] * gamma * kc
    dA = mm(dwc, kb.mT, mode) + mm(duc, (bc[..., None] * vc).mT, mode)
    dL = -mm(mm(Ac.mT, dA, mode), Ac.mT, mode).tril(-1)
    d_left, d_right = channel_pulls(dL, kc, bc[..., None] * kc, gates.g, mode)
    through_w = gamma * kc * At_dw
    dk = bc[..., None] * (gamma * At_dw + d_left) + d_right
    dbeta = through_w.sum(-1) + (At_du * vc).sum(-1) + (kc * d_left).sum(-1)
    dG = bc[..., None] * (through_w + kc * d_left) - kc * d_right
    return dk, dbeta, dG
