"""``gdn_kcp::all_to_all`` and ``gdn_kcp::send_recv``: the traced host path's
exchanges (the all-to-all and the ring's hops), ordered effects.

Under torch.compile with R > 1 every rank traces its own graph (its fragments
decide what it sends and uses), and the graph passes place a node by what
depends on it. Tried with functional collectives (``_c10d_functional``), that
broke the group: AOT autograd dropped, on the rank nothing crosses into, the
forward's c2 whose result it does not use, and moved its b1, whose send does
not depend on the backward's inputs, into the forward. An order token chained
through the collectives fixed that under aot_eager; under Inductor the ranks'
exchanges still stopped matching (cause not pinned down). Each time the group
hung. An op registered as an ordered effect is never dropped, merged,
recomputed or moved across the forward / backward split, and keeps its order
among the call's effects: the same exchanges, in the same order, in the same
graph, on every rank. The price: Inductor runs it as an extern call that
returns when the data has arrived. For ``schedule="overlap"`` the exchange
is split in two ordered effects, ``gdn_kcp::all_to_all_start`` (issues it,
returns a handle) and ``gdn_kcp::all_to_all_wait`` (waits, returns what
arrived).

Effects alone did not hold the order under Inductor (2 gloo ranks,
replayed boundary, ``schedule="overlap"``): the graph it got had the
replayed c2 of the first rank, whose result that rank does not use, after
b1 and b2's start, while the other rank ran them in order, and the group
failed ("Received data size doesn't match"); and the recomputed walk was
hoisted above b1, leaving start and wait adjacent. So order is also data:
every exchange of a call takes the previous one's result and the local
work done since (``after``), the overlapped work reads a table through
``gdn_kcp::all_to_all_issued`` (a copy that depends on the handle: after
the issue) and the wait takes that work's output (``after``: before the
wait). Without the local work, Inductor hoisted an exchange whose send
does not depend on it (a ring rank that only receives; b1 on a rank with
nothing to send) to the top of its graph (2 and 3 fake ranks): the rank
then waits for its peers before its own prep, and the receive buffer is
held through it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from gdn_kcp.context.from_meta import group_from_name

from .counting import count


def all_to_all_into(recv: Tensor, send: Tensor, sends: list[int], recvs: list[int], group, collective: str) -> None:
    """The all-to-all itself, eager or in the op's body: 1-D ``send`` split by
    ``sends`` to the group, 1-D ``recv`` filled split by ``recvs``, counted
    for :func:`~gdn_kcp.exchange.record_comm_bytes` as ``collective``."""
    dist.all_to_all_single(recv, send, output_split_sizes=recvs, input_split_sizes=sends, group=group)
    count(collective, [send], [recv])


def send_recv_into(send: Tensor | None, dst: int, into: Tensor | None, src: int, group, collective: str) -> None:
    """One hop itself, eager or in the op's body: ``send`` posted to group
    rank ``dst`` (None: nothing), ``into`` received from group rank ``src``
    (None: nothing), the send waited for last; each side counted as
    ``collective``."""
    work = None
    if send is not None:
        count(collective, [send], [])
        work = dist.isend(send, group=group, group_dst=dst)
    if into is not None:
        dist.recv(into, group=group, group_src=src)
        count(collective, [], [into])
    if work is not None:
        work.wait()


@torch.library.custom_op("gdn_kcp::all_to_all", mutates_args=())
def ordered_all_to_all(send: Tensor, sends: list[int], recvs: list[int], group_name: str, collective: str,
                       after: list[Tensor]) -> Tensor:
    """``send`` (1-D) split by ``sends`` to the ranks of ``group_name`` (empty:
    the default group, as a context built without a group); returns what
    arrives, 1-D, split by ``recvs``. ``collective`` names it to
    :func:`~gdn_kcp.exchange.record_comm_bytes` (the body runs in the compiled
    graph, so a traced exchange counts as an eager one). ``after``: what the
    call's previous exchange returned and the local work done since (read by
    no one here: this exchange runs after them)."""
    received = send.new_empty(sum(recvs))
    all_to_all_into(received, send, sends, recvs, group_from_name(group_name) if group_name else None, collective)
    return received


@ordered_all_to_all.register_fake
def _(send: Tensor, sends: list[int], recvs: list[int], group_name: str, collective: str,
      after: list[Tensor]) -> Tensor:
    return send.new_empty(sum(recvs))


_IN_FLIGHT: dict[int, tuple[dist.Work, Tensor]] = {}
"""Exchanges issued by ``all_to_all_start`` and not yet waited for, by the
address of their handle (alive until the wait, which takes it: no value is
read)."""


@torch.library.custom_op("gdn_kcp::all_to_all_start", mutates_args=())
def all_to_all_start(send: Tensor, sends: list[int], recvs: list[int], group_name: str, collective: str,
                     after: list[Tensor]) -> Tensor:
    """Issues :func:`ordered_all_to_all` without waiting (counted as issued);
    returns its handle (a one-element CPU tensor, known by its address) for
    ``all_to_all_wait``."""
    received = send.new_empty(sum(recvs))
    work = dist.all_to_all_single(received, send, output_split_sizes=recvs, input_split_sizes=sends,
                                  group=group_from_name(group_name) if group_name else None, async_op=True)
    count(collective, [send], [received])
    handle = torch.empty(1, dtype=torch.int64)
    _IN_FLIGHT[handle.data_ptr()] = (work, received)
    return handle


@all_to_all_start.register_fake
def _(send: Tensor, sends: list[int], recvs: list[int], group_name: str, collective: str,
      after: list[Tensor]) -> Tensor:
    return torch.empty(1, dtype=torch.int64)


@torch.library.custom_op("gdn_kcp::all_to_all_issued", mutates_args=())
def all_to_all_issued(handle: Tensor, x: Tensor) -> Tensor:
    """A copy of ``x`` (a small index table) that depends on ``handle``: work
    that reads it runs after the exchange was issued."""
    return x.clone()


@all_to_all_issued.register_fake
def _(handle: Tensor, x: Tensor) -> Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("gdn_kcp::all_to_all_wait", mutates_args=())
def all_to_all_wait(handle: Tensor, send: Tensor, recvs: list[int], after: Tensor) -> Tensor:
    """Waits for the exchange of ``handle`` and returns what arrived (1-D).
    ``send`` is the buffer it was issued from: taking it keeps the buffer
    alive, unchanged, until the exchange has read it. ``after``: output of
    the work the exchange overlaps (read by no one here: the wait runs after
    that work)."""
    work, received = _IN_FLIGHT.pop(handle.data_ptr())
    work.wait()
    return received


@all_to_all_wait.register_fake
def _(handle: Tensor, send: Tensor, recvs: list[int], after: Tensor) -> Tensor:
    return send.new_empty(sum(recvs))


@torch.library.custom_op("gdn_kcp::send_recv", mutates_args=())
def ordered_send_recv(send: Tensor | None, dst: int, recv_shape: list[int], src: int, dtype: torch.dtype,
                      device: torch.device, group_name: str, collective: str, after: list[Tensor]) -> Tensor:
    """The ring's hop (``exchange="ring"``): posts ``send`` to group rank
    ``dst`` (none when ``dst < 0``), receives a ``recv_shape`` tensor of
    ``dtype`` on ``device`` from group rank ``src`` (an empty one when
    ``src < 0``), waits for the send and returns what arrived. The send is
    posted before the receive waits, and receives wait only on one side of
    the chain, so a chain of hops cannot deadlock. ``collective``: its name to
    :func:`~gdn_kcp.exchange.record_comm_bytes`, as :func:`ordered_all_to_all`.
    ``after``: as for :func:`ordered_all_to_all`."""
    received = torch.empty(recv_shape if src >= 0 else [0], dtype=dtype, device=device)
    send_recv_into(send if dst >= 0 else None, dst, received if src >= 0 else None, src,
                   group_from_name(group_name) if group_name else None, collective)
    return received


@ordered_send_recv.register_fake
def _(send: Tensor | None, dst: int, recv_shape: list[int], src: int, dtype: torch.dtype, device: torch.device,
      group_name: str, collective: str, after: list[Tensor]) -> Tensor:
    return torch.empty(recv_shape if src >= 0 else [0], dtype=dtype, device=device)


def register_ordered(op) -> bool:
    """Register the custom op ``op`` as an ordered effect:
    ``CustomOpDef.register_effect`` (torch 2.13), else the older private
    registry; False when neither exists (then KCP keeps the opaque ops under
    :func:`gdn_kcp.trace_host_path`). The layer's halo exchange
    (:mod:`gdn_kcp.layers.halo`) registers its ops here too."""
    try:
        from torch._library.effects import EffectType

        op.register_effect(EffectType.ORDERED)
        return True
    except (ImportError, AttributeError):
        pass
    try:
        from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

        _register_effectful_op(op._opoverload, _EffectType.ORDERED)
        return True
    except (ImportError, AttributeError):
        return False


ORDERED = all([register_ordered(op) for op in (ordered_all_to_all, all_to_all_start, all_to_all_wait,
                                                 ordered_send_recv)])
"""Whether the exchange is an ordered effect in this torch (KCP traces only then)."""
