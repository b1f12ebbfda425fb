"""What the layers' plain-torch compositions share (tests/test_layer.py,
tests/test_kda_layer.py): q, k and v of one document by F.conv1d with a zero
history, as FLA's ShortConvolution computes them."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def plain_qkv(layer, xd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k ``[1, T, H, K]`` and v ``[1, T, HV, V]`` of one document's rows ``xd`` ``[1, T, hidden]``."""
    T = xd.shape[1]

    def conv(proj, conv1d):
        y = proj(xd)
        if not layer.use_short_conv:
            return F.silu(y)
        W = conv1d.weight.shape[-1]
        y = F.conv1d(F.pad(y.transpose(1, 2), (W - 1, 0)), conv1d.weight, conv1d.bias, groups=y.shape[-1])
        return F.silu(y.transpose(1, 2))

    H, HV, K, V = layer.num_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    return (conv(layer.q_proj, getattr(layer, "q_conv1d", None)).view(1, T, H, K),
            conv(layer.k_proj, getattr(layer, "k_conv1d", None)).view(1, T, H, K),
            conv(layer.v_proj, getattr(layer, "v_conv1d", None)).view(1, T, HV, V))


def assert_layer_equals_plain(layer, plain_layer, bounds: list[int], tol: float = 1e-9) -> None:
    """The layer on the packed ``bounds`` equals ``plain_layer(layer, x, bounds)``
    (fp64): the output and the gradients of x and of every parameter, each of
    which takes part (a nonzero gradient)."""
    x = torch.randn(1, bounds[-1], layer.hidden_size, dtype=torch.float64, requires_grad=True)
    params = [x, *layer.parameters()]
    ours, _, _ = layer(x, cu_seqlens=torch.tensor(bounds))
    ref = plain_layer(layer, x, bounds)
    assert (ours - ref).abs().max() < tol
    do = torch.randn_like(ours)
    names = ["x"] + [n for n, _ in layer.named_parameters()]
    ours_grads = torch.autograd.grad((ours * do).sum(), params)
    for name, a, b in zip(names, ours_grads, torch.autograd.grad((ref * do).sum(), params)):
        assert (a - b).abs().max() < tol, name
        assert a.abs().max() > 0, f"{name} takes no part"
