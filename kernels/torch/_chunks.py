"""Token layout <-> padded chunk layout, and the masks of the chunk form.

Programs keep every tape in token layout (``[T, H, D]``, no padding, so the
byte queries count exactly ``T`` rows); inside a program the rows of each chunk
are gathered into ``[NC, H, C, D]`` so that the chunk algebra is a batched
matmul. Padded rows are zero, except for gate cumsums, which hold the chunk's
last value (so ``exp(G[..., -1])`` is the chunk's total decay ``gamma_C``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..chunk_index import CHUNK_SIZE, ChunkIndex

L2NORM_EPS = 1e-6
"""``x / sqrt(sum(x^2) + eps)``: the same eps as FLA's l2norm, so results agree."""


class ChunkRows(NamedTuple):
    token: torch.Tensor  # [NC, C] int64, padded rows repeat the chunk's last token
    valid: torch.Tensor  # [NC, C] bool
    last: torch.Tensor  # [NC, C] bool, the chunk's last valid row


def chunk_rows(index: ChunkIndex) -> ChunkRows:
    offs = torch.arange(CHUNK_SIZE, device=index.chunk_start.device)[None, :]
    last = (index.chunk_len.long() - 1)[:, None]
    token = index.chunk_start.long()[:, None] + torch.minimum(offs, last)
    return ChunkRows(token, offs <= last, offs == last)


def to_chunks(x: torch.Tensor, rows: ChunkRows, dtype: torch.dtype) -> torch.Tensor:
    """``[T, H, D]`` -> ``[NC, H, C, D]`` in ``dtype``, padded rows zero."""
    xc = x[rows.token].to(dtype)
    xc = torch.where(rows.valid[:, :, None, None], xc, torch.zeros((), dtype=dtype, device=x.device))
    return xc.movedim(1, 2)


def gates_to_chunks(gcum: torch.Tensor, rows: ChunkRows, dtype: torch.dtype) -> torch.Tensor:
    """Gate cumsum ``[T, H]`` -> ``[NC, H, C]``, padded rows hold the last value."""
    return gcum[rows.token].to(dtype).movedim(1, 2)


def scalars_to_chunks(x: torch.Tensor, rows: ChunkRows, dtype: torch.dtype) -> torch.Tensor:
    """Per-token scalars ``[T, H]`` -> ``[NC, H, C]``, padded rows zero."""
    return to_chunks(x[..., None], rows, dtype)[..., 0]


def from_chunks(xc: torch.Tensor, rows: ChunkRows, out: torch.Tensor) -> None:
    """Write the valid rows of ``[NC, H, C, D]`` (or ``[NC, H, C]``) into ``out``."""
    if xc.dim() == 3:
        xc = xc[..., None]
        out = out[..., None]
    out[rows.token[rows.valid]] = xc.movedim(2, 1)[rows.valid].to(out.dtype)


def add_from_chunks(xc: torch.Tensor, rows: ChunkRows, out: torch.Tensor) -> None:
    """Add the valid rows of ``[NC, H, C, D]`` (or ``[NC, H, C]``) into ``out``."""
    if xc.dim() == 3:
        xc = xc[..., None]
        out = out[..., None]
    out[rows.token[rows.valid]] += xc.movedim(2, 1)[rows.valid].to(out.dtype)


def l2_rstd(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reciprocal L2 norm over the last dim, ``[T, H, D]`` -> ``[T, H]``."""
    return torch.rsqrt(x.to(dtype).square().sum(-1) + L2NORM_EPS)


def load_qk(
    x: torch.Tensor, rstd: torch.Tensor | None, rows: ChunkRows, dtype: torch.dtype, n_value_heads: int
) -> torch.Tensor:
    """q or k ``[T, H_qk, D]`` -> ``[NC, HV, C, D]``: normalised when ``rstd`` is
    given, key head ``i // (HV // H_qk)`` repeated for value head ``i``."""
    if rstd is not None:
        x = x.to(dtype) * rstd[..., None].to(dtype)
    xc = to_chunks(x, rows, dtype)
    return xc.repeat_interleave(n_value_heads // x.shape[1], dim=1)


def causal_decay(G: torch.Tensor, strict: bool = False) -> torch.Tensor:
    """``exp(G_i - G_j)`` on ``i >= j`` (``i > j`` when strict), zero above: ``[..., C, C]``."""
    C = G.shape[-1]
    keep = torch.ones(C, C, dtype=torch.bool, device=G.device).tril(-1 if strict else 0)
    diff = (G[..., :, None] - G[..., None, :]).masked_fill(~keep, float("-inf"))
    return torch.exp(diff)
