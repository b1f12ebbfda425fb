"""Backward: sum q/k gradients over the value heads of each key head (GVA), then
through the in-kernel L2 norm: ``dx = rstd (dy - y <dy, y>)`` with ``y = x rstd``."""

from __future__ import annotations

import torch

from ..precision import accumulator_dtype


def _reduce_and_unnorm(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor | None, out: torch.Tensor) -> None:
    T, H_qk, D = x.shape
    dy = dy.to(accumulator_dtype(x.dtype)).view(T, H_qk, dy.shape[1] // H_qk, D).sum(2)
    if rstd is not None:
        r = rstd[..., None].to(dy.dtype)
        y = x.to(dy.dtype) * r
        dy = r * (dy - y * (dy * y).sum(-1, keepdim=True))
    out.copy_(dy)


def bwd_qk_norm(
    dq_heads: torch.Tensor,
    dk_heads: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    dq_out: torch.Tensor,
    dk_out: torch.Tensor,
) -> None:
    """dq_heads, dk_heads ``[T, HV, K]`` (gradients of the normalised, per value
    head q and k) -> dq_out, dk_out ``[T, H_qk, K]`` (gradients of the inputs)."""
    _reduce_and_unnorm(dq_heads, q, q_rstd, dq_out)
    _reduce_and_unnorm(dk_heads, k, k_rstd, dk_out)
