"""exchange="ring": the boundary state (forward) and adjoint (backward) travel
point to point along each crossing chain.

A middle rank waits for its start state, folds it through its summary
(``S_end = M S_in + S_loc``) and passes it on; backwards it waits for its end
adjoint and passes ``M^T lambda_end + nu``. No M travels, but a document over n
ranks costs n - 1 sequential hops. Receives wait only on lower ranks (forward)
or only on higher ranks (backward), so the chain cannot deadlock. Every buffer
is a pool of the call's arena (or a saved tensor) sized by the byte queries.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gdn_kcp.context import KcpContext
from gdn_kcp.options import OptionsKcp

from .a2a import keep_own_m
from .counting import count


def _isend(ctx: KcpContext, name: str, tensor: torch.Tensor, peer: int):
    count(name, [tensor], [])
    return dist.isend(tensor, group=ctx.group, group_dst=peer)


def _recv(ctx: KcpContext, name: str, into: torch.Tensor, peer: int) -> None:
    dist.recv(into, group=ctx.group, group_src=peer)
    count(name, [], [into])


def forward_ring(ctx: KcpContext, buffers, summary, *, phase_call: str, HV: int, K: int, V: int,
                 options: OptionsKcp):
    """c1 along the chains. ``summary`` ``[1, HV, K, V + mid K]`` as for
    :func:`forward_a2a`. Returns ``(s_in, summary, None)``: ``s_in``
    ``[1, HV, K, V]`` (None without a crossing-in fragment) and the summary if
    it stays bound for b1."""
    arena, me = buffers.arena, ctx.rank
    mid = ctx.rank_middle[me]
    arena.phase(f"{phase_call}.phase.c1")
    keep_own_m(buffers, summary, mid, V)
    pending = []
    if ctx.n_out and not mid:  # the document starts here: S_end = S_loc
        pending.append(_isend(ctx, "c1", summary, ctx.rank_next[me]))
    s_in = None
    if ctx.n_in:
        s_in = buffers.take("s_in")
        _recv(ctx, "c1", s_in, ctx.rank_prev[me])
    if mid:
        state_out = arena.bind("ring_send")
        torch.matmul(summary[..., V:], s_in, out=state_out)
        state_out.add_(summary[..., :V])
        pending.append(_isend(ctx, "c1", state_out, ctx.rank_next[me]))
    for work in pending:
        work.wait()
    if mid:
        arena.release("ring_send")
    if ctx.n_out and not (phase_call == "bwd" and mid):
        arena.release("summary")
        summary = None
    return s_in, summary, None


def backward_ring(ctx: KcpContext, buffers, nu, *, m, kept_m, replayed: bool, HV: int, K: int, V: int,
                  options: OptionsKcp) -> torch.Tensor | None:
    """b1 along the chains backwards, after ``nu`` ``[1, HV, K, V]`` is in its
    pool; ``m`` is this middle rank's M. Returns ``lambda_end`` ``[1, HV, K, V]``
    (None without a crossing-out fragment)."""
    arena, me = buffers.arena, ctx.rank
    mid = ctx.rank_middle[me]
    arena.phase("bwd.phase.b1")
    pending = []
    if ctx.n_in and not mid:  # the document ends here: lambda_start = nu
        pending.append(_isend(ctx, "b1", nu, ctx.rank_prev[me]))
    lam = None
    if ctx.n_out:
        lam = arena.bind("lam")
        _recv(ctx, "b1", lam, ctx.rank_next[me])
    if mid:
        adjoint_out = arena.bind("ring_send")
        torch.matmul(m[0].mT, lam[0], out=adjoint_out[0])
        adjoint_out.add_(nu)
        pending.append(_isend(ctx, "b1", adjoint_out, ctx.rank_prev[me]))
    for work in pending:
        work.wait()
    if mid:
        arena.release("ring_send")
    if ctx.n_in:
        arena.release("nu")
    if replayed and mid:
        arena.release("summary")
    return lam
