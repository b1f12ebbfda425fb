"""The short causal convolution of a GDN layer (depthwise, width W, SiLU),
reset at document starts, with the ``W - 1`` rows before the first token (a
halo from the previous rank) read by the first document:

    pre[t] = bias + sum_{i < W, i <= reach[t]} weight[:, W - 1 - i] * ext[t - i]
    y[t]   = silu(pre[t])

``ext`` is ``cat([halo, x])`` indexed from the first token (``ext[-1]`` is the
halo's last row). ``reach[t]`` (:func:`conv_reach`) is how many rows back
token t may read: the rows of its document, and the halo for the first one.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..precision import accumulator_dtype


def conv_reach(doc_starts: torch.Tensor, T: int, W: int, halo_rows: int) -> torch.Tensor:
    """``[T]`` int32: ``min(W - 1, t - start(t))``, where ``start(t)`` is the
    last of the sorted ``doc_starts`` at or before t; the document that starts
    at 0 also reaches ``halo_rows`` rows before it."""
    tokens = torch.arange(T, device=doc_starts.device)
    starts = doc_starts.to(torch.int64)
    start = starts[(torch.searchsorted(starts, tokens, right=True) - 1).clamp(min=0)]
    back = torch.where(start == 0, tokens + halo_rows, tokens - start)
    return back.clamp(max=W - 1).to(torch.int32)


def _taps(x: torch.Tensor, halo: torch.Tensor | None, reach: torch.Tensor, W: int, dtype: torch.dtype):
    """``[W, T, D]``: tap i is ``ext[t - i]`` where ``i <= reach[t]``, zero elsewhere."""
    T, D = x.shape
    rows = W - 1
    ext = torch.cat([halo if halo is not None else x.new_zeros(rows, D), x]).to(dtype)
    return torch.stack([ext[rows - i: rows - i + T] * (reach >= i)[:, None].to(dtype) for i in range(W)])


def _pre(taps: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    pre = torch.einsum("itd,di->td", taps, weight.to(taps.dtype).flip(1))
    return pre if bias is None else pre + bias.to(taps.dtype)


def short_conv_fwd(x, weight, bias, reach, halo, *, y_out: torch.Tensor) -> None:
    """x ``[T, D]``; weight ``[D, W]``; bias ``[D]`` or None; reach ``[T]``;
    halo ``[W - 1, D]`` or None (zeros). Writes y_out ``[T, D]`` (x's dtype)."""
    cdt = accumulator_dtype(x.dtype)
    y_out.copy_(F.silu(_pre(_taps(x, halo, reach, weight.shape[1], cdt), weight, bias)))


def short_conv_bwd(dy, x, weight, bias, reach, halo, *, dx_out, dweight_out, dbias_out, dhalo_out) -> None:
    """The gradients of :func:`short_conv_fwd` (pre recomputed): dx_out ``[T, D]``,
    dweight_out ``[D, W]``, dbias_out ``[D]`` (or None), dhalo_out ``[W - 1, D]`` (or None)."""
    T, D = x.shape
    W, rows = weight.shape[1], weight.shape[1] - 1
    cdt = accumulator_dtype(x.dtype)
    taps = _taps(x, halo, reach, W, cdt)
    pre = _pre(taps, weight, bias)
    sig = torch.sigmoid(pre)
    dpre = dy.to(cdt) * sig * (1 + pre * (1 - sig))
    dext = torch.zeros(rows + T, D, dtype=cdt, device=x.device)
    for i in range(W):
        dext[rows - i: rows - i + T] += dpre * (reach >= i)[:, None].to(cdt) * weight[:, W - 1 - i].to(cdt)
    dweight_out.copy_(torch.einsum("td,itd->di", dpre, taps).flip(1))
    if dbias_out is not None:
        dbias_out.copy_(dpre.sum(0))
    dx_out.copy_(dext[rows:])
    if dhalo_out is not None:
        dhalo_out.copy_(dext[:rows])


def conv_step(x, state, weight, bias, *, y_out: torch.Tensor, state_out: torch.Tensor) -> None:
    """One decode token per row: x ``[N, D]``; state ``[N, D, W]``, each
    channel's last W inputs, the newest in column W - 1 (zeros before a
    document's first token; FLA's convolution cache); weight ``[D, W]``; bias
    ``[D]`` or None. Writes state_out (state's dtype) = state shifted one
    column left with x in the last, and y_out ``[N, D]`` = ``silu(bias +
    sum_j weight[:, j] state_out[:, :, j])``: :func:`short_conv_fwd` at that token.
    state_out must not be state (the Triton twin writes a column before it
    reads the next)."""
    cdt = accumulator_dtype(x.dtype)
    shifted = torch.cat([state[..., 1:], x[..., None].to(state.dtype)], dim=-1)
    taps = shifted.to(cdt).flip(-1)  # tap i is the input i tokens back, summed newest first as the convolution does
    pre = torch.einsum("ndi,di->nd", taps, weight.to(cdt).flip(1))
    y_out.copy_(F.silu(pre if bias is None else pre + bias.to(cdt)))
    state_out.copy_(shifted)
