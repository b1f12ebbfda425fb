"""The short causal convolution of a GDN layer: depthwise, width W (4), SiLU,
reset at every document start of a packed batch.

    y[t] = silu(bias + sum_{i < W} weight[:, 0, W - 1 - i] * x[t - i]),  t - i in t's document

``gdn_kcp::short_conv`` is an opaque op over ``[T, D]`` rows: the torch
program on the CPU, one Triton launch on CUDA (SiLU fused; the layer runs
q, k and v as one ``D``). Under KCP it takes the ``W - 1`` rows before the
rank's first token (the halo, :mod:`.halo`), read by the first document
only. Its backward recomputes the pre-activation, so it keeps its inputs
and nothing else: under KCP the halo is the one tensor it keeps that the
layer's caller never holds (``OptionsKcp(with_conv=True)`` counts it).

The weight has ``nn.Conv1d``'s depthwise layout ``[D, 1, W]`` (FLA's
``ShortConvolution`` is such a Conv1d, so their state dicts are the same).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from gdn_kcp.host.programs import programs_for
from gdn_kcp.kernels.torch.short_conv import conv_reach

DEVICES = ("cpu", "cuda")


def _programs(x: Tensor):
    return programs_for(x.device)


def _reach(x: Tensor, weight: Tensor, doc_starts: Tensor, halo: Tensor | None) -> Tensor:
    """How many rows back each token of ``x`` may read (:func:`conv_reach`)."""
    return conv_reach(doc_starts, x.shape[0], weight.shape[1], 0 if halo is None else halo.shape[0])


def _joined(parts: list[Tensor]) -> Tensor | None:
    return (parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else None


@torch.library.custom_op("gdn_kcp::short_conv", mutates_args=(), device_types=DEVICES)
def short_conv_op(x: Tensor, weights: list[Tensor], biases: list[Tensor], doc_starts: Tensor,
                  halo: Optional[Tensor]) -> Tensor:
    """x ``[T, D]``; weights ``[D_i, W]`` with ``sum D_i = D`` (the q, k and v
    convolutions' own parameters, joined inside the op so the backward keeps
    them and no copy); biases ``[D_i]`` (or none); doc_starts ``[n]`` (sorted
    local document starts, the first 0); halo ``[W - 1, D]`` or None."""
    y = torch.empty_like(x)
    weight = _joined(weights)
    _programs(x).short_conv_fwd(x, weight, _joined(biases), _reach(x, weight, doc_starts, halo), halo, y_out=y)
    return y


@torch.library.custom_op("gdn_kcp::short_conv_bwd", mutates_args=(), device_types=DEVICES)
def short_conv_bwd_op(dy: Tensor, x: Tensor, weights: list[Tensor], biases: list[Tensor], doc_starts: Tensor,
                      halo: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dx, dweight [D, W], dbias [D], dhalo)``; dbias / dhalo are empty
    without biases / halo."""
    weight, bias = _joined(weights), _joined(biases)
    dx, dweight = torch.empty_like(x), torch.empty_like(weight)
    dbias = torch.empty_like(bias) if bias is not None else x.new_empty(0)
    dhalo = torch.empty_like(halo) if halo is not None else x.new_empty(0)
    _programs(x).short_conv_bwd(dy.contiguous(), x, weight, bias, _reach(x, weight, doc_starts, halo), halo,
                                dx_out=dx, dweight_out=dweight,
                                dbias_out=dbias if bias is not None else None,
                                dhalo_out=dhalo if halo is not None else None)
    return dx, dweight, dbias, dhalo


@short_conv_op.register_fake
def _(x, weights, biases, doc_starts, halo):
    return torch.empty_like(x)


@short_conv_bwd_op.register_fake
def _(dy, x, weights, biases, doc_starts, halo):
    D, W = x.shape[1], weights[0].shape[1]
    return (torch.empty_like(x), weights[0].new_empty(D, W), biases[0].new_empty(D) if biases else x.new_empty(0),
            torch.empty_like(halo) if halo is not None else x.new_empty(0))


def _setup(ctx, inputs, output):
    x, weights, biases, doc_starts, halo = inputs
    ctx.sizes, ctx.n_biases = [w.shape[0] for w in weights], len(biases)
    ctx.save_for_backward(x, doc_starts, halo, *weights, *biases)


def _backward(ctx, dy):
    x, doc_starts, halo, *params = ctx.saved_tensors
    weights, biases = params[: len(ctx.sizes)], params[len(ctx.sizes):]
    dx, dweight, dbias, dhalo = short_conv_bwd_op(dy, x, weights, biases, doc_starts, halo)
    return (dx, list(dweight.split(ctx.sizes)), list(dbias.split(ctx.sizes)) if ctx.n_biases else [], None,
            dhalo if halo is not None else None)


short_conv_op.register_autograd(_backward, setup_context=_setup)


def short_conv(x: Tensor, weight: Tensor | list[Tensor], bias: Tensor | list[Tensor] | None,
               doc_starts: Tensor | None = None, halo: Tensor | None = None) -> Tensor:
    """``x`` ``[B, T, D]``; ``weight`` ``[D, 1, W]`` (or a list of such, ``D_i``
    channels each, in the order of x's channels); ``bias`` ``[D]`` (a list
    alike) or None; ``doc_starts`` the starts of the packed row's documents
    (B = 1; ``cu_seqlens[:-1]`` will do) or None (each row one document);
    ``halo`` ``[W - 1, D]`` rows before the first token, read by the first document."""
    B, T, D = x.shape
    weights = [w.reshape(w.shape[0], w.shape[-1]) for w in (weight if isinstance(weight, (list, tuple)) else [weight])]
    biases = [] if bias is None else list(bias) if isinstance(bias, (list, tuple)) else [bias]
    W = weights[0].shape[1]
    if sum(w.shape[0] for w in weights) != D or any(w.shape[1] != W for w in weights):
        raise ValueError(f"short_conv wants weights [D_i, 1, W] with sum D_i = D = {D} and one W, got "
                         f"{[tuple(w.shape) for w in weights]}")
    if biases and [b.shape for b in biases] != [(w.shape[0],) for w in weights]:
        raise ValueError(f"bias must have shape [D] = [{D}] (one [D_i] per weight), got "
                         f"{[tuple(b.shape) for b in biases]}")
    if halo is not None and tuple(halo.shape) != (W - 1, D):
        raise ValueError(f"halo must have shape [W - 1, D] = [{W - 1}, {D}], got {tuple(halo.shape)}")
    if doc_starts is None:
        doc_starts = torch.arange(0, B * T, max(T, 1), device=x.device)
    elif B != 1:
        raise ValueError(f"doc_starts packs one row: hidden states must have B = 1, got B = {B}")
    y = short_conv_op(x.reshape(B * T, D).contiguous(), [w.contiguous() for w in weights], biases, doc_starts,
                      None if halo is None else halo.contiguous())
    return y.view(B, T, D)


class ShortConvolution(nn.Conv1d):
    """Depthwise causal convolution with SiLU; parameters as ``nn.Conv1d(D, D,
    W, groups=D)``."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False) -> None:
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, padding=kernel_size - 1,
                         bias=bias)

    def forward(self, x: Tensor, doc_starts: Tensor | None = None, halo: Tensor | None = None) -> Tensor:
        return short_conv(x, self.weight, self.bias, doc_starts, halo)
