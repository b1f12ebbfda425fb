"""Rank-local forward and backward over the torch programs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_kcp.kernels import CHUNK_SIZE, ChunkIndex
from gdn_kcp.kernels import torch as programs


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 inputs run in fp64 (the oracle's precision); all others in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class ForwardTapes:
    """What the forward programs write and the backward programs read.

    gcum ``[T, HV]``, A ``[T, HV, C]``, w ``[T, HV, K]``, u ``[T, HV, V]``,
    q_rstd / k_rstd ``[T, H_qk]`` (None without the L2 norm), h ``[NC, HV, K, V]``,
    v_new ``[T, HV, V]``; all in the compute dtype.
    """

    gcum: torch.Tensor
    A: torch.Tensor
    w: torch.Tensor
    u: torch.Tensor
    q_rstd: torch.Tensor | None
    k_rstd: torch.Tensor | None
    h: torch.Tensor
    v_new: torch.Tensor


def run_prep_and_walk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    index: ChunkIndex,
    *,
    use_qk_l2norm: bool,
    initial_state: torch.Tensor | None,
    s_in: torch.Tensor | None,
    final_state_out: torch.Tensor | None,
) -> ForwardTapes:
    """Programs #1 (prep) and #2 (tape walk)."""
    T, H_qk, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    cdt = compute_dtype(q.dtype)

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=cdt, device=q.device)

    tapes = ForwardTapes(
        gcum=empty(T, HV),
        A=empty(T, HV, CHUNK_SIZE),
        w=empty(T, HV, K),
        u=empty(T, HV, V),
        q_rstd=empty(T, H_qk) if use_qk_l2norm else None,
        k_rstd=empty(T, H_qk) if use_qk_l2norm else None,
        h=empty(index.n_chunks, HV, K, V),
        v_new=empty(T, HV, V),
    )
    programs.prep(
        q, k, v, g, beta, index,
        gcum_out=tapes.gcum, A_out=tapes.A, w_out=tapes.w, u_out=tapes.u,
        q_rstd_out=tapes.q_rstd, k_rstd_out=tapes.k_rstd,
    )
    programs.tape_walk(
        k, tapes.w, tapes.u, tapes.gcum, index,
        k_rstd=tapes.k_rstd, initial_state=initial_state, s_in=s_in,
        h_out=tapes.h, v_new_out=tapes.v_new, final_state_out=final_state_out,
    )
    return tapes


def forward_local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    index: ChunkIndex,
    *,
    scale: float,
    use_qk_l2norm: bool,
    initial_state: torch.Tensor | None,
    s_in: torch.Tensor | None = None,
    n_final_states: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, ForwardTapes]:
    """Forward on token-layout tensors (q, k ``[T, H_qk, K]``, v ``[T, HV, V]``,
    g, beta ``[T, HV]``). Returns o ``[T, HV, V]`` (q's dtype), the final states
    ``[n_final_states, HV, K, V]`` (compute dtype) when ``n_final_states`` is
    given, and the tapes."""
    HV, K, V = v.shape[1], k.shape[2], v.shape[2]
    final_state = None
    if n_final_states is not None:
        final_state = torch.zeros(n_final_states, HV, K, V, dtype=compute_dtype(q.dtype), device=q.device)
    tapes = run_prep_and_walk(
        q, k, v, g, beta, index,
        use_qk_l2norm=use_qk_l2norm, initial_state=initial_state, s_in=s_in, final_state_out=final_state,
    )
    o = torch.empty_like(v, dtype=q.dtype)
    programs.output(
        q, k, tapes.gcum, tapes.h, tapes.v_new, index,
        scale=scale, q_rstd=tapes.q_rstd, k_rstd=tapes.k_rstd, o_out=o,
    )
    return o, final_state, tapes


@dataclass
class LocalGrads:
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    d_initial_state: torch.Tensor | None


def backward_local(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    index: ChunkIndex,
    do: torch.Tensor,
    *,
    tapes: ForwardTapes,
    scale: float,
    d_final_state: torch.Tensor | None,
    lam_out: torch.Tensor | None = None,
    n_initial_states: int | None = None,
) -> LocalGrads:
    """Backward given the forward tapes, dO ``[T, HV, V]``, the final-state
    gradient ``[N, HV, K, V]`` (or None) and, for a crossing-out fragment, its end
    adjoint ``lam_out``. Gradients come back in the dtypes of their inputs; the
    initial-state gradient ``[n_initial_states, HV, K, V]`` in the compute dtype."""
    T, H_qk, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    cdt = tapes.gcum.dtype

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=cdt, device=q.device)

    qk_norms = dict(q_rstd=tapes.q_rstd, k_rstd=tapes.k_rstd)
    dv_local = empty(T, HV, V)
    programs.bwd_local_dv(q, k, tapes.gcum, do, index, scale=scale, dv_out=dv_local, **qk_norms)

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
    return LocalGrads(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, d_initial_state=d_initial_state)
