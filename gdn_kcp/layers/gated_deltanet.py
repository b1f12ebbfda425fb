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
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from gdn_kcp.chunk import chunk_gated_delta_rule
from gdn_kcp.context import KcpContext
from gdn_kcp.kcp import gdn_kcp
from gdn_kcp.options import OptionsKcp
from gdn_kcp.dtypes import compute_dtype
from gdn_kcp.gates import gate_keywords
from gdn_kcp.recurrent import decode_step_op, fused_recurrent_gated_delta_rule
from gdn_kcp.validate import check_cu_seqlens
from gdn_kcp.workspace import WorkspaceKcp

from .cache import conv_over_history
from .halo import conv_halo
from .short_conv import ShortConvolution, short_conv

MODES = ("chunk", "fused_recurrent")


class RMSNorm(nn.Module):
    """RMS norm over the last dim, in fp32, with an optional SiLU gate:
    ``x / rms(x) * weight [* silu(gate)]``, returned in x's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        cdt = torch.promote_types(x.dtype, torch.float32)
        y = x.to(cdt) * torch.rsqrt(x.to(cdt).square().mean(-1, keepdim=True) + self.eps) * self.weight.to(cdt)
        if gate is not None:
            y = y * F.silu(gate.to(cdt))
        return y.to(x.dtype)


def _check_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet layer; arguments as ``fla.layers.GatedDeltaNet``.

    ``num_v_heads`` (default ``num_heads``) value heads of ``head_dim *
    expand_v`` dims read ``num_heads`` key heads of ``head_dim`` (GVA).
    ``mode`` is accepted for compatibility: both modes compute the same math
    here (FLA's choice between them is made here by the call: one token per
    row outside training runs the recurrent step, anything else the chunked
    kernels).

    Example::

        layer = GatedDeltaNet(hidden_size=256, head_dim=32, num_heads=4)
        o, _, _ = layer(torch.randn(1, 100, 256), cu_seqlens=torch.tensor([0, 40, 100]))
    """

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
        _check_int("hidden_size", hidden_size)
        _check_int("head_dim", head_dim)
        _check_int("num_heads", num_heads)
        _check_int("num_v_heads", num_heads if num_v_heads is None else num_v_heads)
        _check_int("conv_size", conv_size)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.hidden_size, self.expand_v, self.mode = hidden_size, expand_v, mode
        self.use_gate, self.use_short_conv, self.allow_neg_eigval = use_gate, use_short_conv, allow_neg_eigval
        self.conv_size, self.conv_bias, self.layer_idx = conv_size, conv_bias, layer_idx
        self.num_heads = num_heads
        self.num_v_heads = num_heads if num_v_heads is None else num_v_heads
        self.head_dim = self.head_k_dim = head_dim
        self.head_v_dim = int(head_dim * expand_v)
        self.key_dim = num_heads * head_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        if not math.isclose(head_dim * expand_v, self.head_v_dim, rel_tol=1e-5) or self.head_v_dim < 1:
            raise ValueError(f"expand_v = {expand_v} times head_dim = {head_dim} must be a positive integer "
                             f"(the value head dim), got {head_dim * expand_v}")
        if self.num_v_heads % num_heads:
            raise ValueError(f"num_v_heads = {self.num_v_heads} must be a multiple of num_heads = {num_heads}")

        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.a_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, self.num_v_heads, bias=False)
        # Decay rate A in U(0, 16) and step dt log-uniform in [1e-3, 0.1] (floor 1e-4), as FLA initialises them
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads).uniform_(0, 16).log())
        dt = torch.exp(torch.rand(self.num_v_heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        dt = dt.clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
        self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = True
        if use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias)
            self.k_conv1d = ShortConvolution(self.key_dim, conv_size, bias=conv_bias)
            self.v_conv1d = ShortConvolution(self.value_dim, conv_size, bias=conv_bias)
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
        self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self._step_conv: tuple | None = None  # (key, weight [D, W], bias [D]): see _step_conv_params

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: object = None,
        use_cache: bool = False,
        output_attentions: bool = False,
        *,
        cu_seqlens: torch.Tensor | None = None,
        kcp_context: KcpContext | None = None,
        workspace: WorkspaceKcp | None = None,
        kcp_options: OptionsKcp | None = None,
        **kwargs: object,
    ) -> tuple[torch.Tensor, None, object]:
        """``hidden_states`` ``[B, T, hidden_size]``; ``cu_seqlens`` ``[N + 1]``
        packs B = 1 rows of N documents. ``attention_mask`` ``[B, T']`` (1 for
        a token, 0 for padding, left or right; its last T columns are read,
        as FLA reads them) runs the kept tokens of each row as one document of
        a packed stream and pads the output back with zeros, as FLA's layer
        does (its packing reads the mask on the host). ``past_key_values``
        (a :class:`~gdn_kcp.layers.Cache` or FLA's ``Cache``; needs
        ``layer_idx``): each row (document) continues from this layer's
        cached states, and with ``use_cache=True`` the new states are stored
        there (:mod:`gdn_kcp.layers.cache`); outside training one token per
        row is a decode step through the step programs. Other keywords are
        taken and ignored, as FLA's layer ignores them. With ``kcp_context`` (a
        :class:`~gdn_kcp.KcpContext`) the rows are this rank's range of the
        packed stream (``[1, T_r, hidden_size]``): the short convolutions read
        the previous ranks' last ``conv_size - 1`` rows of a crossing-in
        document (:func:`~gdn_kcp.layers.halo.conv_halo`) and the GDN runs as
        :func:`~gdn_kcp.gdn_kcp`; every rank must call it together.
        ``workspace``: a held :class:`~gdn_kcp.WorkspaceKcp` for that call
        (made for the context's caps, this layer's heads and dims,
        ``use_qk_l2norm=True``), so a training loop allocates one per layer.
        ``kcp_options``: the :class:`~gdn_kcp.OptionsKcp` of that call (default
        ``OptionsKcp(use_qk_l2norm=True, with_conv=True, conv_size=conv_size)``,
        the options whose byte queries count this layer's halo; see
        :meth:`kcp_options`); on one rank its ``save_mode``,
        ``reuse_recompute_tapes`` and ``recompute_output`` apply (the chunked
        path; decode caches run without a backward). Returns FLA's
        ``(o, None, past_key_values)``."""
        if kcp_context is not None and past_key_values is not None:
            raise ValueError("decode caches (past_key_values) run on one rank: call the layer without kcp_context "
                             "to prefill and decode")
        if kcp_context is not None and cu_seqlens is not None:
            raise ValueError("pass cu_seqlens or kcp_context, not both (the context holds the packing)")
        if kcp_context is not None and not isinstance(kcp_context, KcpContext):
            raise TypeError(f"kcp_context must be a KcpContext or None, got {type(kcp_context).__name__}")
        if workspace is not None and kcp_context is None:
            raise ValueError("workspace is for the KCP call: pass it with kcp_context")
        if hidden_states.dim() != 3:
            raise ValueError(f"hidden_states must be [B, T, hidden_size], got shape {tuple(hidden_states.shape)}")
        packed = "cu_seqlens" if cu_seqlens is not None else "kcp_context" if kcp_context is not None else None
        if packed and hidden_states.shape[0] != 1:
            raise ValueError(f"with {packed} the batch is one packed row: hidden_states must be [1, T, hidden_size], "
                             f"got B = {hidden_states.shape[0]}")
        if attention_mask is not None:
            if packed:
                raise ValueError(f"attention_mask pads rows of a batch; with {packed} the stream is already packed: "
                                 f"pack the batch's tokens into the stream instead of padding them")
            return self._forward_padded(hidden_states, attention_mask, past_key_values, use_cache, kcp_options)
        B, T, _ = hidden_states.shape
        x = hidden_states
        if past_key_values is not None:
            o = self._forward_cached(x, cu_seqlens, past_key_values, bool(use_cache), offset=T)
            return self._output(x, o), None, past_key_values
        # q, k and v as one [B, T, 2 key_dim + value_dim] product and one convolution launch
        qkv = self._qkv_proj(x)
        if not self.use_short_conv:
            qkv = F.silu(qkv)
        elif kcp_context is None:
            qkv = short_conv(qkv, *self._conv_params(), None if cu_seqlens is None else cu_seqlens[:-1])
        else:
            qkv = self._conv_kcp(qkv, kcp_context)
        q, k, v = self._heads(qkv)
        if kcp_context is None:
            options = self.kcp_options(kcp_options)
            o, _ = chunk_gated_delta_rule(q, k, v, self.a_proj(x), self.b_proj(x), use_qk_l2norm_in_kernel=True,
                                          cu_seqlens=cu_seqlens, save_mode=options.save_mode,
                                          reuse_recompute_tapes=options.reuse_recompute_tapes,
                                          recompute_output=options.recompute_output, **self._gates())
        else:
            o, _ = gdn_kcp(q, k, v, self.a_proj(x), self.b_proj(x), kcp_context,
                           options=self.kcp_options(kcp_options), workspace=workspace, **self._gates())
        return self._output(x, o), None, past_key_values

    def _qkv_proj(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k ``[B, T, num_heads, head_k_dim]`` and v ``[B, T, num_v_heads, head_v_dim]`` of ``qkv``."""
        B, T = qkv.shape[:2]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(B, T, self.num_heads, self.head_k_dim), k.reshape(B, T, self.num_heads, self.head_k_dim),
                v.reshape(B, T, self.num_v_heads, self.head_v_dim))

    def _gates(self) -> dict:
        return dict(A_log=self.A_log, dt_bias=self.dt_bias, use_gate_in_kernel=True,
                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=self.allow_neg_eigval)

    def _output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The gated RMS norm and the output projection of o ``[B, T, HV, V]``."""
        B, T = x.shape[:2]
        gate = self.g_proj(x).view(B, T, self.num_v_heads, self.head_v_dim) if self.use_gate else None
        return self.o_proj(self.o_norm(o, gate).reshape(B, T, self.value_dim))

    def _forward_cached(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None, cache: object, use_cache: bool,
                        offset: int) -> torch.Tensor:
        """o of rows (documents) that continue from ``cache``'s states of this
        layer (none yet: zeros), storing the new states and counting ``offset``
        tokens when ``use_cache`` (without it the cache is read, not changed).
        One token per document outside training is a decode step (the
        convolution's and the recurrence's step programs); anything else runs
        the chunked path from the cached states."""
        B, T, _ = x.shape
        if self.layer_idx is None:
            raise ValueError("past_key_values needs the layer's layer_idx (GatedDeltaNet(..., layer_idx=i)), "
                             "the index of its states in the cache")
        bounds = [b * T for b in range(B + 1)] if cu_seqlens is None else check_cu_seqlens(cu_seqlens, T)
        last = cache[self.layer_idx] if len(cache) > self.layer_idx else None
        recurrent_state = None if last is None else last["recurrent_state"]
        conv_state = None if last is None or last["conv_state"] is None else torch.cat(last["conv_state"], dim=1)
        for name, state in (("recurrent_state", recurrent_state), ("conv_state", conv_state)):
            if state is not None and state.shape[0] != len(bounds) - 1:
                raise ValueError(f"past_key_values[{self.layer_idx}][{name!r}] holds {state.shape[0]} rows, the call "
                                 f"has {len(bounds) - 1} (rows of hidden_states, or documents of cu_seqlens)")
        if not self.training and all(e - s == 1 for s, e in zip(bounds, bounds[1:])):
            o, recurrent_state, conv_state = self._decode_step(x.reshape(-1, 1, x.shape[-1]), conv_state,
                                                               recurrent_state)
            o = o.view(B, T, self.num_v_heads, self.head_v_dim)
        else:
            qkv = self._qkv_proj(x)
            if self.use_short_conv:
                y, conv_state = conv_over_history(qkv.reshape(B * T, qkv.shape[-1]), *self._conv_params(), bounds,
                                                  conv_state)
                qkv = y.view(B, T, qkv.shape[-1])
            else:
                qkv = F.silu(qkv)
            o, recurrent_state = chunk_gated_delta_rule(
                *self._heads(qkv), self.a_proj(x), self.b_proj(x), initial_state=recurrent_state,
                output_final_state=use_cache, use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens, **self._gates())
        if use_cache:
            conv = None if conv_state is None else tuple(conv_state.split([self.key_dim, self.key_dim,
                                                                            self.value_dim], dim=1))
            cache.update(recurrent_state=recurrent_state, conv_state=conv, layer_idx=self.layer_idx, offset=offset)
        return o

    def _decode_step(self, x: torch.Tensor, conv_state: torch.Tensor | None,
                     recurrent_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One token per row of x ``[N, 1, hidden_size]``: ``(o [N, 1, HV, V],
        recurrent state, convolution state)`` through the step programs."""
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

    def _forward_padded(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor, cache: object,
                        use_cache: bool, kcp_options: OptionsKcp | None = None) -> tuple:
        """Unpad with the mask (each row's kept tokens one document, continuing
        the row's cached states), run the packed row, pad back with zeros."""
        B, T, D = hidden_states.shape
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or \
                attention_mask.shape[0] != B or attention_mask.shape[1] < T:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(f"attention_mask must be a [B, T'] 0/1 tensor with B = {B} and T' >= T = {T} "
                             f"(0 for padding), got {shape}")
        keep = attention_mask[:, -T:].to(torch.bool).to(hidden_states.device)
        indices = keep.reshape(-1).nonzero().squeeze(1)  # the kept tokens, row by row (a host read, as FLA's)
        lengths = keep.sum(1)
        cu_seqlens = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
        x = hidden_states.reshape(B * T, D)[indices][None]
        if cache is None:
            o, _, _ = self(x, cu_seqlens=cu_seqlens, kcp_options=kcp_options)
        else:  # the cache counts the padded width, as FLA's does
            o = self._output(x, self._forward_cached(x, cu_seqlens, cache, bool(use_cache), offset=T))
        out = o.new_zeros(B * T, o.shape[-1]).index_copy(0, indices, o[0])
        return out.view(B, T, -1), None, cache

    def kcp_options(self, options: OptionsKcp | None = None) -> OptionsKcp:
        """The options of this layer's ``gdn_kcp`` call: ``options`` checked
        against the layer (the q/k L2 norm on; with ``with_conv``, this
        ``conv_size``), or the default. Pass the same to the byte queries and
        to a held ``WorkspaceKcp``."""
        if options is None:
            return OptionsKcp(use_qk_l2norm=True, with_conv=self.use_short_conv, conv_size=self.conv_size)
        if not isinstance(options, OptionsKcp):
            raise TypeError(f"kcp_options must be an OptionsKcp or None, got {type(options).__name__}")
        if not options.use_qk_l2norm:
            raise ValueError("kcp_options.use_qk_l2norm must be True: the layer L2-normalises q and k in the kernel")
        if options.with_conv and (not self.use_short_conv or options.conv_size != self.conv_size):
            raise ValueError(f"kcp_options.with_conv=True with conv_size={options.conv_size} does not describe this "
                             f"layer (use_short_conv={self.use_short_conv}, conv_size={self.conv_size})")
        return options

    def _step_conv_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The q, k, v convolutions' weights ``[D, W]`` and biases ``[D]`` side
        by side, as the decode step reads them. Eager, concatenated once and
        kept until a parameter moves or changes (its storage or version), so a
        step launches no concatenation; traced, concatenated in the graph. The
        step is forward only, so the kept copy holds no autograd graph."""
        weights, biases = self._conv_params()
        if torch.compiler.is_compiling():
            return torch.cat(weights)[:, 0], None if biases is None else torch.cat(biases)
        params = [*weights, *(biases or [])]
        key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params)
        if self._step_conv is None or self._step_conv[0] != key:
            with torch.no_grad():
                self._step_conv = (key, torch.cat(weights)[:, 0].contiguous(),
                                   None if biases is None else torch.cat(biases))
        return self._step_conv[1], self._step_conv[2]

    def _conv_params(self) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The weights and biases of the q, k and v convolutions, in that order."""
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        return [conv.weight for conv in convs], [conv.bias for conv in convs] if self.conv_bias else None

    def _conv_kcp(self, qkv: torch.Tensor, ctx: KcpContext) -> torch.Tensor:
        """The convolution of this rank's rows (B = 1) with the halo of one exchange
        of ``[conv_size - 1, 2 key_dim + value_dim]`` per round (none on one rank)."""
        halo = conv_halo(qkv[0], ctx, self.conv_size - 1) if ctx.R > 1 else None
        return short_conv(qkv, *self._conv_params(), ctx.index_for(qkv.device).frag_start, halo)
