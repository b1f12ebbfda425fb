"""``GatedDeltaNet``: the GDN layer with flash-linear-attention's constructor,
parameter names and shapes (a state dict of its ``fla.layers.GatedDeltaNet``
loads with ``strict=True``), computing its training-mode math on one rank:

    q, k, v = silu(short_conv(proj(x)))                      per document
    g       = -exp(A_log) * softplus(a_proj(x) + dt_bias)    (fp32)
    beta    = sigmoid(b_proj(x))                             (x 2 with allow_neg_eigval)
    o       = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    o       = rmsnorm(o) * o_norm.weight * silu(g_proj(x))   per value head (use_gate)
    out     = o_proj(o)

With FLA's decode caches (``use_cache``, ``past_key_values``), each row
continues from its cached convolution inputs and state; outside training a
call with one token per row runs the decode step programs
(:mod:`gdn_kcp.recurrent`), any other call the chunked path from the states.
The call forms are :class:`~gdn_kcp.layers.delta_layer.DeltaRuleLayer`'s.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from gdn_kcp.chunk import chunk_gated_delta_rule
from gdn_kcp.dtypes import compute_dtype
from gdn_kcp.gates import gate_keywords
from gdn_kcp.kcp import gdn_kcp
from gdn_kcp.recurrent import decode_step_op, fused_recurrent_gated_delta_rule

from .delta_layer import DeltaRuleLayer, RMSNorm, inverse_softplus_steps

__all__ = ["GatedDeltaNet", "RMSNorm"]


class GatedDeltaNet(DeltaRuleLayer):
    """Gated DeltaNet layer; arguments as ``fla.layers.GatedDeltaNet``.

    ``num_v_heads`` (default ``num_heads``) value heads of ``head_dim *
    expand_v`` dims read ``num_heads`` key heads of ``head_dim`` (GVA).
    ``mode`` is accepted for compatibility: both modes compute the same math
    here (FLA's choice between them is made here by the call: one token per
    row outside training runs the recurrent step, anything else the chunked
    kernels). :meth:`forward` is :meth:`DeltaRuleLayer.forward
    <gdn_kcp.layers.delta_layer.DeltaRuleLayer.forward>` (cu_seqlens,
    attention_mask, past_key_values, kcp_context, workspace, kcp_options).

    Example::

        layer = GatedDeltaNet(hidden_size=256, head_dim=32, num_heads=4)
        o, _, _ = layer(torch.randn(1, 100, 256), cu_seqlens=torch.tensor([0, 40, 100]))
    """

    GATE = "head"
    STATE_V_FIRST = False  # [N, HV, K, V]

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 2,
        head_dim: int = 256,
        num_heads: int = 6,
        num_v_heads: int | None = None,
        mode: str = "chunk",
        use_gate: bool = True,
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        **kwargs: object,
    ) -> None:
        """Arguments as FLA's; like FLA's, other keywords (a model config's
        ``fuse_norm=``, say) are taken and ignored."""
        super().__init__()
        self._init_dims(hidden_size, expand_v, head_dim, num_heads, num_v_heads, mode, use_short_conv,
                        allow_neg_eigval, conv_size, conv_bias, layer_idx)
        self.use_gate = use_gate
        self._init_qkv()
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        # Decay rate A in U(0, 16) and step dt log-uniform in [1e-3, 0.1] (floor 1e-4), as FLA initialises them
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32).uniform_(0, 16).log())
        self.dt_bias = nn.Parameter(inverse_softplus_steps(self.num_v_heads))
        self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = True
        self._init_convs()
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self._init_output(norm_eps, "silu")

    def _gate_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a_proj(x), self.b_proj(x)

    def _gates(self) -> dict:
        return dict(A_log=self.A_log, dt_bias=self.dt_bias, use_gate_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval)

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        B, T = x.shape[:2]
        return self.g_proj(x).view(B, T, self.num_v_heads, self.head_v_dim) if self.use_gate else None

    def _rule_chunk(self, q, k, v, g, beta, **keywords):
        return chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **keywords, **self._gates())

    def _rule_kcp(self, q, k, v, g, beta, ctx, *, options, workspace):
        return gdn_kcp(q, k, v, g, beta, ctx, options=options, workspace=workspace, **self._gates())[0]

    def _decode_step(self, x: torch.Tensor, conv_state: torch.Tensor | None,
                     recurrent_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        N = x.shape[0]
        qkv = self._qkv_proj(x[:, 0])
        if self.use_short_conv:  # one program: the convolution and the recurrence
            weight, bias = self._step_conv_params()
            if conv_state is None:
                conv_state = qkv.new_zeros(N, qkv.shape[1], self.conv_size)
            a, b = self.a_proj(x[:, 0]), self.b_proj(x[:, 0])
            gate = gate_keywords(a, b, **self._gates())
            o, recurrent_state, conv_state = decode_step_op(
                qkv, conv_state.to(qkv.dtype), weight, bias,
                a, b, gate.params(compute_dtype(qkv.dtype)), recurrent_state, self.num_heads, self.head_k_dim,
                self.head_v_dim, self.head_k_dim**-0.5, True, gate.beta_sigmoid, gate.beta_scale)
            return o[:, None], recurrent_state, conv_state
        qkv = F.silu(qkv)
        o, recurrent_state = fused_recurrent_gated_delta_rule(
            *self._heads(qkv[:, None]), self.a_proj(x), beta=self.b_proj(x), initial_state=recurrent_state,
            output_final_state=True, use_qk_l2norm_in_kernel=True, **self._gates())
        return o, recurrent_state, conv_state
