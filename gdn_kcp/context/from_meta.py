"""A context rebuilt inside an op from what the ops take: the ints of
:attr:`KcpContext.meta`, the two index tables and the group's name."""

from __future__ import annotations

import torch

from gdn_kcp.context.kcp_context import KcpContext
from gdn_kcp.kernels import ChunkIndex
from gdn_kcp.kernels.segments import MAX_SEGMENTS


def group_from_name(group_name: str):
    """The process group registered under ``group_name`` (what the ops take)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def context_from_meta(
    meta: list[int], chunk_table: torch.Tensor, frag_table: torch.Tensor, group_name: str
) -> KcpContext:
    """Rebuild a context from what the ops take (:attr:`KcpContext.meta`, the two
    index tables on the call's device, the group's name). No host sync: the
    tables are used as they are."""
    R, rank, n_tokens, n_chunks, n_frag, max_frag_chunks, n_docs, capped = meta[:8]
    flat = meta[8 : 8 + 2 * R]
    columns = [tuple(meta[8 + 2 * R + i * R : 8 + 2 * R + (i + 1) * R]) for i in range(5)]
    rank_n_in, rank_n_out, rank_middle, rank_prev, rank_next = columns
    n_sms, plan_chunks, plan_frags = meta[8 + 7 * R : 11 + 7 * R]
    segment_rows = tuple(meta[11 + 7 * R : 11 + 7 * R + MAX_SEGMENTS])
    chains: list[tuple[int, ...]] = []
    for r in range(R):
        if rank_n_out[r] and not rank_middle[r]:  # the document starts here
            chain = [r, rank_next[r]]
            while rank_middle[chain[-1]]:
                chain.append(rank_next[chain[-1]])
            chains.append(tuple(chain))
    index = ChunkIndex(chunk_table, frag_table, n_tokens, n_chunks, n_frag, max_frag_chunks)
    # empty: one rank, or byte queries only; traced code (torch.compile) reaches the group by its name
    group = group_from_name(group_name) if group_name and not torch.compiler.is_compiling() else None
    return KcpContext(
        R=R, rank=rank, group=group, group_name=group_name,
        rank_ranges=tuple((flat[2 * r], flat[2 * r + 1]) for r in range(R)), n_docs=n_docs,
        rank_n_in=rank_n_in, rank_n_out=rank_n_out, rank_middle=rank_middle, rank_prev=rank_prev,
        rank_next=rank_next, chains=tuple(chains), index=index, device_index=index,
        max_docs=n_docs if capped else None, n_sms=n_sms, plan_chunks=plan_chunks, plan_frags=plan_frags,
        segment_rows=segment_rows,
    )
