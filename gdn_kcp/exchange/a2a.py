"""exchange="a2a": owner-sliced all-to-all of summaries (c1/c2) and adjoints (b1/b2).

Value heads are cut into R owner slices of ``s_owner = ceil(HV / R)`` heads (the
last padded with zeros). In c1 each crossing-out rank sends owner o heads
``[o s_owner, (o + 1) s_owner)`` of ``[S_loc | M]``; owner o composes, for its
heads, every crossing chain in rank order and in c2 sends each crossing-in rank
its slice of ``S_in``. b1/b2 run the same way backwards with
``lambda_start = M^T lambda_end + nu``. Every split size comes from
:func:`gdn_kcp.queries.a2a_split_elements`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gdn_kcp.context import KcpContext
from gdn_kcp.queries.comm import a2a_split_elements

from .counting import count


def _all_to_all(ctx: KcpContext, name: str, send: torch.Tensor, sends: list[int], recvs: list[int]) -> torch.Tensor:
    recv = send.new_empty(sum(recvs))
    dist.all_to_all_single(recv, send, output_split_sizes=recvs, input_split_sizes=sends, group=ctx.group)
    count(name, [send], [recv])
    return recv


def _pack_heads(
    ctx: KcpContext, parts: list[torch.Tensor | None], HV: int, numel: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``[1, HV, K, *]`` parts side by side on the last dim, padded to ``s_pad``
    heads with zeros, flat (``numel`` elements; 0 when this rank sends nothing)."""
    flat = torch.zeros(numel, dtype=dtype, device=device)
    if numel:
        width = sum(p.shape[-1] for p in parts)
        padded = flat.view(ctx.padded_heads(HV), parts[0].shape[2], width)
        torch.cat([p[0] for p in parts], dim=-1, out=padded[:HV])
    return flat


def _unpack_heads(ctx: KcpContext, recv: torch.Tensor, HV: int, K: int) -> torch.Tensor:
    """A slice per owner, ``[s_pad, K, V]`` flat -> ``[1, HV, K, V]``."""
    return recv.view(ctx.padded_heads(HV), K, -1)[None, :HV]


def _blocks(recv: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(torch.split(recv, sizes))


def forward_a2a(
    ctx: KcpContext,
    s_loc: torch.Tensor | None,
    m: torch.Tensor | None,
    HV: int,
    K: int,
    V: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor | None, dict[int, torch.Tensor]]:
    """c1 and c2. s_loc ``[1, HV, K, V]`` (None without a crossing-out fragment),
    m ``[1, HV, K, K]`` on a middle rank. Returns this rank's ``S_in``
    ``[1, HV, K, V]`` (None without a crossing-in fragment) and the M slices
    this rank received as an owner (``{rank: [s_owner, K, K]}``)."""
    s_owner = ctx.owner_heads(HV)
    sends, recvs = a2a_split_elements(ctx, "c1", HV, K, V)
    send = _pack_heads(ctx, [s_loc] + ([m] if m is not None else []), HV, sum(sends), dtype, device)
    recv = _all_to_all(ctx, "c1", send, sends, recvs)
    carry, s_in_of, m_of = None, {}, {}
    for r, block in enumerate(_blocks(recv, recvs)):
        if ctx.rank_n_in[r]:
            s_in_of[r] = carry
        if ctx.rank_n_out[r]:
            summary = block.view(s_owner, K, -1)
            if ctx.rank_middle[r]:
                m_of[r] = summary[..., V:]
                carry = m_of[r] @ carry + summary[..., :V]
            else:
                carry = summary[..., :V]
    sends, recvs = a2a_split_elements(ctx, "c2", HV, K, V)
    send = torch.cat([s_in_of[r].reshape(-1) for r in range(ctx.R) if ctx.rank_n_in[r]] or [recv[:0]])
    recv = _all_to_all(ctx, "c2", send, sends, recvs)
    return (_unpack_heads(ctx, recv, HV, K) if ctx.n_in else None), m_of


def backward_a2a(
    ctx: KcpContext,
    nu: torch.Tensor | None,
    m: torch.Tensor | None,
    HV: int,
    K: int,
    V: int,
    *,
    dtype: torch.dtype,
    device: torch.device,
    kept_m: dict[int, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """b1 and b2. nu ``[1, HV, K, V]`` (None without a crossing-in fragment); m
    ``[1, HV, K, K]`` on a middle rank, sent again unless the owners kept the
    c1 slices (``kept_m``, save_transfer). Returns ``lambda_end`` ``[1, HV, K, V]``
    of this rank's crossing-out fragment (None without one)."""
    s_owner = ctx.owner_heads(HV)
    save_transfer = kept_m is not None
    sends, recvs = a2a_split_elements(ctx, "b1", HV, K, V, save_transfer=save_transfer)
    parts = [nu] + ([m] if m is not None and not save_transfer else [])
    recv = _all_to_all(ctx, "b1", _pack_heads(ctx, parts, HV, sum(sends), dtype, device), sends, recvs)
    carry, lam_of = None, {}
    blocks = _blocks(recv, recvs)
    for r in reversed(range(ctx.R)):
        if ctx.rank_n_out[r]:
            lam_of[r] = carry
        if ctx.rank_n_in[r]:
            adjoint = blocks[r].view(s_owner, K, -1)
            carry = adjoint[..., :V]
            if ctx.rank_middle[r]:
                m_r = kept_m[r] if save_transfer else adjoint[..., V:]
                carry = m_r.mT @ lam_of[r] + carry
    sends, recvs = a2a_split_elements(ctx, "b2", HV, K, V)
    send = torch.cat([lam_of[r].reshape(-1) for r in range(ctx.R) if ctx.rank_n_out[r]] or [recv[:0]])
    recv = _all_to_all(ctx, "b2", send, sends, recvs)
    return _unpack_heads(ctx, recv, HV, K) if ctx.n_out else None
