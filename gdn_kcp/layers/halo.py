"""The short convolution's halo under KCP: the ``W - 1`` rows before a rank's
range that belong to its crossing-in document.

Each round, every rank sends its *tail* (the last ``W - 1`` rows of its halo
followed by its own rows, masked to what may continue into the next rank) to
the next rank and receives the previous rank's: ``gdn_kcp::halo_shift``, an
opaque op whose backward (``halo_shift_back``) returns the halo's gradient to
the rank it came from. One round suffices when the previous rank holds at
least ``W - 1`` tokens; :func:`halo_rounds` counts the rounds the rank ranges
need (a cap). A rank sends a fixed ``[W - 1, D]`` per round, zeros when
nothing crosses, so the traffic does not depend on the packing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from gdn_kcp.context import KcpContext, group_from_name
from gdn_kcp.exchange.counting import count
from gdn_kcp.exchange.ordered import register_ordered
from gdn_kcp.queries.comm import halo_comm_bytes, halo_rounds  # noqa: F401  (halo_comm_bytes: re-exported)
from gdn_kcp.kernels.chunk_index import CROSSING_IN, CROSSING_OUT, crosses, last_real_fragment

from .short_conv import short_conv


def _shift(x: Tensor, group_name: str, R: int, rank: int, step: int, name: str) -> Tensor:
    """Send ``x`` to ``rank + step`` and receive the same shape from ``rank - step``
    (zeros where that rank does not exist)."""
    out = torch.zeros_like(x)
    group, ops = group_from_name(group_name), []
    if 0 <= rank + step < R:
        ops.append(dist.P2POp(dist.isend, x.contiguous(), group=group, group_peer=rank + step))
        count(name, [x], [])
    if 0 <= rank - step < R:
        ops.append(dist.P2POp(dist.irecv, out, group=group, group_peer=rank - step))
        count(name, [], [out])
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return out


@torch.library.custom_op("gdn_kcp::halo_shift", mutates_args=(), device_types=("cpu", "cuda"))
def halo_shift(tail: Tensor, group_name: str, R: int, rank: int) -> Tensor:
    """Every rank's ``tail`` ``[W - 1, D]`` to the next rank: returns the previous
    rank's (zeros on rank 0)."""
    return _shift(tail, group_name, R, rank, 1, "halo")


@torch.library.custom_op("gdn_kcp::halo_shift_back", mutates_args=(), device_types=("cpu", "cuda"))
def halo_shift_back(d_halo: Tensor, group_name: str, R: int, rank: int) -> Tensor:
    """The backward of :func:`halo_shift`: each halo's gradient to the rank it came from."""
    return _shift(d_halo, group_name, R, rank, -1, "halo_grad")


@halo_shift.register_fake
def _(tail, group_name, R, rank):
    return torch.empty_like(tail)


@halo_shift_back.register_fake
def _(d_halo, group_name, R, rank):
    return torch.empty_like(d_halo)


def _shift_backward(ctx, grad):
    return halo_shift_back(grad.contiguous(), *ctx.args), None, None, None


def _shift_setup(ctx, inputs, output):
    ctx.args = inputs[1:]


halo_shift.register_autograd(_shift_backward, setup_context=_shift_setup)

# Ordered effects, as the GDN exchanges (gdn_kcp.exchange.ordered): each rank traces its own graph, and a
# shift that one rank's graph dropped, recomputed or moved across the forward / backward split would leave its
# peers waiting. An effect is kept, runs once, stays on its side of the split and keeps its place among the
# call's other effects (a token chains them, whatever data the graph around them has): under the traced host
# path every rank's layer runs its halo rounds before c1 and the gradients' rounds after b2.
register_ordered(halo_shift)
register_ordered(halo_shift_back)


def conv_halo(y: Tensor, ctx: KcpContext, rows: int) -> Tensor:
    """``[rows, D]``: the ``rows`` conv inputs before this rank's range ``y``
    ``[T_r, D]`` that lie in its crossing-in document (zeros elsewhere).
    Differentiable; every rank of ``ctx.group`` must call it together, with a
    ``y`` that requires grad on every rank or on none (the backward exchanges
    run where it does)."""
    halo = y.new_zeros(rows, y.shape[1])
    if ctx.R == 1 or rows == 0:
        return halo
    if y.shape[0] == 0:  # an empty rank passes the halo on
        for _ in range(halo_rounds(ctx.rank_ranges, rows)):
            # cat with the empty y: the tail is in the autograd graph on every rank,
            # so every rank runs the backward's exchanges too
            halo = halo_shift(torch.cat([halo, y])[-rows:], ctx.group_name, ctx.R, ctx.rank)
        return halo
    index = ctx.index_for(y.device)
    flags, starts = index.frag_flags.long(), index.frag_start.long()
    last = last_real_fragment(flags)
    crosses_out = crosses(flags[last], CROSSING_OUT)
    middle = crosses_out & crosses(flags[last], CROSSING_IN)  # the halo's document goes on past this rank
    # own rows that may continue into the next rank: those of the crossing-out fragment
    tokens = torch.arange(y.shape[0], device=y.device)
    outgoing = (crosses_out & (tokens >= starts[last])).to(y.dtype)[:, None]
    for _ in range(halo_rounds(ctx.rank_ranges, rows)):
        tail = torch.cat([halo * middle.to(y.dtype), y * outgoing])[-rows:]
        halo = halo_shift(tail, ctx.group_name, ctx.R, ctx.rank)
    return halo * crosses(flags[:1], CROSSING_IN).to(y.dtype)


def short_conv_kcp(x: Tensor, weight: Tensor | list[Tensor], bias: Tensor | list[Tensor] | None,
                   ctx: KcpContext) -> Tensor:
    """:func:`~gdn_kcp.layers.short_conv.short_conv` of this rank's rows ``x``
    ``[1, T_r, D]`` of the packed stream of ``ctx``: restarted at each
    document start of the rank, reading the previous ranks' last ``W - 1``
    rows of a crossing-in document (:func:`conv_halo`, one exchange of
    ``[W - 1, D]`` per round; none on one rank). ``weight`` and ``bias`` as
    :func:`short_conv` takes them. Every rank of ``ctx.group`` calls it
    together."""
    W = (weight[0] if isinstance(weight, (list, tuple)) else weight).shape[-1]
    halo = conv_halo(x[0], ctx, W - 1) if ctx.R > 1 else None
    return short_conv(x, weight, bias, ctx.index_for(x.device).frag_start, halo)
