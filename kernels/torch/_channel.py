"""Per-channel decays inside a chunk: the intra-chunk products of KDA (docs/design.md, "KDA").

With a gate per key channel, a pair of rows ``j <= i`` of a chunk decays by
``exp(Γ_i - Γ_j)`` (``[K]``), so the chunk's scores are no longer a product
times a ``[C, C]`` matrix. Taken as ``e^{Γ_i} e^{-Γ_j}`` the second factor
overflows fp32 once a channel's decay passes 88 inside the chunk (a gate of
-1000, FLA's padding value, does it in one token). Here no exponent is ever
positive: the chunk is cut into sub-chunks of ``SUB_CHUNK`` rows, and a pair in
different sub-chunks (``J`` before ``I``) goes through the anchor ``r_J``, the
last row of ``J``, which lies between them:

    exp(Γ_i - Γ_j) = exp(Γ_i - Γ_r) exp(Γ_r - Γ_j)        (both exponents <= 0)

so the off-diagonal blocks are products of decayed operands (tensor-core
shaped), and the pairs inside one sub-chunk are taken elementwise. Every
exponent is a sum of exactly the gates it spans (never a difference of two
cumsums), so a gate of ``-inf`` (a hard reset of that channel) gives an exact
zero and never ``-inf - -inf``.

Cost per chunk and head: ``((C / SUB_CHUNK)^2 + 2 C + SUB_CHUNK C) K``
exponentials (704 K at C = 64, against ``C^2 K`` = 4,096 K for the direct
``[C, C, K]`` tensor) and the usual ``C^2 K`` multiply-adds.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..precision import channel_mode, mm

PIECE_ELEMENTS = 1 << 25
"""The most elements (128 MiB in fp32) the largest temporary of one piece may
hold, the ``[rows, H, n, c, c, K]`` pairs inside the sub-chunks: the programs
take the chunks in pieces of that size. Whole, FLA's T = 8192, HV = 96,
K = 128 case wanted 3 GiB for that one tensor."""

SUB_CHUNK = 8
"""Rows of a sub-chunk. The pairs inside one are taken elementwise (``C SUB_CHUNK K``
products and exponentials per chunk and head): at T = 4096, HV = 4, K = 128 one
KDA forward and backward took 4.1 s at 16 rows, 2.7 s at 8 and 3.6 s at 4
(the anchored products of 16 sub-chunks cost more than they save)."""


def causal_mask(C: int, strict: bool, device: torch.device) -> torch.Tensor:
    """``[C, C]``: ``i >= j`` (``i > j`` when strict)."""
    return torch.ones(C, C, dtype=torch.bool, device=device).tril(-1 if strict else 0)


class ChannelBlocks(NamedTuple):
    """The decays of :mod:`_channel` for per-channel gates ``g`` ``[NC, H, C, K]``."""

    ahead: torch.Tensor  # [NC, H, n, C, K]: exp(sum_{r_J < l <= i} g_l) (0 where i <= r_J)
    behind: torch.Tensor  # [NC, H, C, K]: exp(sum_{j < l <= r_J(j)} g_l), from row j to its sub-chunk's end
    within: torch.Tensor  # [NC, H, n, c, c, K]: exp(sum_{jj < l <= ii} g_l) on ii >= jj of a sub-chunk, else 0


def channel_blocks(g: torch.Tensor) -> ChannelBlocks:
    """The anchored decays of per-channel gates ``g`` ``[..., C, K]`` (padded rows 0).

    ``ahead`` is a product of two decays, each a sum of exactly the gates it
    spans: the whole sub-chunks strictly between J and row i's sub-chunk I
    (``[n, n, K]``, a few exponentials) and the rows of I up to i (``[C, K]``).
    Both are at most 1, so the product is exact and a ``-inf`` gives 0, never
    ``0 * inf``; rows i in J or before get 0 (no pair there)."""
    C, c = g.shape[-2], SUB_CHUNK
    n = C // c
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    gs = g.unflatten(-2, (n, c))  # [..., n, c, K]
    totals = gs.sum(-2)  # [..., n, K]: each sub-chunk's whole gate
    sub = torch.arange(n, device=g.device)
    strictly_between = (sub[:, None, None] < sub[None, None, :]) & (sub[None, None, :] < sub[None, :, None])
    between = torch.where(strictly_between[..., None], totals[..., None, None, :, :], zero).sum(-2)  # [..., J, I, K]
    later = (sub[:, None] < sub[None, :])[..., None, None]  # [J, I, 1, 1]: I after J
    ahead_blocks = torch.where(later, torch.exp(between)[..., None, :], zero) * torch.exp(gs.cumsum(-2))[..., None, :, :, :]
    ahead = ahead_blocks.flatten(-3, -2)  # [..., n (J), C, K]
    tail = torch.nn.functional.pad(gs[..., 1:, :].flip(-2).cumsum(-2).flip(-2), (0, 0, 0, 1))
    segment = torch.where(causal_mask(c, True, g.device)[..., None], gs[..., :, None, :], zero).cumsum(-3)
    within = torch.where(causal_mask(c, False, g.device)[..., None], torch.exp(segment), zero)
    return ChannelBlocks(ahead, torch.exp(tail).flatten(-3, -2), within)


def _sub(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., C, D]`` -> ``[..., n, c, D]``."""
    return x.unflatten(-2, (x.shape[-2] // SUB_CHUNK, SUB_CHUNK))


def _later_blocks(C: int, device: torch.device) -> torch.Tensor:
    """``[C, C]``: the pairs whose row i lies in a later sub-chunk than column j."""
    sub = torch.arange(C, device=device) // SUB_CHUNK
    return sub[:, None] > sub[None, :]


def _diagonal_blocks(x: torch.Tensor) -> torch.Tensor:
    """The ``[..., n, c, c]`` diagonal blocks of ``[..., C, C]``."""
    n = x.shape[-1] // SUB_CHUNK
    blocks = x.unflatten(-1, (n, SUB_CHUNK)).unflatten(-3, (n, SUB_CHUNK))  # [..., n, c, n, c]
    return blocks.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def _block_diagonal(blocks: torch.Tensor) -> torch.Tensor:
    """``[..., n, c, c]`` -> the ``[..., C, C]`` matrix with those diagonal blocks, zero off them."""
    n, c = blocks.shape[-3], blocks.shape[-1]
    out = blocks.new_zeros(*blocks.shape[:-3], n, c, n, c)
    out.diagonal(dim1=-4, dim2=-2).copy_(blocks.movedim(-3, -1))
    return out.flatten(-4, -3).flatten(-2, -1)


def _off_blocks(x: torch.Tensor) -> torch.Tensor:
    """``[..., C, C]`` -> ``[..., n, C, c]``: column block J of x as its own matrix."""
    return x.unflatten(-1, (x.shape[-1] // SUB_CHUNK, SUB_CHUNK)).movedim(-2, -3)


def _scores(a: torch.Tensor, b: torch.Tensor, blocks: ChannelBlocks, keep: torch.Tensor, mode: str) -> torch.Tensor:
    """``S_ij = sum_d a_id b_jd exp(Γ_id - Γ_jd)`` on ``keep`` (a causal ``[C, C]``
    mask), zero elsewhere: ``[..., C, C]`` from a, b ``[..., C, K]``. Off the
    diagonal blocks one product under ``mode`` per sub-chunk of columns."""
    off_mask = _later_blocks(a.shape[-2], a.device)
    b_behind = _sub(b * blocks.behind)
    off = mm(a[..., None, :, :] * blocks.ahead, b_behind.mT, mode).movedim(-3, -2).flatten(-2)
    diag = (_sub(a)[..., :, None, :] * _sub(b)[..., None, :, :] * blocks.within).sum(-1)
    scores = torch.where(off_mask, off, _block_diagonal(diag))
    return torch.where(keep, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))


def _lower_apply(x: torch.Tensor, b: torch.Tensor, blocks: ChannelBlocks, mode: str) -> torch.Tensor:
    """``out_i = sum_j x_ij b_j * exp(Γ_i - Γ_j)`` (``[..., C, K]``) for a lower
    ``[..., C, C]`` x (zero above its diagonal): the gradient of
    :func:`_scores` with respect to ``a`` when x is the scores' gradient."""
    off_mask = _later_blocks(x.shape[-1], x.device)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    part = mm(_off_blocks(torch.where(off_mask, x, zero)), _sub(b * blocks.behind), mode)  # [..., n, C, K]
    off = (part * blocks.ahead).sum(-3)
    diag = (_diagonal_blocks(x)[..., None] * _sub(b)[..., None, :, :] * blocks.within).sum(-2)
    return off + diag.flatten(-3, -2)


def _upper_apply(x: torch.Tensor, a: torch.Tensor, blocks: ChannelBlocks, mode: str) -> torch.Tensor:
    """``out_j = sum_i x_ij a_i * exp(Γ_i - Γ_j)`` (``[..., C, K]``) for a lower
    ``[..., C, C]`` x: the gradient of :func:`_scores` with respect to ``b``."""
    off_mask = _later_blocks(x.shape[-1], x.device)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    part = mm(_off_blocks(torch.where(off_mask, x, zero)).mT, a[..., None, :, :] * blocks.ahead, mode)  # [..., n, c, K]
    off = part.flatten(-3, -2) * blocks.behind
    diag = (_diagonal_blocks(x)[..., None] * _sub(a)[..., :, None, :] * blocks.within).sum(-3)
    return off + diag.flatten(-3, -2)


def _pieces(g: torch.Tensor) -> list[slice]:
    """Slices of dim 0 (chunks) of ``g`` ``[NC, H, C, K]`` whose sub-chunk pairs fit ``PIECE_ELEMENTS``."""
    per_chunk = max(1, g[:1].numel() * SUB_CHUNK)
    rows = max(1, PIECE_ELEMENTS // per_chunk)
    return [slice(start, start + rows) for start in range(0, max(g.shape[0], 1), rows)]  # an empty rank: one empty piece


def channel_scores(a: torch.Tensor, b: torch.Tensor, g: torch.Tensor, keep: torch.Tensor, mode: str) -> torch.Tensor:
    """``S_ij = sum_d a_id b_jd exp(G_id - G_jd)`` on ``keep`` (a causal ``[C, C]``
    mask), zero elsewhere: ``[NC, H, C, C]`` from a, b ``[NC, H, C, K]`` and the
    per-channel gates g ``[NC, H, C, K]`` (padded rows 0), a piece of chunks at a
    time; the products under :func:`~gdn_kcp.kernels.precision.channel_mode` of ``mode``.

    >>> g = -torch.rand(2, 1, 64, 4, dtype=torch.float64); a, b = torch.randn(2, 2, 1, 64, 4, dtype=torch.float64)
    >>> keep = torch.ones(64, 64, dtype=torch.bool).tril()
    >>> G = g.cumsum(-2); direct = torch.einsum("nhid,nhjd,nhijd->nhij", a, b, (G[..., :, None, :] - G[..., None, :, :]).exp())
    >>> bool(torch.allclose(channel_scores(a, b, g, keep, "ieee"), direct * keep))
    True
    """
    mode = channel_mode(mode)
    return torch.cat([_scores(a[p], b[p], channel_blocks(g[p]), keep, mode) for p in _pieces(g)])


def channel_pulls(x: torch.Tensor, left: torch.Tensor, right: torch.Tensor, g: torch.Tensor,
                  mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The two gradients of :func:`channel_scores` for its gradient ``x``
    ``[NC, H, C, C]`` (lower): ``sum_j x_ij left_j * exp(G_i - G_j)`` (the ``a``
    side, with ``left = b``) and ``sum_i x_ij right_i * exp(G_i - G_j)`` (the ``b``
    side, with ``right = a``), each ``[NC, H, C, K]``, one set of decays a piece;
    the products under :func:`~gdn_kcp.kernels.precision.channel_mode` of ``mode``."""
    lower, upper, mode = [], [], channel_mode(mode)
    for p in _pieces(g):
        blocks = channel_blocks(g[p])
        lower.append(_lower_apply(x[p], left[p], blocks, mode))
        upper.append(_upper_apply(x[p], right[p], blocks, mode))
    return torch.cat(lower), torch.cat(upper)
