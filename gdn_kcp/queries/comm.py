"""What each collective of a KCP call sends and receives, per rank.

Payloads (elements, in the compute dtype: fp32, fp64 for fp64 inputs), with
``s_owner = ceil(HV / R)``, ``s_pad = R s_owner``, and per rank r its flags
``n_in_r``, ``n_out_r`` and ``mid_r`` (one fragment that crosses in and out):

exchange="a2a" (owner slices, ``all_to_all_single`` with split sizes)
    c1  rank r -> each owner: ``n_out_r s_owner K (V + mid_r K)``   (S_loc, and M on a middle rank)
    c2  owner -> rank r:      ``n_in_r  s_owner K V``              (S_in)
    b1  rank r -> each owner: ``n_in_r  s_owner K (V + mid_r K (1 - save_transfer))``  (nu, and M again)
    b2  owner -> rank r:      ``n_out_r s_owner K V``              (lambda_end)

exchange="ring" (point to point along each chain)
    c1  rank r sends ``n_out_r HV K V`` (its end state) and receives ``n_in_r HV K V``
    b1  rank r sends ``n_in_r HV K V`` (its start adjoint) and receives ``n_out_r HV K V``
    c2, b2  nothing

When no document crosses a rank boundary no collective runs and every figure is 0.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from gdn_kcp.context import KcpContext
from gdn_kcp.dtypes import compute_element_size
from gdn_kcp.options import OptionsKcp, save_plan

COLLECTIVES = ("c1", "c2", "b1", "b2")
_TO_OWNERS = {"c1": True, "b1": True, "c2": False, "b2": False}


def _payload(ctx: KcpContext, collective: str, r: int, HV: int, K: int, V: int, save_transfer: bool) -> int:
    s_owner = ctx.owner_heads(HV)
    mid = ctx.rank_middle[r]
    if collective == "c1":
        return ctx.rank_n_out[r] * s_owner * K * (V + mid * K)
    if collective == "c2":
        return ctx.rank_n_in[r] * s_owner * K * V
    if collective == "b1":
        return ctx.rank_n_in[r] * s_owner * K * (V + mid * K * (0 if save_transfer else 1))
    return ctx.rank_n_out[r] * s_owner * K * V  # b2


def a2a_split_elements(
    ctx: KcpContext, collective: str, HV: int, K: int, V: int, *, save_transfer: bool = False, rank: int | None = None
) -> tuple[list[int], list[int]]:
    """``(send, recv)`` element counts per peer of ``collective`` on ``rank``
    (default: this rank), as ``all_to_all_single`` takes them."""
    me = ctx.rank if rank is None else rank
    if not ctx.exchanges:
        return [0] * ctx.R, [0] * ctx.R
    every = [_payload(ctx, collective, r, HV, K, V, save_transfer) for r in range(ctx.R)]
    if _TO_OWNERS[collective]:
        return [every[me]] * ctx.R, every
    return every, [every[me]] * ctx.R


def ring_elements(ctx: KcpContext, collective: str, HV: int, K: int, V: int, *, rank: int | None = None) -> tuple[int, int]:
    """``(send, recv)`` elements of ``collective`` on ``rank`` with exchange="ring"."""
    me = ctx.rank if rank is None else rank
    state = HV * K * V
    if collective == "c1":
        return ctx.rank_n_out[me] * state, ctx.rank_n_in[me] * state
    if collective == "b1":
        return ctx.rank_n_in[me] * state, ctx.rank_n_out[me] * state
    return 0, 0


def conv_channels(H_qk: int, HV: int, K: int, V: int) -> int:
    """Channels of the layer's one short convolution over q, k and v."""
    return 2 * H_qk * K + HV * V


def halo_rounds(ranges: tuple[tuple[int, int], ...], rows: int) -> int:
    """Rounds of the halo exchange after which every rank holds the ``rows``
    tokens before its range: the longest run of earlier ranks it must reach
    back over to find them (0 on one rank)."""
    rounds = 0
    for r in range(1, len(ranges)):
        have, back = 0, 0
        while r - back > 0 and have < rows:
            back += 1
            start, end = ranges[r - back]
            have += end - start
        rounds = max(rounds, back)
    return rounds


def halo_comm_bytes(ctx: KcpContext, D: int, conv_size: int, dtype: torch.dtype,
                    rank: int | None = None) -> dict[str, dict[str, int]]:
    """Bytes ``rank`` sends and receives in the halo exchanges of one layer
    call over ``D`` channels of ``dtype``: ``"halo"`` (forward) and
    ``"halo_grad"`` (backward), as :func:`~gdn_kcp.record_comm_bytes` counts
    them. A function of the caps only: every round moves ``[conv_size - 1, D]``
    to the next rank, whatever the packing."""
    me = ctx.rank if rank is None else rank
    rows = conv_size - 1
    rounds = halo_rounds(ctx.rank_ranges, rows) if ctx.R > 1 and rows > 0 else 0
    tile = rows * D * dtype.itemsize
    has_next, has_prev = int(me + 1 < ctx.R), int(me > 0)
    return {
        "halo": {"send": rounds * has_next * tile, "recv": rounds * has_prev * tile},
        "halo_grad": {"send": rounds * has_prev * tile, "recv": rounds * has_next * tile},
    }


def gdn_comm_bytes_kcp(
    ctx: KcpContext,
    HV: int,
    K: int,
    V: int,
    *,
    dtype: torch.dtype = torch.float32,
    options: OptionsKcp | None = None,
    exchange: str | None = None,
    rank: int | None = None,
    H_qk: int | None = None,
) -> dict[str, dict[str, int]]:
    """Bytes ``rank`` (default: this rank) hands to torch.distributed per
    collective of one forward and backward: ``{"c1": {"send": .., "recv": ..},
    "c2": .., "b1": .., "b2": ..}``, and with ``options.with_conv`` the
    layer's ``"halo"`` and ``"halo_grad"`` (input dtype; they need ``H_qk``). ``send`` is the size of the tensors it
    sends (its own owner slice included under a2a), ``recv`` of those it
    receives; a backward that replays the boundary runs c1/c2 a second time
    and they count twice. ``dtype`` is the input dtype; ``exchange`` is a
    shortcut for ``options.exchange`` (giving both with different values is an
    error).

    Example: ``gdn_comm_bytes_kcp(ctx, 32, 128, 128)["c1"]["send"]``.
    """
    if exchange is not None:
        if options is not None and options.exchange != exchange:
            raise ValueError(f"exchange={exchange!r} disagrees with options.exchange={options.exchange!r}")
        options = replace(options or OptionsKcp(), exchange=exchange)
    options = options or OptionsKcp()
    size = compute_element_size(dtype)  # boundary states travel in the compute dtype
    out = {}
    for name in COLLECTIVES:
        if options.exchange == "ring":
            send, recv = ring_elements(ctx, name, HV, K, V, rank=rank)
        else:
            sends, recvs = a2a_split_elements(ctx, name, HV, K, V, save_transfer=options.save_transfer, rank=rank)
            send, recv = sum(sends), sum(recvs)
        runs = 2 if name in ("c1", "c2") and save_plan(options).replays_boundary else 1
        out[name] = {"send": runs * send * size, "recv": runs * recv * size}
    if options.with_conv:
        if isinstance(H_qk, bool) or not isinstance(H_qk, int) or H_qk < 1:
            raise ValueError(f"options.with_conv=True counts the halo of 2 H_qk K + HV V channels: pass H_qk "
                             f"(a positive int), got H_qk={H_qk!r}")
        out.update(halo_comm_bytes(ctx, conv_channels(H_qk, HV, K, V), options.conv_size, dtype, rank))
    return out


def gdn_det_comm_bytes_kcp(ctx: KcpContext, HV: int, K: int, V: int, **kwargs) -> dict[str, dict[str, int]]:
    """:func:`gdn_comm_bytes_kcp` of the deterministic twin (the same exchanges)."""
    options = replace(kwargs.pop("options", None) or OptionsKcp(), deterministic=True)
    return gdn_comm_bytes_kcp(ctx, HV, K, V, options=options, **kwargs)
