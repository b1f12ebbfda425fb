"""``KimiDeltaAttention``: the KDA layer with flash-linear-attention's
constructor, parameter names, shapes and initialisation (a state dict of its
``fla.layers.kda.KimiDeltaAttention`` loads with ``strict=True``):

    q, k, v = silu(short_conv(proj(x)))                           per document
    g       = -exp(A_log) * softplus(f_proj(x) + dt_bias)         per key channel, fp32 (in the programs)
              (lower_bound * sigmoid(exp(A_log) (f_proj(x) + dt_bias)) with lower_bound)
    beta    = sigmoid(b_proj(x))                                  (x 2 with allow_neg_eigval)
    o       = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    o       = rmsnorm(o) * o_norm.weight * sigmoid(g_proj(x))     per value head
    out     = o_proj(o)

``f_proj`` and ``g_proj`` are FLA's low-rank pairs (``hidden -> head_v_dim ->
HV * K`` and ``hidden -> head_v_dim -> value_dim`` with a bias). The call
forms (packed ``cu_seqlens``, padding masks, KCP through a context with the
short convolution across ranks, FLA's decode caches) are
:class:`~gdn_kcp.layers.delta_layer.DeltaRuleLayer`'s; the cached recurrent
state is ``[N, HV, V, K]`` fp32, as FLA's KDA layer keeps it
(``state_v_first=True``). A decode step is the convolution's step program
then :func:`~gdn_kcp.fused_recurrent_kda` (GDN's layer fuses the two in one
program; KDA's gate per key channel has no fused step program yet).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from gdn_kcp.kda import check_kda_gate, chunk_kda, fused_recurrent_kda, kda_kcp
from gdn_kcp.recurrent import conv_step_op

from .delta_layer import DeltaRuleLayer, inverse_softplus_steps

__all__ = ["KimiDeltaAttention"]


class KimiDeltaAttention(DeltaRuleLayer):
    """Kimi Delta Attention layer; arguments as ``fla.layers.kda.KimiDeltaAttention``.

    ``num_v_heads`` (default ``num_heads``) value heads of ``head_dim *
    expand_v`` dims read ``num_heads`` key heads of ``head_dim`` (GVA); the
    gate has ``num_v_heads * head_dim`` channels. ``safe_gate`` needs
    ``lower_bound`` in ``[-5, 0)``, as in FLA (it changes nothing else here:
    the programs are exact at any gate); with it ``A_log`` starts at zeros,
    as FLA initialises it. ``mode`` is accepted for compatibility (one token
    per row outside training runs the recurrent step, anything else the
    chunked programs). :meth:`forward` is :meth:`DeltaRuleLayer.forward
    <gdn_kcp.layers.delta_layer.DeltaRuleLayer.forward>`; under KCP the
    workspace and byte queries take :meth:`kcp_options` (``gate="channel"``).

    Example::

        layer = KimiDeltaAttention(hidden_size=256, head_dim=32, num_heads=4)
        o, _, _ = layer(torch.randn(1, 100, 256), cu_seqlens=torch.tensor([0, 40, 100]))
    """

    GATE = "channel"
    STATE_V_FIRST = True  # [N, HV, V, K], as FLA's KDA layer keeps it

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 1,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: int | None = None,
        mode: str = "chunk",
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        safe_gate: bool = False,
        lower_bound: float | None = None,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        **kwargs: object,
    ) -> None:
        """Arguments as FLA's; like FLA's, other keywords are taken and ignored."""
        super().__init__()
        self._init_dims(hidden_size, expand_v, head_dim, num_heads, num_v_heads, mode, use_short_conv,
                        allow_neg_eigval, conv_size, conv_bias, layer_idx)
        self.safe_gate, self.lower_bound = safe_gate, lower_bound
        self.gate_dim = self.num_v_heads * head_dim
        self._init_qkv()
        self._init_convs()
        self.f_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, self.gate_dim, bias=False))
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        # A_log per value head: log U(1, 16) (zeros under safe_gate); dt_bias per gate channel; both fp32, as FLA's
        decay_rate = torch.ones(self.num_v_heads, dtype=torch.float32)
        if not safe_gate:
            decay_rate.uniform_(1, 16)
        self.A_log = nn.Parameter(decay_rate.log())
        self.dt_bias = nn.Parameter(inverse_softplus_steps(self.gate_dim, torch.float32))
        self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Sequential(nn.Linear(hidden_size, self.head_v_dim, bias=False),
                                    nn.Linear(self.head_v_dim, self.value_dim, bias=True))
        self._init_output(norm_eps, "sigmoid")
        check_kda_gate(None, A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=lower_bound,
                       use_gate_in_kernel=True, safe_gate=safe_gate, use_beta_sigmoid_in_kernel=True,
                       allow_neg_eigval=allow_neg_eigval)

    def _gate_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw gate ``[..., HV, K]`` and the raw beta ``[..., HV]`` of x."""
        return self.f_proj(x).unflatten(-1, (self.num_v_heads, self.head_k_dim)), self.b_proj(x)

    def _gates(self) -> dict:
        return dict(A_log=self.A_log, dt_bias=self.dt_bias, use_gate_in_kernel=True, lower_bound=self.lower_bound,
                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval)

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x).unflatten(-1, (self.num_v_heads, self.head_v_dim))

    def _rule_chunk(self, q, k, v, g, beta, **keywords):
        return chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, safe_gate=self.safe_gate, **keywords,
                         **self._gates())

    def _rule_kcp(self, q, k, v, g, beta, ctx, *, options, workspace):
        return kda_kcp(q, k, v, g, beta, ctx, options=options, workspace=workspace, **self._gates())[0]

    def _decode_step(self, x: torch.Tensor, conv_state: torch.Tensor | None,
                     recurrent_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        N = x.shape[0]
        qkv = self._qkv_proj(x[:, 0])
        if self.use_short_conv:
            weight, bias = self._step_conv_params()
            if conv_state is None:
                conv_state = qkv.new_zeros(N, qkv.shape[1], self.conv_size)
            qkv, conv_state = conv_step_op(qkv, conv_state.to(qkv.dtype), weight, bias)
        else:
            qkv = F.silu(qkv)
        o, recurrent_state = fused_recurrent_kda(
            *self._heads(qkv[:, None]), *self._gate_inputs(x), initial_state=recurrent_state,
            output_final_state=True, use_qk_l2norm_in_kernel=True, state_v_first=True, **self._gates())
        return o, recurrent_state, conv_state
