"""Backward: recompute #1 and #2 (light), local dv, [adjoint summary, b1/b2],
adjoint walk, the q/k/w/g gradients, the WY backward, gate cumsum and q/k norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_kcp.exchange import backward_a2a, backward_ring
from gdn_kcp.kernels import ChunkIndex
from gdn_kcp.kernels import torch as programs

from .forward import Boundary, BoundarySaved, ForwardTapes, run_prep, run_tape_walk


@dataclass
class Grads:
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    d_initial_state: torch.Tensor | None


def run_backward_exchange(q, k, do, dv_local, tapes: ForwardTapes, index: ChunkIndex, *, scale: float,
                          boundary: Boundary, saved: BoundarySaved) -> torch.Tensor | None:
    """Adjoint summary of the crossing-in fragment, then b1/b2 (or the ring)."""
    ctx = boundary.ctx
    HV, K, V = tapes.w.shape[1], tapes.w.shape[2], tapes.u.shape[2]
    cdt, device = tapes.gcum.dtype, q.device
    nu = None
    if ctx.n_in:
        nu = torch.empty(1, HV, K, V, dtype=cdt, device=device)
        programs.adjoint_summary(
            q, k, tapes.w, tapes.gcum, do, dv_local, index,
            scale=scale, q_rstd=tapes.q_rstd, k_rstd=tapes.k_rstd, nu_out=nu,
        )
    exchange = backward_ring if boundary.options.exchange == "ring" else backward_a2a
    return exchange(ctx, nu, saved.m, HV, K, V, dtype=cdt, device=device)


def host_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    index: ChunkIndex,
    do: torch.Tensor,
    *,
    scale: float,
    use_qk_l2norm: bool,
    initial_state: torch.Tensor | None = None,
    d_final_state: torch.Tensor | None = None,
    n_initial_states: int | None = None,
    boundary: Boundary | None = None,
    saved: BoundarySaved | None = None,
) -> Grads:
    """Backward from the saved inputs: dO ``[T, HV, V]``, the final-state gradient
    ``[N, HV, K, V]`` (or None). Gradients come back in the dtypes of their
    inputs; the initial-state gradient ``[n_initial_states, HV, K, V]`` in the
    compute dtype."""
    saved = saved or BoundarySaved()
    tapes = run_prep(q, k, v, g, beta, index, use_qk_l2norm=use_qk_l2norm)
    run_tape_walk(k, tapes, index, initial_state=initial_state, s_in=saved.s_in, final_state_out=None)
    T, H_qk, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    cdt = tapes.gcum.dtype

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=cdt, device=q.device)

    qk_norms = dict(q_rstd=tapes.q_rstd, k_rstd=tapes.k_rstd)
    dv_local = empty(T, HV, V)
    programs.bwd_local_dv(q, k, tapes.gcum, do, index, scale=scale, dv_out=dv_local, **qk_norms)
    lam_out = None
    if boundary is not None and boundary.ctx.exchanges:
        lam_out = run_backward_exchange(q, k, do, dv_local, tapes, index, scale=scale, boundary=boundary, saved=saved)

    dh, dv_new = empty(index.n_chunks, HV, K, V), empty(T, HV, V)
    d_initial_state = None
    if n_initial_states is not None:
        d_initial_state = torch.zeros(n_initial_states, HV, K, V, dtype=cdt, device=q.device)
    programs.adjoint_walk(
        q, k, tapes.w, tapes.gcum, do, dv_local, index,
        scale=scale, d_final_state=d_final_state, lam_out=lam_out,
        dh_out=dh, dv_out=dv_new, d_initial_state_out=d_initial_state, **qk_norms,
    )
    del dv_local

    dq_heads, dk_heads, dw, dgcum = empty(T, HV, K), empty(T, HV, K), empty(T, HV, K), empty(T, HV)
    programs.bwd_dqkwg(
        q, k, tapes.gcum, tapes.h, tapes.v_new, do, dh, dv_new, index,
        scale=scale, dq_out=dq_heads, dk_out=dk_heads, dw_out=dw, dg_out=dgcum, **qk_norms,
    )
    del dh
    dv, dbeta = torch.empty_like(v), torch.empty_like(beta)
    programs.bwd_wy(
        k, v, beta, tapes.gcum, tapes.A, dw, dv_new, index,
        k_rstd=tapes.k_rstd, dk_acc=dk_heads, dv_out=dv, dbeta_out=dbeta, dg_acc=dgcum,
    )
    dg = torch.empty_like(g)
    programs.bwd_gate_cumsum(dgcum, index, dg_out=dg)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    programs.bwd_qk_norm(dq_heads, dk_heads, q, k, dq_out=dq, dk_out=dk, **qk_norms)
    return Grads(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, d_initial_state=d_initial_state)
