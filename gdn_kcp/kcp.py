"""KCP GDN: :func:`gdn_kcp`, one rank's part of a packed stream split over a group."""

from __future__ import annotations

from dataclasses import replace

import torch

from gdn_kcp.context import KcpContext
from gdn_kcp.host import Boundary, BoundarySaved, host_backward, host_forward
from gdn_kcp.options import OptionsKcp
from gdn_kcp.validate import check_gdn_inputs


class _GdnKcp(torch.autograd.Function):
    """Forward and backward of one rank, exchanging boundary states with the
    others; saves the inputs and the boundary state (light save mode)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, boundary: Boundary, scale: float):
        index = boundary.ctx.device_index if q.device.type != "cpu" else boundary.ctx.index
        o, _, _, saved = host_forward(
            q, k, v, g, beta, index, scale=scale, use_qk_l2norm=boundary.options.use_qk_l2norm, boundary=boundary
        )
        ctx.save_for_backward(q, k, v, g, beta, saved.s_in, saved.m)
        ctx.boundary, ctx.index, ctx.scale = boundary, index, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta, s_in, m = ctx.saved_tensors
        grads = host_backward(
            q, k, v, g, beta, ctx.index, do.contiguous(),
            scale=ctx.scale, use_qk_l2norm=ctx.boundary.options.use_qk_l2norm,
            boundary=ctx.boundary, saved=BoundarySaved(s_in=s_in, m=m),
        )
        return grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, None, None


def resolve_options(options: OptionsKcp | None, use_qk_l2norm: bool | None) -> OptionsKcp:
    if options is not None and not isinstance(options, OptionsKcp):
        raise TypeError(f"options must be an OptionsKcp or None, got {type(options).__name__}")
    if use_qk_l2norm is None:
        return options or OptionsKcp()
    if not isinstance(use_qk_l2norm, bool):
        raise TypeError(f"use_qk_l2norm must be a bool or None, got {type(use_qk_l2norm).__name__}")
    if options is not None and use_qk_l2norm != options.use_qk_l2norm:
        raise ValueError(
            f"use_qk_l2norm={use_qk_l2norm} disagrees with options.use_qk_l2norm={options.use_qk_l2norm}"
        )
    return replace(options or OptionsKcp(), use_qk_l2norm=use_qk_l2norm)


def gdn_kcp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ctx: KcpContext,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool | None = None,
    options: OptionsKcp | None = None,
) -> torch.Tensor:
    """GDN over a packed stream split across the ranks of ``ctx`` (KCP).

    Every rank passes its own token range ``ctx.rank_ranges[ctx.rank]``:
    q, k ``[1, T_r, H_qk, K]``, v ``[1, T_r, HV, V]``, g, beta ``[1, T_r, HV]``
    (FLA layouts). Returns o ``[1, T_r, HV, V]``, equal to the rows of the
    single-rank :func:`chunk_gated_delta_rule` of the whole stream; gradients
    likewise. Every rank of the group must call it (and its backward) together.
    ``use_qk_l2norm`` is a shortcut for ``options.use_qk_l2norm``.

    Example::

        ctx = build_kcp_context(cu_seqlens_global)              # same on every rank
        start, end = ctx.rank_ranges[ctx.rank]
        o = gdn_kcp(q[:, start:end], k[:, start:end], v[:, start:end],
                    g[:, start:end], beta[:, start:end], ctx, use_qk_l2norm=True)
    """
    if not isinstance(ctx, KcpContext):
        raise TypeError(f"ctx must be a KcpContext (from build_kcp_context), got {type(ctx).__name__}")
    options = resolve_options(options, use_qk_l2norm)
    dims, _ = check_gdn_inputs(q, k, v, g, beta, scale=scale, initial_state=None, cu_seqlens=None)
    if dims.B != 1:
        raise ValueError(f"gdn_kcp takes one packed row per rank (B = 1), got B = {dims.B}")
    if dims.T != ctx.n_tokens:
        raise ValueError(
            f"q holds T = {dims.T} tokens but rank {ctx.rank} of the context holds "
            f"{ctx.n_tokens} (rank_ranges[{ctx.rank}] = {ctx.rank_ranges[ctx.rank]})"
        )
    if scale is None:
        scale = dims.K**-0.5
    T = dims.T
    o = _GdnKcp.apply(
        q.reshape(T, dims.H_qk, dims.K),
        k.reshape(T, dims.H_qk, dims.K),
        v.reshape(T, dims.HV, dims.V),
        g.reshape(T, dims.HV),
        beta.reshape(T, dims.HV),
        Boundary(ctx, options),
        float(scale),
    )
    return o.view(1, T, dims.HV, dims.V)
