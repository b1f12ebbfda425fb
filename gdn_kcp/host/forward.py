"""Forward: prep (#1), [summary, exchange c1/c2], tape walk (#2), output (#5)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_kcp.context import KcpContext
from gdn_kcp.exchange import forward_a2a, forward_ring
from gdn_kcp.kernels import CHUNK_SIZE, ChunkIndex
from gdn_kcp.kernels import torch as programs
from gdn_kcp.options import OptionsKcp


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 inputs run in fp64 (the oracle's precision); all others in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Boundary:
    """A KCP call: the split and the options. Absent on a single rank."""

    ctx: KcpContext
    options: OptionsKcp


@dataclass
class BoundarySaved:
    """What the forward keeps of the exchange for the backward: ``s_in``
    ``[1, HV, K, V]`` (crossing-in rank) and the rank's own ``m`` ``[1, HV, K, K]``
    (middle rank; b1 sends it again)."""

    s_in: torch.Tensor | None = None
    m: torch.Tensor | None = None


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
    h: torch.Tensor | None = None
    v_new: torch.Tensor | None = None


def run_prep(q, k, v, g, beta, index: ChunkIndex, *, use_qk_l2norm: bool) -> ForwardTapes:
    """Program #1 into fresh tapes (h, v_new not yet bound)."""
    T, H_qk, K = k.shape
    HV, V = v.shape[1], v.shape[2]
    cdt = compute_dtype(q.dtype)

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=cdt, device=q.device)

    tapes = ForwardTapes(
        gcum=empty(T, HV), A=empty(T, HV, CHUNK_SIZE), w=empty(T, HV, K), u=empty(T, HV, V),
        q_rstd=empty(T, H_qk) if use_qk_l2norm else None,
        k_rstd=empty(T, H_qk) if use_qk_l2norm else None,
    )
    programs.prep(
        q, k, v, g, beta, index,
        gcum_out=tapes.gcum, A_out=tapes.A, w_out=tapes.w, u_out=tapes.u,
        q_rstd_out=tapes.q_rstd, k_rstd_out=tapes.k_rstd,
    )
    return tapes


def run_tape_walk(
    k, tapes: ForwardTapes, index: ChunkIndex, *, initial_state, s_in, final_state_out
) -> None:
    """Program #2: binds and fills ``tapes.h`` and ``tapes.v_new``."""
    HV, K, V = tapes.w.shape[1], tapes.w.shape[2], tapes.u.shape[2]
    tapes.h = torch.empty(index.n_chunks, HV, K, V, dtype=tapes.gcum.dtype, device=k.device)
    tapes.v_new = torch.empty_like(tapes.u)
    programs.tape_walk(
        k, tapes.w, tapes.u, tapes.gcum, index,
        k_rstd=tapes.k_rstd, initial_state=initial_state, s_in=s_in,
        h_out=tapes.h, v_new_out=tapes.v_new, final_state_out=final_state_out,
    )


def run_forward_exchange(k, tapes: ForwardTapes, index: ChunkIndex, boundary: Boundary) -> BoundarySaved:
    """Summary walk of the crossing-out fragment, then c1/c2 (or the ring)."""
    ctx = boundary.ctx
    HV, K, V = tapes.w.shape[1], tapes.w.shape[2], tapes.u.shape[2]
    cdt, device = tapes.gcum.dtype, k.device
    s_loc = m = None
    if ctx.n_out:
        s_loc = torch.empty(1, HV, K, V, dtype=cdt, device=device)
        m = torch.empty(1, HV, K, K, dtype=cdt, device=device) if ctx.rank_middle[ctx.rank] else None
        programs.summary_walk(k, tapes.w, tapes.u, tapes.gcum, index, k_rstd=tapes.k_rstd, s_loc_out=s_loc, m_out=m)
    if boundary.options.exchange == "ring":
        s_in = forward_ring(ctx, s_loc, m, HV, K, V, dtype=cdt, device=device)
    else:
        s_in, _ = forward_a2a(ctx, s_loc, m, HV, K, V, dtype=cdt, device=device)
    return BoundarySaved(s_in=s_in, m=m)


def host_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    index: ChunkIndex,
    *,
    scale: float,
    use_qk_l2norm: bool,
    initial_state: torch.Tensor | None = None,
    n_final_states: int | None = None,
    boundary: Boundary | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, ForwardTapes, BoundarySaved]:
    """Forward on token-layout tensors (q, k ``[T, H_qk, K]``, v ``[T, HV, V]``,
    g, beta ``[T, HV]``). Returns o ``[T, HV, V]`` (q's dtype), the final states
    ``[n_final_states, HV, K, V]`` (compute dtype) when ``n_final_states`` is
    given, the tapes, and what the exchange leaves for the backward."""
    tapes = run_prep(q, k, v, g, beta, index, use_qk_l2norm=use_qk_l2norm)
    saved = BoundarySaved()
    if boundary is not None and boundary.ctx.exchanges:
        saved = run_forward_exchange(k, tapes, index, boundary)
    final_state = None
    if n_final_states is not None:
        HV, K, V = v.shape[1], k.shape[2], v.shape[2]
        final_state = torch.zeros(n_final_states, HV, K, V, dtype=tapes.gcum.dtype, device=q.device)
    run_tape_walk(k, tapes, index, initial_state=initial_state, s_in=saved.s_in, final_state_out=final_state)
    o = torch.empty_like(v, dtype=q.dtype)
    programs.output(
        q, k, tapes.gcum, tapes.h, tapes.v_new, index,
        scale=scale, q_rstd=tapes.q_rstd, k_rstd=tapes.k_rstd, o_out=o,
    )
    return o, final_state, tapes, saved
