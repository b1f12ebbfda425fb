"""exchange="a2a": owner-sliced all-to-all of summaries (c1/c2) and adjoints (b1/b2).

Value heads are cut into R owner slices of ``s_owner = ceil(HV / R)`` heads (the
last padded with zeros). In c1 each crossing-out rank sends owner o heads
``[o s_owner, (o + 1) s_owner)`` of ``[S_loc | M]``; owner o composes, for its
heads, every crossing chain in rank order and in c2 sends each crossing-in rank
its slice of ``S_in``. b1/b2 run the same way backwards with
``lambda_start = M^T lambda_end + nu``. Every buffer is a pool of the call's
arena (or a saved tensor) sized by the byte queries; the owner composes in place
in its send pool, so nothing else is allocated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gdn_kcp.context import KcpContext
from gdn_kcp.options import OptionsKcp
from gdn_kcp.queries.comm import a2a_split_elements
from gdn_kcp.queries.shapes import numel

from .counting import count
from .ordered import all_to_all_into, all_to_all_issued, all_to_all_start, all_to_all_wait, ordered_all_to_all


def _all_to_all(ctx: KcpContext, name: str, pool: str, send: torch.Tensor, sends, recvs, buffers) -> torch.Tensor:
    """``send`` to the group; returns buffer ``pool`` (``buffers.take``) holding
    what arrived. Traced (torch.compile inside :func:`gdn_kcp.trace_host_path`):
    the ordered ``gdn_kcp::all_to_all`` (:mod:`.ordered`), after the call's
    previous exchange and the local work since by data (``buffers.after``),
    whose output becomes the pool (``buffers.adopt``): no second receive
    buffer."""
    if torch.compiler.is_compiling():
        received = ordered_all_to_all(send.reshape(-1), list(sends), list(recvs), ctx.group_name, name,
                                      buffers.after)
        buffers.exchanged(received)
        return buffers.adopt(pool, received)
    recv = buffers.take(pool)
    all_to_all_into(recv.view(-1), send.view(-1), list(sends), list(recvs), ctx.group, name)
    return recv


class InFlight:
    """An all-to-all issued and not yet waited for (``schedule="overlap"``):
    :meth:`finish` returns buffer ``pool`` holding what arrived, and ``send``
    must stay unchanged until then. Traced (torch.compile inside
    :func:`gdn_kcp.trace_host_path`), the ordered ops of :mod:`.ordered`,
    with the overlapped work fenced by data: it reads its index through
    :meth:`fenced` and :meth:`finish` takes its output; the wait's output
    becomes the pool, as in :func:`_all_to_all`."""

    def __init__(self, ctx: KcpContext, name: str, pool: str, send: torch.Tensor, sends, recvs, buffers,
                 on_finish=None) -> None:
        self.pool, self.send, self.recvs, self.on_finish = pool, send.reshape(-1), list(recvs), on_finish
        self.buffers, self.handle, self.work = buffers, None, None
        if torch.compiler.is_compiling():
            self.handle = all_to_all_start(self.send, list(sends), self.recvs, ctx.group_name, name,
                                           buffers.after)
        else:
            self.recv = buffers.take(pool)
            self.work = dist.all_to_all_single(self.recv.view(-1), self.send, output_split_sizes=self.recvs,
                                               input_split_sizes=sends, group=ctx.group, async_op=True)
            self.name = name

    def fenced(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` for the overlapped work to read (traced: a copy after the issue)."""
        return x if self.handle is None else all_to_all_issued(self.handle, x)

    def finish(self, after: torch.Tensor) -> torch.Tensor:
        """Wait (after the work whose output is ``after``), then ``on_finish``;
        returns what arrived."""
        if self.handle is not None:
            received = all_to_all_wait(self.handle, self.send, self.recvs, after)
            self.buffers.exchanged(received)
            recv = self.buffers.adopt(self.pool, received)
        else:
            self.work.wait()
            recv = self.recv
            count(self.name, [self.send], [recv])
        if self.on_finish is not None:
            self.on_finish()
        return recv


class Done:
    """An exchange already complete (``schedule="serial"``, the ring): what
    arrived (or None) is ``finish``'s result."""

    def __init__(self, received: torch.Tensor | None = None) -> None:
        self.received = received

    @staticmethod
    def fenced(x: torch.Tensor) -> torch.Tensor:
        return x

    def finish(self, after: torch.Tensor) -> torch.Tensor | None:
        return self.received


def _pack(ctx: KcpContext, buffers, pool: str, parts: list[torch.Tensor], HV: int, K: int) -> torch.Tensor:
    """Buffer ``pool`` (``buffers.take``) holding the ``[1, HV, K, *]``
    ``parts`` side by side as ``[s_pad, K, *]``, padded heads zero (no parts:
    as bound). Traced, the parts are joined into a new tensor that becomes the
    pool (``buffers.adopt``): under Inductor, writes into views of a pool
    cost a second copy of it."""
    spec = buffers.spec(pool)
    if torch.compiler.is_compiling() and parts and numel(spec.shape):
        pad = (0, 0, 0, 0, 0, ctx.padded_heads(HV) - HV)  # one pointwise cat of padded parts: one buffer
        return buffers.adopt(pool, torch.cat([F.pad(part[0], pad) for part in parts], dim=-1))
    send = buffers.take(pool)
    if not parts or send.numel() == 0:
        return send
    padded = send.view(ctx.padded_heads(HV), K, -1)
    column = 0
    for part in parts:
        padded[:HV, :, column : column + part.shape[-1]].copy_(part[0])
        column += part.shape[-1]
    padded[HV:].zero_()
    return send


def _slots(buffer: torch.Tensor, ranks: list[int], s_owner: int, K: int) -> dict[int, torch.Tensor]:
    """``buffer`` as one ``[s_owner, K, -1]`` slot per rank of ``ranks``, in order."""
    if not ranks:
        return {}
    return dict(zip(ranks, buffer.view(len(ranks), s_owner, K, -1).unbind(0)))


def _chained(buffers, pool: str, ranks: list[int], links, s_owner: int, K: int) -> torch.Tensor:
    """Buffer ``pool`` as one ``[s_owner, K, *]`` slot per rank of ``ranks``,
    filled by ``links`` in order: ``(t, m, r, s)`` sets slot t to
    ``m @ slot r + s`` (``m`` None: to ``s``). Eagerly in place in the pool;
    traced, the slots are new tensors stacked into the pool
    (``buffers.adopt``), as for :func:`_pack`."""
    traced = torch.compiler.is_compiling() and bool(ranks)
    out = None if traced else buffers.take(pool)
    slots = {} if traced else _slots(out, ranks, s_owner, K)
    for t, m, r, s in links:
        if traced:
            slots[t] = s if m is None else torch.matmul(m, slots[r]) + s
        elif m is None:
            slots[t].copy_(s)
        else:
            torch.matmul(m, slots[r], out=slots[t])
            slots[t].add_(s)
    return buffers.adopt(pool, torch.stack([slots[r] for r in ranks])) if traced else out


def _stacked(buffers, name: str, parts: list[torch.Tensor]) -> torch.Tensor:
    """Buffer ``name`` (a pool or a saved tensor) holding ``parts`` stacked
    (traced: the stack itself, ``buffers.adopt``)."""
    if torch.compiler.is_compiling() and parts:
        return buffers.adopt(name, torch.stack(parts))
    out = buffers.take(name)
    for i, part in enumerate(parts):
        out[i].copy_(part)
    return out


def _blocks(recv: torch.Tensor, sizes: list[int], s_owner: int, K: int) -> dict[int, torch.Tensor]:
    """The per-rank blocks of an owner's receive buffer, as ``[s_owner, K, -1]``."""
    out, offset = {}, 0
    for r, size in enumerate(sizes):
        if size:
            out[r] = recv.view(-1)[offset : offset + size].view(s_owner, K, -1)
        offset += size
    return out


def keep_own_m(buffers, summary: torch.Tensor | None, mid: int, V: int) -> None:
    """A kept boundary saves a middle rank's own M (``[mid, HV, K, K]``) for b1."""
    if buffers.keeps("m"):
        _stacked(buffers, "m", [summary[0, ..., V:]] if mid else [])


def forward_a2a(ctx: KcpContext, buffers, summary, *, phase_call: str, HV: int, K: int, V: int,
                options: OptionsKcp):
    """c1 and c2. ``summary`` ``[1, HV, K, V + mid K]`` is ``[S_loc | M]`` of the
    crossing-out fragment (None without one). Returns ``(s_in, summary,
    kept_m)``: ``s_in`` ``[n_in, s_pad, K, V]``, the summary if it stays bound
    for b1, and the owner's M slices if the backward keeps them."""
    arena, s_owner, mid = buffers.arena, ctx.owner_heads(HV), ctx.rank_middle[ctx.rank]
    keep_summary = phase_call == "bwd" and mid and not options.save_transfer
    arena.phase(f"{phase_call}.phase.c1")
    sends, recvs = a2a_split_elements(ctx, "c1", HV, K, V)
    send = _pack(ctx, buffers, "c1_send", [summary] if summary is not None else [], HV, K)
    keep_own_m(buffers, summary, mid, V)
    if summary is not None and not keep_summary:
        arena.release("summary")
        summary = None
    recv = _all_to_all(ctx, "c1", "c1_recv", send, sends, recvs, buffers)
    arena.release("c1_send")

    arena.phase(f"{phase_call}.phase.c2")
    sends, recvs = a2a_split_elements(ctx, "c2", HV, K, V)
    blocks = _blocks(recv, a2a_split_elements(ctx, "c1", HV, K, V)[1], s_owner, K)
    # every chain in rank order: S_in(next) = M_r S_in(r) + S_loc(r)
    links = [(ctx.rank_next[r], blocks[r][..., V:] if ctx.rank_middle[r] else None, r, blocks[r][..., :V])
             for r in range(ctx.R) if ctx.rank_n_out[r]]
    c2_send = _chained(buffers, "c2_send", [r for r in range(ctx.R) if ctx.rank_n_in[r]], links, s_owner, K)
    kept_m = None
    if options.save_transfer and (phase_call == "bwd" or buffers.keeps("owner_m")):
        kept_m = _stacked(buffers, "kept_m" if phase_call == "bwd" else "owner_m",
                          [blocks[r][..., V:] for r in range(ctx.R) if ctx.rank_middle[r]])
    arena.release("c1_recv")
    s_in = _all_to_all(ctx, "c2", "s_in", c2_send, sends, recvs, buffers)
    arena.release("c2_send")
    return s_in, summary, kept_m if phase_call == "bwd" else None


def backward_a2a(ctx: KcpContext, buffers, nu, *, m, kept_m, replayed: bool, HV: int, K: int, V: int,
                 options: OptionsKcp, overlap: bool = False):
    """b1 and b2, after ``nu`` ``[1, HV, K, V]`` (None without a crossing-in
    fragment) is in its pool. ``m`` is this middle rank's own M ``[1, HV, K, K]``
    (sent again unless save_transfer); ``kept_m`` the owner's M slices
    (save_transfer). Returns b2, whose ``finish(after)`` returns
    ``lambda_end`` ``[n_out, s_pad, K, V]``: with ``overlap`` b2 is only
    issued here (:class:`InFlight`; its finish releases b2's send pool), else
    it is :class:`Done`."""
    arena, s_owner = buffers.arena, ctx.owner_heads(HV)
    st = options.save_transfer
    arena.phase("bwd.phase.b1")
    sends, recvs = a2a_split_elements(ctx, "b1", HV, K, V, save_transfer=st)
    parts = [] if nu is None else [nu] + ([m] if ctx.rank_middle[ctx.rank] and not st else [])
    send = _pack(ctx, buffers, "b1_send", parts, HV, K)
    if nu is not None:
        arena.release("nu")
    if replayed and ctx.rank_middle[ctx.rank] and not st:
        arena.release("summary")
    recv = _all_to_all(ctx, "b1", "b1_recv", send, sends, recvs, buffers)
    arena.release("b1_send")

    arena.phase("bwd.phase.b2")
    sends, recvs_b2 = a2a_split_elements(ctx, "b2", HV, K, V)
    blocks = _blocks(recv, recvs, s_owner, K)
    middles = [r for r in range(ctx.R) if ctx.rank_middle[r]]

    def m_of(r: int) -> torch.Tensor:
        return kept_m[middles.index(r)] if st else blocks[r][..., V:]

    # lambda_end(prev) = M_r^T lambda_end(r) + nu_r
    links = [(ctx.rank_prev[r], m_of(r).mT if ctx.rank_middle[r] else None, r, blocks[r][..., :V])
             for r in reversed(range(ctx.R)) if ctx.rank_n_in[r]]
    b2_send = _chained(buffers, "b2_send", [r for r in range(ctx.R) if ctx.rank_n_out[r]], links, s_owner, K)
    arena.release("b1_recv")
    if st and replayed:
        arena.release("kept_m")
    if not overlap:
        lam = _all_to_all(ctx, "b2", "lam", b2_send, sends, recvs_b2, buffers)
        arena.release("b2_send")
        return Done(lam)
    return InFlight(ctx, "b2", "lam", b2_send, sends, recvs_b2, buffers, on_finish=lambda: arena.release("b2_send"))
