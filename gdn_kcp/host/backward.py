"""Backward: [recompute #1, replay c1/c2, #2], local dv, [adjoint summary, b1/b2],
adjoint walk, the q/k/w/g gradients, the WY backward, gate cumsum and q/k norm.

The pool order here is what :mod:`gdn_kcp.queries.schedule` models.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from gdn_kcp.dtypes import compute_dtype
from gdn_kcp.exchange import backward_a2a, backward_ring
from gdn_kcp.exchange.a2a import Done
from gdn_kcp.options import overlaps_b2, save_plan

from .forward import Buffers, Call, ForwardTapes, run_channel_decays, run_forward_exchange, run_prep, run_tape_walk
from .segments import Segments, compose_ends, compose_starts, fold_nu, run_segment_nu, run_segment_summaries


@dataclass
class Grads:
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    d_initial_state: torch.Tensor | None
    d_gate_params: torch.Tensor | None = None


def run_backward_exchange(q, k, g, do, dv_local, call: Call, tapes: ForwardTapes, buffers: Buffers, *, m, kept_m,
                          replayed, d_final_state, seg: Segments | None, overlap: bool, decays: dict):
    """Adjoint summary of the crossing-in fragment (with segments: the fold of
    its segments' nu; KDA: on ``decays`` where the prep's recompute formed
    them, else its own), then b1/b2 (or the ring). Returns b2, whose
    ``finish(after)`` returns the end adjoint of the crossing-out fragment
    (``overlap``: b2 is in flight until then,
    :class:`gdn_kcp.exchange.a2a.InFlight`)."""
    ctx, arena = call.ctx, buffers.arena
    arena.phase("bwd.phase.nu")
    nu = None
    if ctx.n_in and seg is not None:
        nu = arena.bind("nu")
        fold_nu(call, seg, nu, d_final_state=d_final_state)
    elif ctx.n_in:
        nu = arena.bind("nu")
        call.programs.adjoint_summary(
            q, k, tapes.w, g, do, dv_local, call.index,
            scale=call.scale, q_rstd=tapes.q_rstd, k_rstd=tapes.k_rstd, d_final_state=d_final_state, nu_out=nu,
            **call.gate, **decays,
        )
    buffers.follow(dv_local, nu)
    if call.options.exchange == "ring":
        return Done(backward_ring(ctx, buffers, nu, m=m, kept_m=kept_m, replayed=replayed, HV=call.HV, K=call.K,
                                  V=call.V, options=call.options))
    return backward_a2a(ctx, buffers, nu, m=m, kept_m=kept_m, replayed=replayed, HV=call.HV, K=call.K, V=call.V,
                        options=call.options, overlap=overlap)


def run_w_u(k, v, g, beta, call: Call, buffers: Buffers, saved: dict[str, torch.Tensor]) -> ForwardTapes:
    """W and U again from the saved WY inverse (``save_mode="inverse"``): prep's
    second launch only, with the saved k norm."""
    tapes = ForwardTapes(A=saved["A"], w=buffers.take("w"), v_new=buffers.take("v_new"),
                         q_rstd=saved.get("q_rstd"), k_rstd=saved.get("k_rstd"))
    if not call.tapes_ready:
        call.programs.w_u(k, v, g, beta, tapes.A, call.index, k_rstd=tapes.k_rstd, w_out=tapes.w,
                          u_out=tapes.v_new, **call.gate, **call.beta)
    return tapes


def host_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    call: Call,
    buffers: Buffers,
    saved: dict[str, torch.Tensor],
    *,
    initial_state: torch.Tensor | None = None,
    d_final_state: torch.Tensor | None = None,
    n_initial_states: int | None = None,
) -> Grads:
    """Backward: dO ``[T, HV, V]``, the final-state gradient ``[N, HV, K, V]``
    (or None), and what the forward saved. Gradients come back in the dtypes of
    their inputs; the initial-state gradient ``[n_initial_states, HV, K, V]`` in
    the compute dtype."""
    plan = save_plan(call.options)
    ctx, arena = call.ctx, buffers.arena
    exchanges = ctx.exchanges
    replayed = exchanges and plan.replays_boundary
    overlap = exchanges and overlaps_b2(call.options)  # b2 runs under the recomputed tape walk
    summary = kept_m = None
    s_in = seg = None
    decays: dict[str, torch.Tensor] = {}  # KDA's walk decays (host.forward.run_channel_decays)
    if plan.keeps_tapes:
        tapes = ForwardTapes(
            A=saved["A"], w=saved["w"], v_new=saved["v_new"],
            q_rstd=saved.get("q_rstd"), k_rstd=saved.get("k_rstd"), h=saved["h"],
        )
        seg = run_segment_summaries(k, g, call, tapes, buffers, phase_call="bwd", with_s=False)
    else:
        arena.phase("bwd.phase.prep")
        if plan.keeps_inverse:
            tapes = run_w_u(k, v, g, beta, call, buffers, saved)
        else:
            tapes = run_prep(q, k, v, g, beta, call, buffers, with_A=True)
        # KDA: the decays of the segments' summaries, the tape walk and the adjoint walk (q's raw)
        decays.update(run_channel_decays(q, k, g, call, tapes, buffers, with_q=True, q_norm=False))
        # tapes ready: v_new holds v_new, not u, and no walk runs from the segments' starts. (Nor does such a
        # backward replay the boundary exchange, whose summary walk would read u: ops.library.tapes_into_workspace
        # keeps the tapes as tensors wherever the backward replays it.)
        seg = run_segment_summaries(k, g, call, tapes, buffers, phase_call="bwd", with_s=not call.tapes_ready,
                                    decays=decays)
        s_in = saved.get("s_in")
        if replayed:
            s_in, summary, kept_m = run_forward_exchange(k, g, call, tapes, buffers, initial_state=initial_state,
                                                           phase_call="bwd", seg=seg, decays=decays)
        if seg is not None and not call.tapes_ready:
            compose_starts(call, seg, buffers, phase_call="bwd", initial_state=initial_state, s_in=s_in,
                           final_state_out=None)

    def recompute_walk(fenced=Done.fenced) -> None:
        """The light backward's tape walk: h and v_new again (reading its
        index tables through ``fenced``: after an overlapped exchange's issue)."""
        arena.phase("bwd.phase.walk")
        index = seg.tables.walk if seg is not None else call.index
        run_tape_walk(k, g, call, tapes, buffers, initial_state=initial_state, s_in=s_in, final_state_out=None,
                      seg=seg, index=replace(index, chunk_table=fenced(index.chunk_table),
                                             frag_table=fenced(index.frag_table)), decays=decays)
        if replayed and s_in is not None:
            arena.release("s_in")
        if seg is not None and not call.tapes_ready:
            arena.release("seg_start")

    if not plan.keeps_tapes and not overlap:
        recompute_walk()

    HV, K, V = call.HV, call.K, call.V
    qk_norms = dict(q_rstd=tapes.q_rstd, k_rstd=tapes.k_rstd)
    arena.phase("bwd.phase.local_dv")
    dv_new = arena.bind("dv_new")  # the local dv until the adjoint walk completes it
    call.programs.bwd_local_dv(q, k, g, do, call.index, scale=call.scale, dv_out=dv_new, **qk_norms, **call.gate)
    run_segment_nu(q, k, g, do, dv_new, call, tapes, seg, buffers, decays)
    lam = None
    if exchanges:
        own_m = summary[..., V:] if summary is not None else saved.get("m")
        b2 = run_backward_exchange(
            q, k, g, do, dv_new, call, tapes, buffers, m=own_m, kept_m=kept_m if replayed else saved.get("owner_m"),
            replayed=replayed, d_final_state=d_final_state, seg=seg, overlap=overlap, decays=decays,
        )
        if overlap:
            recompute_walk(b2.fenced)
        lam = b2.finish(after=tapes.h)
    compose_ends(call, seg, buffers, d_final_state=d_final_state, lam=lam)

    arena.phase("bwd.phase.adjoint_walk")
    dh = arena.bind("dh")
    if plan.keeps_tapes:  # no tape walk ran: the adjoint walk's decays here
        decays.update(run_channel_decays(q, k, g, call, tapes, buffers, with_q=True, q_norm=False))
    d_initial_state = None
    if n_initial_states is not None:
        d_initial_state = torch.zeros(n_initial_states, HV, K, V, dtype=compute_dtype(q.dtype), device=q.device)
    call.programs.adjoint_walk(
        q, k, tapes.w, g, do, dv_new, seg.tables.adjoint if seg else call.index,
        scale=call.scale, d_final_state=d_final_state,
        lam_end=lam[:, :HV] if lam is not None and ctx.n_out else None,
        dh_out=dh, dv_out=dv_new, d_initial_state_out=d_initial_state, carry_in=seg.end if seg else None,
        **qk_norms, **call.gate, **decays,
    )
    if lam is not None:
        arena.release("lam")
    if seg is not None:
        arena.release("seg_end", "seg_index")
    arena.release(*decays)
    buffers.drop("w")

    arena.phase("bwd.phase.dqkwg")
    dq_heads, dk_heads, dw, dgcum = (arena.bind(name) for name in ("dq_heads", "dk_heads", "dw", "dgcum"))
    call.programs.bwd_dqkwg(
        q, k, g, tapes.h, tapes.v_new, do, dh, dv_new, call.index,
        scale=call.scale, dq_out=dq_heads, dk_out=dk_heads, dw_out=dw, dg_out=dgcum, **qk_norms, **call.gate,
    )
    arena.release("dh")
    buffers.drop("h", "v_new")

    arena.phase("bwd.phase.wy")
    dv, dbeta = torch.empty_like(v), torch.empty_like(beta)
    call.programs.bwd_wy(
        k, v, beta, g, tapes.A, dw, dv_new, call.index,
        k_rstd=tapes.k_rstd, dk_acc=dk_heads, dv_out=dv, dbeta_out=dbeta, dg_acc=dgcum, **call.gate, **call.beta,
    )
    arena.release("dw", "dv_new")
    buffers.drop("A")

    arena.phase("bwd.phase.grads")
    if call.gate_params is None:
        dg, d_gate_params = torch.empty_like(g), None
        call.programs.bwd_gate_cumsum(dgcum, call.index, dg_out=dg)
    else:
        dgate = torch.empty_like(g, dtype=call.gate_params.dtype)
        call.programs.bwd_gate_cumsum(dgcum, call.index, dg_out=dgate)
        dg, d_gate_params = gate_input_grads(g, call.gate_params, dgate)
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    call.programs.bwd_qk_norm(dq_heads, dk_heads, q, k, dq_out=dq, dk_out=dk, **qk_norms)
    arena.release("dgcum", "dq_heads", "dk_heads")
    buffers.drop(*call.norms)
    arena.close()
    return Grads(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, d_initial_state=d_initial_state,
                 d_gate_params=d_gate_params)


def gate_input_grads(a: torch.Tensor, gate_params: torch.Tensor, dgate: torch.Tensor):
    """The chain rule of ``gate = rate * softplus(a + bias)`` (``gate_params`` =
    ``[rate, bias]`` ``[2, HV]``) from ``dgate`` ``[T, HV]``: ``(da, d gate_params)``.
    Torch ops on ``[T, HV]`` in the compute dtype (backward only)."""
    rate, bias = gate_params
    x = a.to(dgate.dtype) + bias
    da = dgate * rate * torch.sigmoid(x)
    return da.to(a.dtype), torch.stack([(dgate * torch.nn.functional.softplus(x)).sum(0), da.sum(0)])
