"""The pure builders of a :class:`KcpContext` (no collective): the exact context
of one rank from host bounds (:func:`context_from_split`, which the byte-query
CLI also uses to ask about any rank of any split) and the capped context built
with torch ops at static shapes (:func:`capped_context`: no host read, so it
traces)."""

from __future__ import annotations

from dataclasses import replace

import torch

from gdn_kcp.context.kcp_context import KcpContext
from gdn_kcp.context.sms import check_sms
from gdn_kcp.context.split import chain_neighbours, rank_fragments, start_and_end_docs
from gdn_kcp.groups import digest
from gdn_kcp.kernels import CROSSING_IN, CROSSING_OUT, ChunkIndex
from gdn_kcp.kernels.chunk_index import CHUNK_SIZE, capped_index
from gdn_kcp.kernels.segments import MAX_SEGMENTS, capped_summary_rows, summary_row_counts
from gdn_kcp.validate import check_max_docs


def context_from_split(
    bounds: list[int],
    ranges: list[tuple[int, int]],
    rank: int,
    *,
    group: object = None,
    group_name: str = "",
    device: torch.device | str = "cpu",
    max_docs: int | None = None,
    n_sms: int = 1,
) -> KcpContext:
    """The context of ``rank`` for document bounds and checked rank ranges: a
    pure function (no collective), also used to ask byte queries about any rank
    of any split without a process group. ``max_docs``: a capped context
    (``bounds`` holds at most ``max_docs`` documents). ``n_sms``: the device's
    SM count the segment plan fills (default 1: the plan then keeps P = 1)."""
    check_sms(n_sms)
    R = len(ranges)
    if max_docs is not None:
        check_max_docs(max_docs, len(bounds) - 1, "bounds")
        padded = bounds + [bounds[-1]] * (max_docs + 1 - len(bounds))
        ctx = capped_context(torch.tensor(padded, dtype=torch.int64), ranges, rank, group=group,
                             group_name=group_name, device=device, n_sms=n_sms)
        mine = rank_fragments(padded, *ranges[rank], rank == R - 1)
        return replace(ctx, packing_digest=digest(bounds), doc_rows=start_and_end_docs(mine))
    every_rank = [rank_fragments(bounds, start, end, r == R - 1) for r, (start, end) in enumerate(ranges)]
    rank_n_in = tuple(int(any(f[3] & CROSSING_IN for f in frags)) for frags in every_rank)
    rank_n_out = tuple(int(any(f[3] & CROSSING_OUT for f in frags)) for frags in every_rank)
    rank_middle = tuple(
        int(len(frags) == 1 and frags[0][3] == CROSSING_IN | CROSSING_OUT) for frags in every_rank
    )
    chain_ranks: dict[int, list[int]] = {}
    for r, frags in enumerate(every_rank):
        for doc, _, _, flags in frags:
            if flags:
                chain_ranks.setdefault(doc, []).append(r)
    chains = tuple(tuple(chain_ranks[doc]) for doc in sorted(chain_ranks))
    rank_prev, rank_next = chain_neighbours(chains, R)

    mine = every_rank[rank]  # documents tile the stream, so their parts tile the range
    index = ChunkIndex.from_fragments(
        [0] + [f[2] for f in mine] if mine else [0],
        frag_doc=[f[0] for f in mine],
        frag_flags=[f[3] for f in mine],
    )
    return KcpContext(
        R=R, rank=rank, group=group, group_name=group_name, rank_ranges=tuple(ranges), n_docs=len(bounds) - 1,
        rank_n_in=rank_n_in, rank_n_out=rank_n_out, rank_middle=rank_middle,
        rank_prev=rank_prev, rank_next=rank_next, chains=chains,
        index=index, device_index=index.to(device), n_sms=n_sms,
        # max of a list led by 0, not max(..., default=0): torch 2.13's dynamo cannot trace the keyword
        plan_chunks=max([0, *(-(-(f[2] - f[1]) // CHUNK_SIZE) for frags in every_rank for f in frags)]),
        plan_frags=max(len(frags) for frags in every_rank),
        segment_rows=summary_row_counts(  # from the host fragments: no read of the tables (they may be fake)
            [-(-(f[2] - f[1]) // CHUNK_SIZE) for f in mine], [f[3] for f in mine], index.max_frag_chunks,
            exchanges=bool(chains),
        ),
        doc_rows=start_and_end_docs(mine),
        frag_tokens=tuple(f[2] - f[1] for f in mine),
    )


def capped_context(
    cu_seqlens: torch.Tensor,
    ranges: list[tuple[int, int]],
    rank: int,
    *,
    group: object = None,
    group_name: str = "",
    device: torch.device | str | None = None,
    n_sms: int = 1,
) -> KcpContext:
    """The capped context of ``rank`` for a stream of ``N = len(cu_seqlens) - 1``
    documents (``max_docs = N``): no host read of ``cu_seqlens`` (torch ops at
    static shapes, traceable; the caller checks its values). The index is built
    on ``cu_seqlens``'s device and copied to ``device`` when that differs."""
    R = len(ranges)
    filled = [r for r, (start, end) in enumerate(ranges) if end > start]
    chains = (tuple(filled),) if len(filled) > 1 else ()
    rank_prev, rank_next = chain_neighbours(chains, R)
    rank_n_in = tuple(int(p >= 0) for p in rank_prev)
    rank_n_out = tuple(int(n >= 0) for n in rank_next)
    rank_middle = tuple(a & b for a, b in zip(rank_n_in, rank_n_out))
    start, end = ranges[rank]
    index = capped_index(cu_seqlens, start, end, last_rank=rank == R - 1)
    n_docs = index.n_frag  # a capped index has a fragment row per document
    return KcpContext(
        R=R, rank=rank, group=group, group_name=group_name, rank_ranges=tuple(ranges),
        n_docs=n_docs, rank_n_in=rank_n_in, rank_n_out=rank_n_out, rank_middle=rank_middle,
        rank_prev=rank_prev, rank_next=rank_next, chains=chains, index=index,
        device_index=index if device is None else index.to(device), max_docs=n_docs, n_sms=n_sms,
        plan_chunks=max(-(-(end - start) // CHUNK_SIZE) for start, end in ranges), plan_frags=n_docs,
        segment_rows=tuple(capped_summary_rows(P, exchanges=bool(chains)) for P in range(1, MAX_SEGMENTS + 1)),
    )
