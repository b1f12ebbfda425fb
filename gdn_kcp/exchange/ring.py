"""exchange="ring": the boundary state (forward) and adjoint (backward) travel
point to point along each crossing chain.

A middle rank waits for its start state, folds it through its summary
(``S_end = M S_in + S_loc``) and passes it on; backwards it waits for its end
adjoint and passes ``M^T lambda_end + nu``. No M travels, but a document over n
ranks costs n - 1 sequential hops. Receives wait only on lower ranks (forward)
or only on higher ranks (backward), so the chain cannot deadlock. Sizes from
:func:`gdn_kcp.queries.ring_elements`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gdn_kcp.context import KcpContext
from gdn_kcp.queries.comm import ring_elements

from .counting import count


def _isend(ctx: KcpContext, name: str, tensor: torch.Tensor, peer: int):
    tensor = tensor.contiguous()
    count(name, [tensor], [])
    return tensor, dist.isend(tensor, group=ctx.group, group_dst=peer)


def _recv(ctx: KcpContext, name: str, numel: int, HV: int, K: int, dtype, device, peer: int) -> torch.Tensor:
    received = torch.empty(numel, dtype=dtype, device=device)
    dist.recv(received, group=ctx.group, group_src=peer)
    count(name, [], [received])
    return received.view(1, HV, K, -1)


def _wait(pending: list) -> None:
    for _, work in pending:
        work.wait()


def forward_ring(
    ctx: KcpContext,
    s_loc: torch.Tensor | None,
    m: torch.Tensor | None,
    HV: int,
    K: int,
    V: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """c1 along the chains: returns this rank's ``S_in`` ``[1, HV, K, V]`` (None
    without a crossing-in fragment). s_loc / m as for :func:`forward_a2a`."""
    me = ctx.rank
    _, recv_numel = ring_elements(ctx, "c1", HV, K, V)
    pending = []
    if ctx.n_out and not ctx.rank_middle[me]:  # the document starts here: S_end = S_loc
        pending.append(_isend(ctx, "c1", s_loc, ctx.rank_next[me]))
    s_in = _recv(ctx, "c1", recv_numel, HV, K, dtype, device, ctx.rank_prev[me]) if ctx.n_in else None
    if ctx.rank_middle[me]:
        pending.append(_isend(ctx, "c1", m @ s_in + s_loc, ctx.rank_next[me]))
    _wait(pending)
    return s_in


def backward_ring(
    ctx: KcpContext,
    nu: torch.Tensor | None,
    m: torch.Tensor | None,
    HV: int,
    K: int,
    V: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """b1 along the chains backwards: returns ``lambda_end`` ``[1, HV, K, V]`` of
    this rank's crossing-out fragment (None without one)."""
    me = ctx.rank
    _, recv_numel = ring_elements(ctx, "b1", HV, K, V)
    pending = []
    if ctx.n_in and not ctx.rank_middle[me]:  # the document ends here: lambda_start = nu
        pending.append(_isend(ctx, "b1", nu, ctx.rank_prev[me]))
    lam = _recv(ctx, "b1", recv_numel, HV, K, dtype, device, ctx.rank_next[me]) if ctx.n_out else None
    if ctx.rank_middle[me]:
        pending.append(_isend(ctx, "b1", m.mT @ lam + nu, ctx.rank_prev[me]))
    _wait(pending)
    return lam
