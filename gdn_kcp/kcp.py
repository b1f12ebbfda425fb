"""KCP GDN: :func:`gdn_kcp`, one rank's part of a packed stream split over a group."""

from __future__ import annotations

import torch

from gdn_kcp.call_checks import check_kcp_inputs
from gdn_kcp.context import KcpContext
from gdn_kcp.ops import apply_gdn
from gdn_kcp.options import OptionsKcp
from gdn_kcp.rank_check import check_ranks_agree
from gdn_kcp.workspace import WorkspaceKcp


def gdn_kcp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ctx: KcpContext,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool | None = None,
    options: OptionsKcp | None = None,
    workspace: WorkspaceKcp | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    use_qk_l2norm: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GDN over a packed stream split across the ranks of ``ctx`` (KCP).

    Every rank passes its own token range ``ctx.rank_ranges[ctx.rank]``:
    q, k ``[1, T_r, H_qk, K]``, v ``[1, T_r, HV, V]``, g, beta ``[1, T_r, HV]``
    (FLA layouts). Returns ``(o, final_state)`` as
    :func:`chunk_gated_delta_rule` does: o ``[1, T_r, HV, V]``, equal to the
    rows of the single-rank call on the whole stream (gradients likewise), and
    final_state None unless ``output_final_state=True``. States are the
    rank's own: ``initial_state`` ``[ctx.n_start_docs, HV, K, V]`` holds the
    initial states of the documents that start on this rank (global ids
    ``ctx.start_docs``; a document that crosses in starts from the state the
    exchange brings), and final_state ``[ctx.n_end_docs, HV, K, V]`` (fp32;
    fp64 for fp64 inputs) those of the documents that end on this rank
    (``ctx.end_docs``). Over the ranks, these rows are the one-rank call's,
    each exactly once. Every rank of the group must call it (and its
    backward) together.
    ``use_qk_l2norm_in_kernel`` (FLA's name; ``use_qk_l2norm`` is the same
    switch under its older name) is a shortcut for
    ``options.use_qk_l2norm``. ``workspace``
    (a :class:`WorkspaceKcp` of the same context layout, shapes, dtype and options)
    serves both calls; without it each call allocates its own. ``A_log``,
    ``dt_bias``, ``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel`` and
    ``allow_neg_eigval`` are FLA's gate and beta keywords, as in
    :func:`chunk_gated_delta_rule` (:mod:`gdn_kcp.gates`). The first
    eager call through a workspace checks, with one all-gather, that every
    rank calls with the same shapes, dtypes and options (as
    ``GDN_KCP_CHECK_RANKS=1`` does on every call): a rank that differs gets
    the same ``ValueError`` on every rank, not a hang or a mixed result.

    Example::

        ctx = build_kcp_context(cu_seqlens_global)              # same on every rank
        start, end = ctx.rank_ranges[ctx.rank]
        o, _ = gdn_kcp(q[:, start:end], k[:, start:end], v[:, start:end],
                       g[:, start:end], beta[:, start:end], ctx, use_qk_l2norm_in_kernel=True)
    """
    gate_kwargs = dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=use_gate_in_kernel,
                       use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval)
    arguments = dict(scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_qk_l2norm=use_qk_l2norm, options=options,
                     workspace=workspace, gate_kwargs=gate_kwargs)
    first_workspace_call = isinstance(workspace, WorkspaceKcp) and not workspace.ranks_agreed
    # before any local check can raise: a rank that raised alone would leave the others in a collective
    agreed = check_ranks_agree(ctx, q, k, v, g, beta, **arguments, first_workspace_call=first_workspace_call)
    if first_workspace_call and agreed:
        workspace.ranks_agreed = True
    options, dims, gate = check_kcp_inputs(q, k, v, g, beta, ctx, **arguments)
    T = dims.T
    o, final_state = apply_gdn(
        q.reshape(T, dims.H_qk, dims.K),
        k.reshape(T, dims.H_qk, dims.K),
        v.reshape(T, dims.HV, dims.V),
        g.reshape(T, dims.HV, *((dims.K,) if options.gate == "channel" else ())),
        beta.reshape(T, dims.HV),
        initial_state, ctx, options, float(dims.K**-0.5 if scale is None else scale),
        ctx.n_end_docs if output_final_state else 0, workspace, gate,
    )
    return o.view(1, T, dims.HV, dims.V), final_state if output_final_state else None
