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


def _ext(x: torch.Tensor, halo: torch.Tensor | None, W: int, dtype: torch.dtype) -> torch.Tensor:
    """``[W - 1 + T, D]``: ``cat([halo, x])`` (zeros for no halo) in ``dtype``."""
    return torch.cat([halo if halo is not None else x.new_zeros(W - 1, x.shape[1]), x]).to(dtype)


def _tap(ext: torch.Tensor, reach: torch.Tensor, i: int, T: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[T, D]``: ``ext[t - i]`` where ``i <= reach[t]``, zero elsewhere (every
    row reaches tap 0: a view of ext), written to ``out`` when given."""
    rows = ext.shape[0] - T
    tap = ext[rows - i: rows - i + T]
    return tap if i == 0 else torch.mul(tap, (reach >= i)[:, None].to(ext.dtype), out=out)


# The taps are summed one [T, D] product at a time into one buffer, not as an einsum over a [W, T, D] stack:
# the einsum ran as D batched [T, W] x [W, 1] products, and at T = 2048, D = 1024 (one thread) the forward
# and backward took 240 to 500 ms against 52 to 66 ms for torch's own depthwise conv1d with SiLU.
def _pre(ext: torch.Tensor, reach: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         T: int) -> torch.Tensor:
    W = weight.shape[1]
    w = weight.to(ext.dtype)
    pre = _tap(ext, reach, 0, T) * w[:, W - 1]
    tap = torch.empty_like(pre)
    for i in range(1, W):
        pre.addcmul_(_tap(ext, reach, i, T, tap), w[:, W - 1 - i])
    return pre if bias is None else pre.add_(bias.to(ext.dtype))


def short_conv_fwd(x, weight, bias, reach, halo, *, y_out: torch.Tensor) -> None:
    """x ``[T, D]``; weight ``[D, W]``; bias ``[D]`` or None; reach ``[T]``;
    halo ``[W - 1, D]`` or None (zeros). Writes y_out ``[T, D]`` (x's dtype)."""
    ext = _ext(x, halo, weight.shape[1], accumulator_dtype(x.dtype))
    y_out.copy_(F.silu(_pre(ext, reach, weight, bias, x.shape[0])))


def short_conv_bwd(dy, x, weight, bias, reach, halo, *, dx_out, dweight_out, dbias_out, dhalo_out) -> None:
    """The gradients of :func:`short_conv_fwd` (pre recomputed): dx_out ``[T, D]``,
    dweight_out ``[D, W]``, dbias_out ``[D]`` (or None), dhalo_out ``[W - 1, D]`` (or None)."""
    T, D = x.shape
    W, rows = weight.shape[1], weight.shape[1] - 1
    cdt = accumulator_dtype(x.dtype)
    ext = _ext(x, halo, W, cdt)
    pre = _pre(ext, reach, weight, bias, T)
    sig = torch.sigmoid(pre)
    dpre = dy.to(cdt) * sig * (1 + pre * (1 - sig))
    dext = torch.zeros(rows + T, D, dtype=cdt, device=x.device)
    w, masked, product = weight.to(cdt), torch.empty_like(dpre), torch.empty_like(dpre)
    for i in range(W):  # output row t reads ext[t - i] where i <= reach[t]
        dpre_i = dpre if i == 0 else torch.mul(dpre, (reach >= i)[:, None].to(cdt), out=masked)
        dext[rows - i: rows - i + T].addcmul_(dpre_i, w[:, W - 1 - i])
        dweight_out[:, W - 1 - i] = torch.mul(dpre_i, ext[rows - i: rows - i + T], out=product).sum(0)
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
