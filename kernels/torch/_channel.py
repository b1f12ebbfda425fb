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

Pairs across sub-chunks are taken only where they exist (the rows after J
against J's rows, one product per anchor), and the pairs inside a sub-chunk
one offset ``d = i - j`` at a time, so no temporary holds the upper half of a
block. Exponentials per chunk and head: ``(c n (n - 1) / 2 + C + n c (c - 1) / 2) K``
with ``c = SUB_CHUNK``, ``n = C / c``: 640 K at C = 64, c = 16, against
``C^2 K`` = 4,096 K for the direct ``[C, C, K]`` tensor; and ``C (C + 1) K / 2``
multiply-adds, 1,536 K of them in the anchored products and
``n c (c + 1) K / 2`` = 544 K elementwise inside the sub-chunks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..precision import channel_mode, mm
from ..tracing import traced

PIECE_ELEMENTS = 1 << 20
"""The most elements (4 MiB in fp32) one piece's in-sub-chunk decays
(:attr:`ChannelBlocks.within`) may hold, or one chunk's where those are more:
the programs take the chunks in pieces of that size, so a piece's temporaries
stay in the caches. At T = 4096, HV = 4, K = 128 (``benchmarks/cpu_chunk.py``,
fp32, 2 threads) one KDA forward and backward took 0.72 s with pieces of 2^20
elements, 0.74 s with 2^22 (a tie on this shared machine) and 1.06 s with
2^18, in one run; before the pairs were cut to the causal half, with 8-row
sub-chunks, the whole at 2^25 took 2 to 3 times 2^22's time."""

TRACED_PIECE_ELEMENTS = 1 << 25
""":data:`PIECE_ELEMENTS` while a compiler traces the programs, and on a
device other than the CPU: a traced graph holds each piece's ops once (about
300 nodes for the scores, 600 for the pulls), and a GPU launches each of them
once per piece (the GPU check's programs stage runs these twins at T = 4096,
HV = 32, K = 128: a piece a chunk at 2^20), so both take fewer, larger pieces,
as many as the pairs' pieces before they were cut to the causal half."""

SUB_CHUNK = 16
"""Rows of a sub-chunk, as the Triton programs' (``tl.dot``'s least M and N).
The pairs across sub-chunks run as tf32 products under bf16 / fp16 inputs
(:func:`~gdn_kcp.kernels.precision.channel_mode`), those inside one exactly in
fp32: 16 rows take 480 of a chunk's 2,016 strict pairs exactly where 8 take
224, and fp16 dg on FLA's B2 T500 case erred 0.54e-3 at 16 against 0.68e-3 at
8 (FLA's kernels: 0.59e-3; tests/precision_grid.py --kda)."""


def causal_mask(C: int, strict: bool, device: torch.device) -> torch.Tensor:
    """``[C, C]``: ``i >= j`` (``i > j`` when strict)."""
    return torch.ones(C, C, dtype=torch.bool, device=device).tril(-1 if strict else 0)


class ChannelBlocks(NamedTuple):
    """The decays of :mod:`_channel` for per-channel gates ``g`` ``[NC, H, C, K]``."""

    ahead: tuple[torch.Tensor, ...]  # J < n - 1: [NC, H, C - (J + 1) c, K]: exp(sum_{r_J < l <= i} g_l), rows i after J
    behind: torch.Tensor  # [NC, H, C, K]: exp(sum_{j < l <= r_J(j)} g_l), from row j to its sub-chunk's end
    within: tuple[torch.Tensor, ...]  # d = 1 .. c - 1: [NC, H, n, c - d, K]: exp(sum_{r < l <= r + d} g_l)


def channel_blocks(g: torch.Tensor) -> ChannelBlocks:
    """The anchored decays of per-channel gates ``g`` ``[..., C, K]`` (padded rows 0).

    Every exponent is a running sum of exactly the gates it spans:
    ``ahead[J]`` sums the rows after J's anchor up to row i (forward),
    ``behind`` a row's successors up to its anchor (backward), ``within[d - 1]`` the
    ``d`` gates after row r of a sub-chunk (pair ``(r + d, r)``), each the
    previous offset's sum plus one gate. None is positive, so each factor is
    at most 1 and a ``-inf`` gives 0, never ``0 * inf`` or ``-inf - -inf``."""
    C, c = g.shape[-2], SUB_CHUNK
    n = C // c
    ahead = tuple(torch.exp(g[..., (J + 1) * c:, :].cumsum(-2)) for J in range(n - 1))
    gs = g.unflatten(-2, (n, c))  # [..., n, c, K]
    tail = torch.nn.functional.pad(gs[..., 1:, :].flip(-2).cumsum(-2).flip(-2), (0, 0, 0, 1))
    within, segment = [], None
    for d in range(1, c):
        segment = gs[..., d:, :] if segment is None else segment[..., :-1, :] + gs[..., d:, :]
        within.append(torch.exp(segment))
    return ChannelBlocks(ahead, torch.exp(tail).flatten(-3, -2), tuple(within))


def _sub(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., C, D]`` -> ``[..., n, c, D]``."""
    return x.unflatten(-2, (x.shape[-2] // SUB_CHUNK, SUB_CHUNK))


def _diagonal_blocks(x: torch.Tensor) -> torch.Tensor:
    """The ``[..., n, c, c]`` diagonal blocks of ``[..., C, C]`` (a view)."""
    n = x.shape[-1] // SUB_CHUNK
    blocks = x.unflatten(-1, (n, SUB_CHUNK)).unflatten(-3, (n, SUB_CHUNK))  # [..., n, c, n, c]
    return blocks.diagonal(dim1=-4, dim2=-2).movedim(-1, -3)


def _batch(blocks: ChannelBlocks, *xs: torch.Tensor) -> torch.Size:
    """The batch dims of a result: those of the operands and the decays, broadcast."""
    return torch.broadcast_shapes(blocks.behind.shape[:-2], *(x.shape[:-2] for x in xs))


def _dtype(blocks: ChannelBlocks, *xs: torch.Tensor) -> torch.dtype:
    """The dtype of a result: the operands' and the decays', promoted."""
    dtype = blocks.behind.dtype
    for x in xs:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _across(J: int, C: int) -> tuple[slice, slice]:
    """The rows after sub-chunk J and J's own rows: the pairs anchored at ``r_J``."""
    return slice((J + 1) * SUB_CHUNK, C), slice(J * SUB_CHUNK, (J + 1) * SUB_CHUNK)


def _scores(a: torch.Tensor, b: torch.Tensor, blocks: ChannelBlocks, keep: torch.Tensor, mode: str) -> torch.Tensor:
    """``S_ij = sum_d a_id b_jd exp(Γ_id - Γ_jd)`` on ``keep`` (a causal ``[C, C]``
    mask), zero elsewhere: ``[..., C, C]`` from a, b ``[..., C, K]``. Across
    sub-chunks one product under ``mode`` per anchor, written only where
    ``i`` lies in a later sub-chunk than ``j`` (a non-finite row of b reaches
    no other pair)."""
    C = a.shape[-2]
    scores = a.new_zeros(_batch(blocks, a, b) + (C, C), dtype=_dtype(blocks, a, b))
    b_behind = b * blocks.behind
    for J, ahead in enumerate(blocks.ahead):
        rows, cols = _across(J, C)
        scores[..., rows, cols] = mm(a[..., rows, :] * ahead, b_behind[..., cols, :].mT, mode)
    a_sub, b_sub, diag = _sub(a), _sub(b), _diagonal_blocks(scores)
    diag.diagonal(dim1=-2, dim2=-1).copy_((a_sub * b_sub).sum(-1))
    for d, within in enumerate(blocks.within, 1):
        diag.diagonal(-d, dim1=-2, dim2=-1).copy_((a_sub[..., d:, :] * b_sub[..., :-d, :] * within).sum(-1))
    return torch.where(keep, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))


def _lower_apply(x: torch.Tensor, b: torch.Tensor, blocks: ChannelBlocks, mode: str) -> torch.Tensor:
    """``out_i = sum_j x_ij b_j * exp(Γ_i - Γ_j)`` (``[..., C, K]``) over the
    pairs ``j <= i`` of a ``[..., C, C]`` x (its entries above the diagonal
    are never read): the gradient of :func:`_scores` with respect to ``a``
    when x is the scores' gradient."""
    C = x.shape[-1]
    out = b.new_zeros(_batch(blocks, x, b) + (C, b.shape[-1]), dtype=_dtype(blocks, x, b))
    b_behind = b * blocks.behind
    for J, ahead in enumerate(blocks.ahead):
        rows, cols = _across(J, C)
        out[..., rows, :] += mm(x[..., rows, cols], b_behind[..., cols, :], mode) * ahead
    x_diag, b_sub, out_sub = _diagonal_blocks(x), _sub(b), _sub(out)
    out_sub += x_diag.diagonal(dim1=-2, dim2=-1)[..., None] * b_sub
    for d, within in enumerate(blocks.within, 1):
        out_sub[..., d:, :] += x_diag.diagonal(-d, dim1=-2, dim2=-1)[..., None] * b_sub[..., :-d, :] * within
    return out


def _upper_apply(x: torch.Tensor, a: torch.Tensor, blocks: ChannelBlocks, mode: str) -> torch.Tensor:
    """``out_j = sum_i x_ij a_i * exp(Γ_i - Γ_j)`` (``[..., C, K]``) over the
    pairs ``i >= j`` of a ``[..., C, C]`` x: the gradient of :func:`_scores`
    with respect to ``b``."""
    C = x.shape[-1]
    out = a.new_zeros(_batch(blocks, x, a) + (C, a.shape[-1]), dtype=_dtype(blocks, x, a))
    for J, ahead in enumerate(blocks.ahead):
        rows, cols = _across(J, C)
        out[..., cols, :] = mm(x[..., rows, cols].mT, a[..., rows, :] * ahead, mode) * blocks.behind[..., cols, :]
    x_diag, a_sub, out_sub = _diagonal_blocks(x), _sub(a), _sub(out)
    out_sub += x_diag.diagonal(dim1=-2, dim2=-1)[..., None] * a_sub
    for d, within in enumerate(blocks.within, 1):
        out_sub[..., :-d, :] += x_diag.diagonal(-d, dim1=-2, dim2=-1)[..., None] * a_sub[..., d:, :] * within
    return out


def _pieces(g: torch.Tensor) -> list[slice]:
    """Slices of dim 0 (chunks) of ``g`` ``[NC, H, C, K]`` whose in-sub-chunk decays fit ``PIECE_ELEMENTS``."""
    per_chunk = max(1, g[:1].numel() * (SUB_CHUNK - 1) // 2)  # within: n c (c - 1) / 2 of a chunk's C K
    large = traced() or g.device.type != "cpu"
    rows = max(1, (TRACED_PIECE_ELEMENTS if large else PIECE_ELEMENTS) // per_chunk)
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
