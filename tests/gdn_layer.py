"""A small GDN layer over gdn_kcp for the op, compile and memory tests."""

from __future__ import annotations

import torch
from torch import nn

from gdn_kcp import OptionsKcp, gdn_kcp, kda_kcp


class KcpLayer(nn.Module):
    """Projections, gdn_kcp on this rank's tokens, output projection
    (``kda``: kda_kcp, a gate per key channel)."""

    def __init__(self, ctx, *, d_model=32, H_qk=2, HV=4, K=16, V=16, options=None, workspace=None, kda=False):
        super().__init__()
        self.ctx, self.options, self.workspace = ctx, options or OptionsKcp(use_qk_l2norm=True), workspace
        self.H_qk, self.HV, self.K, self.V, self.kda = H_qk, HV, K, V, kda
        self.qkv = nn.Linear(d_model, 2 * H_qk * K + HV * V)
        self.gates = nn.Linear(d_model, HV * (K if kda else 1) + HV)
        self.out = nn.Linear(HV * V, d_model)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:
        """``ctx``: this step's context (default: the one the layer was made with)."""
        T = x.shape[1]
        q, k, v = self.qkv(x).split([self.H_qk * self.K, self.H_qk * self.K, self.HV * self.V], dim=-1)
        gate, beta = self.gates(x).split([self.gates.out_features - self.HV, self.HV], dim=-1)
        gate = nn.functional.logsigmoid(gate + 3.0)
        o, _ = (kda_kcp if self.kda else gdn_kcp)(
            q.view(1, T, self.H_qk, self.K), k.view(1, T, self.H_qk, self.K), v.view(1, T, self.HV, self.V),
            gate.view(1, T, self.HV, self.K) if self.kda else gate, beta.sigmoid(), self.ctx if ctx is None else ctx,
            options=self.options, workspace=self.workspace,
        )
        return self.out(o.flatten(2))


def layer_and_input(ctx, seed: int = 0, **kwargs):
    """The same layer weights and full-stream input on every rank; x is this
    rank's rows."""
    torch.manual_seed(seed)
    layer = KcpLayer(ctx, **kwargs)
    x = torch.randn(1, ctx.n_tokens_global, 32, generator=torch.Generator().manual_seed(seed + 1))
    start, end = ctx.rank_ranges[ctx.rank]
    return layer, x[:, start:end].contiguous()


def loss_and_grads(fn, layer, x):
    """Output, loss and the gradients of the parameters and of x."""
    x = x.clone().requires_grad_()
    y = fn(x)
    grads = torch.autograd.grad((y.square().sum() + y.sum()), [x, *layer.parameters()])
    return y.detach(), grads
