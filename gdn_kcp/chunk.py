"""Single-rank GDN: :func:`chunk_gated_delta_rule`, FLA-compatible."""

from __future__ import annotations

import torch

from gdn_kcp.host import host_backward, host_forward
from gdn_kcp.kernels import ChunkIndex
from gdn_kcp.validate import check_flag, check_gdn_inputs


class _ChunkGatedDeltaRule(torch.autograd.Function):
    """Autograd over the explicit backward programs (no autograd through the
    forward). Saves the inputs only: the backward recomputes prep and the tape
    walk (the light save mode)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, index, scale, use_qk_l2norm, output_final_state):
        o, final_state, _, _ = host_forward(
            q, k, v, g, beta, index,
            scale=scale, use_qk_l2norm=use_qk_l2norm, initial_state=initial_state,
            n_final_states=index.n_frag if output_final_state else None,
        )
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.index, ctx.scale, ctx.use_qk_l2norm = index, scale, use_qk_l2norm
        return o, final_state

    @staticmethod
    def backward(ctx, do, d_final_state):
        q, k, v, g, beta, initial_state = ctx.saved_tensors
        index = ctx.index
        grads = host_backward(
            q, k, v, g, beta, index, do.contiguous(),
            scale=ctx.scale, use_qk_l2norm=ctx.use_qk_l2norm, initial_state=initial_state,
            d_final_state=d_final_state, n_initial_states=index.n_frag if initial_state is not None else None,
        )
        d_initial_state = None
        if initial_state is not None and ctx.needs_input_grad[5]:
            d_initial_state = grads.d_initial_state.to(initial_state.dtype)
        return grads.dq, grads.dk, grads.dv, grads.dg, grads.dbeta, d_initial_state, None, None, None, None


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet on one rank, chunked (C = 64), with an explicit backward.

    Args:
        q, k: ``[B, T, H_qk, K]``.
        v: ``[B, T, HV, V]``, ``HV % H_qk == 0`` (value head i reads key head
            ``i // (HV // H_qk)``).
        g: ``[B, T, HV]``, log decay (``<= 0``). beta: ``[B, T, HV]``.
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]``, one per document.
        output_final_state: also return the final states ``[N, HV, K, V]``.
        use_qk_l2norm_in_kernel: L2-normalise q and k per token and head.
        cu_seqlens: ``[N + 1]`` int32/int64 document bounds of a packed batch
            (B = 1); without it the B rows are N = B documents.

    Returns ``(o, final_state)``: o ``[B, T, HV, V]`` in q's dtype; final_state
    fp32 (fp64 for fp64 inputs) or None. Computation is in fp32 (fp64 for fp64
    inputs). Reads ``cu_seqlens`` on the host once per call, like FLA.

    Example::

        q = torch.randn(1, 100, 2, 64); k = torch.randn(1, 100, 2, 64)
        v = torch.randn(1, 100, 4, 64)
        g = -torch.rand(1, 100, 4); beta = torch.rand(1, 100, 4)
        o, s = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True,
                                      cu_seqlens=torch.tensor([0, 30, 100]))
    """
    dims, bounds = check_gdn_inputs(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu_seqlens
    )
    check_flag("output_final_state", output_final_state)
    check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    if scale is None:
        scale = dims.K**-0.5
    index = ChunkIndex.from_fragments(bounds, device=q.device)
    BT = dims.B * dims.T
    o, final_state = _ChunkGatedDeltaRule.apply(
        q.reshape(BT, dims.H_qk, dims.K),
        k.reshape(BT, dims.H_qk, dims.K),
        v.reshape(BT, dims.HV, dims.V),
        g.reshape(BT, dims.HV),
        beta.reshape(BT, dims.HV),
        initial_state,
        index,
        float(scale),
        use_qk_l2norm_in_kernel,
        output_final_state,
    )
    return o.view(dims.B, dims.T, dims.HV, dims.V), final_state
