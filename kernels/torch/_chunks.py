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
from ..precision import mm
from ..tracing import traced
from ._channel import causal_mask, channel_scores

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


def scalars_to_chunks(x: torch.Tensor, rows: ChunkRows, dtype: torch.dtype) -> torch.Tensor:
    """Per-token scalars ``[T, H]`` -> ``[NC, H, C]``, padded rows zero."""
    return to_chunks(x[..., None], rows, dtype)[..., 0]


def chunk_beta(beta: torch.Tensor, rows: ChunkRows, dtype: torch.dtype, sigmoid: bool = False,
               scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(beta, d beta / d input)`` ``[NC, H, C]``: the input, or its sigmoid,
    times ``scale`` (padded rows 0)."""
    bc = scalars_to_chunks(beta, rows, dtype)
    if not sigmoid:
        return scale * bc, torch.full_like(bc, scale)
    s = torch.sigmoid(bc)
    zero = torch.zeros((), dtype=dtype, device=bc.device)
    return torch.where(rows.valid[:, None, :], scale * s, zero), scale * s * (1 - s)


def row_owners(at: torch.Tensor, keep: torch.Tensor, n: int) -> torch.Tensor:
    """``[n]``: for each row r of a target, the position i of the source with
    ``keep[i]`` and ``at[i] == r``, -1 where none (the kept ``at`` are
    distinct). A scatter of fixed shape (the kept source wins the max over the
    -1 the others offer), so traced code (``torch.compile``) meets no
    data-dependent size, as a boolean-mask write would be."""
    at, keep = at.flatten(), keep.flatten()
    offer = torch.where(keep, torch.arange(at.shape[0], device=at.device), -1)
    none = torch.full((n,), -1, dtype=torch.long, device=at.device)
    return none.scatter_reduce(0, at.long().clamp(0, max(n - 1, 0)), offer, "amax")


def put_rows(out: torch.Tensor, at: torch.Tensor, keep: torch.Tensor, src: torch.Tensor) -> None:
    """``out[at[keep]] = src[keep]`` (rows of dim 0; the kept ``at`` are
    distinct). Traced, in fixed shapes: each row of ``out`` takes its owner
    (:func:`row_owners`) or keeps its value, a pass over all of ``out``;
    eager, the masked write, which touches the kept rows only (the walks call
    it once per step)."""
    if not traced():
        out[at[keep]] = src[keep].to(out.dtype)
        return
    owner = row_owners(at, keep, out.shape[0])
    held = (owner >= 0).view(-1, *([1] * (out.dim() - 1)))
    out.copy_(torch.where(held, src[owner.clamp(min=0)].to(out.dtype), out))


def _token_rows(xc: torch.Tensor, rows: ChunkRows, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk row of every token of ``out`` (``[T, H, D]``) and where one exists."""
    xc = xc[..., None] if xc.dim() == 3 else xc
    source = row_owners(rows.token, rows.valid, out.shape[0])  # flat chunk * C + row
    src = xc.movedim(2, 1).reshape(-1, *xc.shape[1:2], *xc.shape[3:])[source.clamp(min=0)]
    return src.view(out.shape), (source >= 0).view(-1, *([1] * (out.dim() - 1)))


def from_chunks(xc: torch.Tensor, rows: ChunkRows, out: torch.Tensor) -> None:
    """Write the valid rows of ``[NC, H, C, D]`` (or ``[NC, H, C]``) into ``out``."""
    src, held = _token_rows(xc, rows, out)
    out.copy_(torch.where(held, src.to(out.dtype), out))


def add_from_chunks(xc: torch.Tensor, rows: ChunkRows, out: torch.Tensor) -> None:
    """Add the valid rows of ``[NC, H, C, D]`` (or ``[NC, H, C]``) into ``out``:
    the sum in ``xc``'s dtype, rounded once to ``out``'s (as the Triton programs)."""
    src, held = _token_rows(xc, rows, out)
    out.copy_(torch.where(held, (out.to(xc.dtype) + src).to(out.dtype), out))


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


class ChunkGates(NamedTuple):
    """Log decays of a chunk, each summed over exactly the gates it spans, so a
    hard reset (``g = -inf``) gives an exact zero decay and no ``-inf - -inf``,
    and a strong gate (``g = -1e4``) never cancels against a later one in fp32.
    A gate per value head (GDN) has the shapes below; a gate per key channel
    (KDA, docs/design.md) has a trailing ``K`` on each (``[NC, H, C, K]``)."""

    g: torch.Tensor  # [NC, H, C] per-token gate, padded rows 0
    cum: torch.Tensor  # [NC, H, C] G_i = sum_{l <= i} g_l; padded rows hold G_C, so exp(cum[..., -1]) = gamma_C
    tail: torch.Tensor  # [NC, H, C] sum_{l > i} g_l: log of gamma_C / gamma_i

    @property
    def per_channel(self) -> bool:
        return self.g.dim() == 4

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """A per-row factor of these gates' shape (``[NC, H, C]`` or ``[NC, H, C, K]``)
        ready to scale rows ``[NC, H, C, K]``."""
        return x if self.per_channel else x[..., None]

    @property
    def last(self) -> torch.Tensor:
        """``G_C``, the log of the chunk's whole decay: ``[NC, H]`` (``[NC, H, K]`` per channel)."""
        return self.cum[..., -1, :] if self.per_channel else self.cum[..., -1]


def chunk_gates(g: torch.Tensor, rows: ChunkRows, dtype: torch.dtype,
                gate_params: torch.Tensor | None = None) -> ChunkGates:
    """Gates ``[T, H]`` (or per channel ``[T, H, K]``) -> the chunk's prefix and
    suffix sums (``[NC, H, C]``, or ``[NC, H, C, K]``). With ``gate_params``
    ``[2, H]`` (per channel ``[2, H, K]``) g is the raw input a and the gate is
    ``gate_params[0] * softplus(a + gate_params[1])``, computed per chunk (padded rows 0)."""
    per_channel = g.dim() == 3
    gc = to_chunks(g, rows, dtype) if per_channel else scalars_to_chunks(g, rows, dtype)
    if gate_params is not None:
        rate, bias = (x.to(dtype)[None, :, None, :] if per_channel else x.to(dtype)[None, :, None]
                      for x in gate_params)
        valid = rows.valid[:, None, :, None] if per_channel else rows.valid[:, None, :]
        gc = torch.where(valid, rate * torch.nn.functional.softplus(gc + bias),
                         torch.zeros((), dtype=dtype, device=gc.device))
    axis = -2 if per_channel else -1
    tail = gc.narrow(axis, 1, gc.shape[axis] - 1).flip(axis).cumsum(axis).flip(axis)
    tail = torch.nn.functional.pad(tail, (0, 0, 0, 1) if per_channel else (0, 1))
    return ChunkGates(gc, gc.cumsum(axis), tail)


def _segments(gates: ChunkGates, strict: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_{j < l <= i} g_l`` ``[..., C, C]`` (each gate added once: column j
    sums g_l down the rows l > j) and the causal mask (``i >= j``, or ``i > j``)."""
    g = gates.g
    C = g.shape[-1]
    below = causal_mask(C, True, g.device)
    segment = torch.where(below, g[..., :, None], torch.zeros((), dtype=g.dtype, device=g.device)).cumsum(-2)
    return segment, below if strict else causal_mask(C, False, g.device)


def causal_decay(gates: ChunkGates, strict: bool = False) -> torch.Tensor:
    """``exp(G_i - G_j)`` on ``i >= j`` (``i > j`` when strict), zero above:
    ``[..., C, C]``, from segment sums (exact zero across a hard reset)."""
    segment, keep = _segments(gates, strict)
    return torch.where(keep, torch.exp(segment), torch.zeros((), dtype=segment.dtype, device=segment.device))


def causal_scores(a: torch.Tensor, b: torch.Tensor, gates: ChunkGates, strict: bool = False,
                  mode: str = "ieee") -> torch.Tensor:
    """``(A B^T) * exp(G_i - G_j)`` on the causal part, zero above it. The mask
    is a select, so a non-finite row of A or B (or gate) at token t reaches no
    row ``i < t``. Per-channel gates: ``sum_d a_id b_jd exp(G_id - G_jd)``,
    through the anchored blocks of :mod:`._channel` (no exponent above 0)."""
    if gates.per_channel:
        keep = causal_mask(a.shape[-2], strict, a.device)
        return channel_scores(a, b, gates.g, keep, mode)
    segment, keep = _segments(gates, strict)
    scores = mm(a, b.mT, mode) * torch.exp(segment)
    return torch.where(keep, scores, torch.zeros((), dtype=scores.dtype, device=scores.device))


def rows_reached(finite: torch.Tensor) -> torch.Tensor:
    """Rows at or after the first row with a ``False`` in ``finite`` (an
    elementwise mask ``[..., R, D]``), as ``[..., R, 1]``: the rows a non-finite
    entry reaches."""
    return (~finite.all(-1, keepdim=True)).cumsum(-2) > 0


def lower_matmul(lower: torch.Tensor, x: torch.Tensor, mode: str = "ieee") -> torch.Tensor:
    """``lower @ x`` for a lower-triangular ``[..., C, C]`` factor without the
    ``0 * inf`` of the zeros above the diagonal: a dense product makes every
    row non-finite when one row of ``x`` is; here row i is NaN exactly when a
    row ``l <= i`` of ``x`` is non-finite, and exact otherwise. So a NaN or inf
    of token t stays at and after t."""
    finite = torch.isfinite(x)
    out = mm(lower, torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device)), mode)
    return torch.where(rows_reached(finite), torch.full((), float("nan"), dtype=out.dtype, device=out.device), out)
