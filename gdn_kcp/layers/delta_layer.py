"""What the delta-rule layers share (:class:`~gdn_kcp.layers.GatedDeltaNet`,
:class:`~gdn_kcp.layers.KimiDeltaAttention`): flash-linear-attention's
projections and short convolutions of q, k, v, the gated RMS norm, the
output projection, and the call forms around the rule:

    q, k, v = silu(short_conv(proj(x)))                      per document
    o       = rule(q, k, v, gate(x), beta(x))                (the subclass)
    out     = o_proj(rmsnorm(o) * o_norm.weight * act(gate_proj(x)))

The call forms are the same for both: packed ``cu_seqlens``, padding masks,
KCP through a context (the short convolution reads the previous ranks'
rows), and FLA's decode caches (prefill from the cached states, one-token
steps outside training).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from gdn_kcp.context import KcpContext
from gdn_kcp.options import OptionsKcp
from gdn_kcp.validate import check_cu_seqlens
from gdn_kcp.workspace import WorkspaceKcp

from .cache import conv_over_history
from .halo import short_conv_kcp
from .short_conv import ShortConvolution, short_conv

MODES = ("chunk", "fused_recurrent")
ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "sigmoid": torch.sigmoid}


class RMSNorm(nn.Module):
    """RMS norm over the last dim, in fp32, with an optional output gate:
    ``x / rms(x) * weight [* act(gate)]`` (``activation`` ``"silu"`` /
    ``"swish"``, GDN's, or ``"sigmoid"``, KDA's; FLA's ``FusedRMSNormGated``),
    returned in x's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        cdt = torch.promote_types(x.dtype, torch.float32)
        y = x.to(cdt) * torch.rsqrt(x.to(cdt).square().mean(-1, keepdim=True) + self.eps) * self.weight.to(cdt)
        if gate is not None:
            y = y * ACTIVATIONS[self.activation](gate.to(cdt))
        return y.to(x.dtype)


def _check_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def inverse_softplus_steps(n: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """FLA's ``dt_bias`` initialisation: steps log-uniform in [1e-3, 0.1]
    (floor 1e-4), stored as ``softplus^-1(dt)``, ``[n]`` in ``dtype`` (FLA's
    KDA layer pins fp32, its GDN layer takes the default dtype)."""
    dt = torch.rand(n, dtype=dtype) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)
    dt = torch.exp(dt).clamp(min=1e-4)
    return dt + torch.log(-torch.expm1(-dt))


class DeltaRuleLayer(nn.Module):
    """The shared body of the delta-rule layers; a subclass builds its gate
    modules and says how its rule is called (the ``_rule_*`` hooks).

    Class attributes a subclass sets: ``GATE`` (``OptionsKcp.gate`` of its
    calls), ``STATE_V_FIRST`` (the cached recurrent state's layout, as the
    matching FLA layer keeps it)."""

    GATE = "head"
    STATE_V_FIRST = False

    def _init_dims(self, hidden_size: int, expand_v: float, head_dim: int, num_heads: int,
                   num_v_heads: int | None, mode: str, use_short_conv: bool, allow_neg_eigval: bool,
                   conv_size: int, conv_bias: bool, layer_idx: int | None) -> None:
        """Check FLA's constructor arguments and set the layer's sizes."""
        _check_int("hidden_size", hidden_size)
        _check_int("head_dim", head_dim)
        _check_int("num_heads", num_heads)
        _check_int("num_v_heads", num_heads if num_v_heads is None else num_v_heads)
        _check_int("conv_size", conv_size)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.hidden_size, self.expand_v, self.mode = hidden_size, expand_v, mode
        self.use_short_conv, self.allow_neg_eigval = use_short_conv, allow_neg_eigval
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
        self._step_conv: tuple | None = None  # (key, weight [D, W], bias [D]): see _step_conv_params

    def _init_qkv(self) -> None:
        self.q_proj = nn.Linear(self.hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.value_dim, bias=False)

    def _init_convs(self) -> None:
        if self.use_short_conv:
            self.q_conv1d = ShortConvolution(self.key_dim, self.conv_size, bias=self.conv_bias)
            self.k_conv1d = ShortConvolution(self.key_dim, self.conv_size, bias=self.conv_bias)
            self.v_conv1d = ShortConvolution(self.value_dim, self.conv_size, bias=self.conv_bias)

    def _init_output(self, norm_eps: float, activation: str) -> None:
        self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps, activation=activation)
        self.o_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

    # The subclass's rule -------------------------------------------------------------------------------------

    def _gate_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The raw gate ``g`` (``[B, T, HV]``, or ``[B, T, HV, K]`` per key
        channel) and the raw beta ``[B, T, HV]`` of the rows x ``[B, T, hidden_size]``."""
        raise NotImplementedError

    def _output_gate(self, x: torch.Tensor) -> torch.Tensor | None:
        """The output gate ``[B, T, HV, head_v_dim]`` of the norm, or None."""
        raise NotImplementedError

    def _rule_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    **keywords: object) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(o [B, T, HV, V], final state)`` of the one-rank chunked entry on
        q, k ``[B, T, H, K]``, v ``[B, T, HV, V]`` and :meth:`_gate_inputs`;
        ``keywords``: FLA's (``cu_seqlens``, ``initial_state``,
        ``output_final_state``, ``state_v_first``) and ours (``save_mode``,
        ``reuse_recompute_tapes``, ``recompute_output``)."""
        raise NotImplementedError

    def _rule_kcp(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  ctx: KcpContext, *, options: OptionsKcp, workspace: WorkspaceKcp | None) -> torch.Tensor:
        """o ``[1, T_r, HV, V]`` of the KCP entry on this rank's rows."""
        raise NotImplementedError

    def _decode_step(self, x: torch.Tensor, conv_state: torch.Tensor | None,
                     recurrent_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One token per row of x ``[N, 1, hidden_size]``: ``(o [N, 1, HV, V],
        recurrent state, convolution state)`` through the step programs."""
        raise NotImplementedError

    # The call forms ------------------------------------------------------------------------------------------

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
        document (:func:`~gdn_kcp.layers.halo.conv_halo`) and the rule runs
        under KCP; every rank must call it together.
        ``workspace``: a held :class:`~gdn_kcp.WorkspaceKcp` for that call
        (made for the context's caps, this layer's heads and dims and
        :meth:`kcp_options`), so a training loop allocates one per layer.
        ``kcp_options``: the :class:`~gdn_kcp.OptionsKcp` of that call (default
        :meth:`kcp_options`, the options whose byte queries count this
        layer's halo); on one rank its ``save_mode``,
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
        options = self.kcp_options(kcp_options)
        if kcp_context is None:
            o, _ = self._rule_chunk(q, k, v, *self._gate_inputs(x), cu_seqlens=cu_seqlens,
                                    save_mode=options.save_mode, reuse_recompute_tapes=options.reuse_recompute_tapes,
                                    recompute_output=options.recompute_output)
        else:
            o = self._rule_kcp(q, k, v, *self._gate_inputs(x), kcp_context, options=options, workspace=workspace)
        return self._output(x, o), None, past_key_values

    def _qkv_proj(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k ``[B, T, num_heads, head_k_dim]`` and v ``[B, T, num_v_heads, head_v_dim]`` of ``qkv``."""
        B, T = qkv.shape[:2]
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(B, T, self.num_heads, self.head_k_dim), k.reshape(B, T, self.num_heads, self.head_k_dim),
                v.reshape(B, T, self.num_v_heads, self.head_v_dim))

    def _output(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The gated RMS norm and the output projection of o ``[B, T, HV, V]``."""
        B, T = x.shape[:2]
        return self.o_proj(self.o_norm(o, self._output_gate(x)).reshape(B, T, self.value_dim))

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
            raise ValueError(f"past_key_values needs the layer's layer_idx ({type(self).__name__}(..., "
                             f"layer_idx=i)), the index of its states in the cache")
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
            o, recurrent_state = self._rule_chunk(*self._heads(qkv), *self._gate_inputs(x),
                                                  initial_state=recurrent_state, output_final_state=use_cache,
                                                  state_v_first=self.STATE_V_FIRST, cu_seqlens=cu_seqlens)
        if use_cache:
            conv = None if conv_state is None else tuple(conv_state.split([self.key_dim, self.key_dim,
                                                                            self.value_dim], dim=1))
            cache.update(recurrent_state=recurrent_state, conv_state=conv, layer_idx=self.layer_idx, offset=offset)
        return o

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
        """The options of this layer's KCP call: ``options`` checked against
        the layer (the q/k L2 norm on; the layer's gate; with ``with_conv``,
        this ``conv_size``), or the default. Pass the same to the byte queries
        and to a held ``WorkspaceKcp``."""
        if options is None:
            return OptionsKcp(use_qk_l2norm=True, with_conv=self.use_short_conv, conv_size=self.conv_size,
                              gate=self.GATE)
        if not isinstance(options, OptionsKcp):
            raise TypeError(f"kcp_options must be an OptionsKcp or None, got {type(options).__name__}")
        if not options.use_qk_l2norm:
            raise ValueError("kcp_options.use_qk_l2norm must be True: the layer L2-normalises q and k in the kernel")
        if options.gate != self.GATE:
            raise ValueError(f"kcp_options.gate must be {self.GATE!r} for {type(self).__name__}, got {options.gate!r}")
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
        return short_conv_kcp(qkv, *self._conv_params(), ctx)
