"""The short causal convolution of a GDN layer: depthwise, width W (4), SiLU,
reset at every document start of a packed batch.

    y[t] = silu(bias + sum_{i < W} weight[:, 0, W - 1 - i] * x[t - i]),  t - i in t's document

The weight has ``nn.Conv1d``'s depthwise layout ``[D, 1, W]`` (FLA's
``ShortConvolution`` is such a Conv1d, so their state dicts are the same).
This is the torch program (autograd through torch ops); it does not yet take a
halo from the previous rank under KCP.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def token_doc_start(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """``[T]``: the first token of each token's document (bounds ``[N + 1]``)."""
    cu = cu_seqlens.to(torch.int64)
    tokens = torch.arange(T, device=cu.device)
    doc = torch.searchsorted(cu[1:], tokens, right=True).clamp(max=cu.shape[0] - 2)
    return cu[doc]


def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               doc_start: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[B, T, D]``; ``weight`` ``[D, 1, W]``; ``bias`` ``[D]`` or None;
    ``doc_start`` ``[T]`` (a packed row, B = 1) or None (each row one document)."""
    T, W = x.shape[1], weight.shape[-1]
    y = x.new_zeros(()) if bias is None else bias
    for i in range(W):  # tap i reads token t - i
        shifted = F.pad(x, (0, 0, i, 0))[:, :T]
        if doc_start is not None and i:
            inside = torch.arange(T, device=x.device) - i >= doc_start
            shifted = shifted * inside[None, :, None].to(x.dtype)
        y = y + shifted * weight[:, 0, W - 1 - i]
    return F.silu(y)


class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution with SiLU; parameters as ``nn.Conv1d(D, D,
    W, groups=D)``."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False) -> None:
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, padding=kernel_size - 1,
                         bias=bias)

    def forward(self, x: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
        return short_conv(x, self.weight, self.bias, doc_start)
