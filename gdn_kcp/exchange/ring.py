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

from gdn_kcp.context import KcpContext
from gdn_kcp.options import OptionsKcp

from .a2a import keep_own_m
from .ordered import ordered_send_recv, send_recv_into


def _hop(ctx: KcpContext, buffers, name: str, send: torch.Tensor | None, dst: int | None,
         pool: str | None, src: int | None) -> torch.Tensor | None:
    """One hop of a chain: ``send`` to rank ``dst`` (None: nothing to send);
    returns buffer ``pool`` (``buffers.take``) filled from rank ``src`` (None:
    nothing to receive, returns None); the send is posted first and waited for
    last. Traced (torch.compile inside :func:`gdn_kcp.trace_host_path`): the
    ordered ``gdn_kcp::send_recv`` (:mod:`.ordered`), after the call's
    previous exchange and the local work since by data (``buffers.after``),
    whose output becomes the pool (``buffers.adopt``)."""
    if send is None and pool is None:
        return None
    if torch.compiler.is_compiling():
        spec = buffers.spec(pool) if pool is not None else None
        received = ordered_send_recv(send, -1 if send is None else dst, [] if spec is None else list(spec.shape),
                                     -1 if spec is None else src, send.dtype if spec is None else spec.dtype,
                                     buffers.device, ctx.group_name, name, buffers.after)
        buffers.exchanged(received)
        return None if pool is None else buffers.adopt(pool, received)
    into = None if pool is None else buffers.take(pool)
    send_recv_into(send, dst, into, src, ctx.group, name)
    return into


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
    starts = ctx.n_out and not mid  # the document starts here: S_end = S_loc
    s_in = _hop(ctx, buffers, "c1", summary if starts else None, ctx.rank_next[me], "s_in" if ctx.n_in else None,
                ctx.rank_prev[me])
    if mid:
        state_out = arena.bind("ring_send")
        torch.matmul(summary[..., V:], s_in, out=state_out)
        state_out.add_(summary[..., :V])
        _hop(ctx, buffers, "c1", state_out, ctx.rank_next[me], None, None)
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
    ends = ctx.n_in and not mid  # the document ends here: lambda_start = nu
    lam = _hop(ctx, buffers, "b1", nu if ends else None, ctx.rank_prev[me], "lam" if ctx.n_out else None,
               ctx.rank_next[me])
    if mid:
        adjoint_out = arena.bind("ring_send")
        torch.matmul(m[0].mT, lam[0], out=adjoint_out[0])
        adjoint_out.add_(nu)
        _hop(ctx, buffers, "b1", adjoint_out, ctx.rank_prev[me], None, None)
        arena.release("ring_send")
    if ctx.n_in:
        arena.release("nu")
    if replayed and mid:
        arena.release("summary")
    return lam
