"""gdn_kcp.layers.KimiDeltaAttention: flash-linear-attention's parameter names,
shapes and initialisation (built here from its constructor rules), its
constructor errors, its math against a plain-torch composition over the fp64
KDA oracle, decode caches, padding masks, and KCP on 1-4 gloo ranks against
one rank (FLA's own layer against ours: ``make fla-layer-check``)."""

from __future__ import annotations

import math

import pytest
import torch
from layer_kcp_cases import check_layer_on_rank
from plain_layers import assert_layer_equals_plain, plain_qkv
from spawn import spawn_ranks
from torch.nn import functional as F

from gdn_kcp import OptionsKcp, chunk_kda, naive_kda_recurrence
from gdn_kcp.layers import Cache, KimiDeltaAttention

BOUNDS = [0, 3, 3, 70, 131]  # one, zero-length, a chunk and more, a second chunk boundary
SMALL = dict(hidden_size=32, head_dim=8, num_heads=2)


def expected_parameters(hidden_size=2048, expand_v=1, head_dim=128, num_heads=16, num_v_heads=None,
                        use_short_conv=True, conv_size=4, conv_bias=False, **_):
    """FLA's parameter names and shapes, from its constructor's rules."""
    hv = num_heads if num_v_heads is None else num_v_heads
    key_dim, head_v_dim = num_heads * head_dim, int(head_dim * expand_v)
    value_dim, gate_dim = hv * head_v_dim, hv * head_dim
    params = {"q_proj.weight": (key_dim, hidden_size), "k_proj.weight": (key_dim, hidden_size),
              "v_proj.weight": (value_dim, hidden_size)}
    if use_short_conv:
        for name, dim in (("q", key_dim), ("k", key_dim), ("v", value_dim)):
            params[f"{name}_conv1d.weight"] = (dim, 1, conv_size)
            if conv_bias:
                params[f"{name}_conv1d.bias"] = (dim,)
    params.update({
        "f_proj.0.weight": (head_v_dim, hidden_size), "f_proj.1.weight": (gate_dim, head_v_dim),
        "b_proj.weight": (hv, hidden_size), "A_log": (hv,), "dt_bias": (gate_dim,),
        "g_proj.0.weight": (head_v_dim, hidden_size), "g_proj.1.weight": (value_dim, head_v_dim),
        "g_proj.1.bias": (value_dim,), "o_norm.weight": (head_v_dim,), "o_proj.weight": (hidden_size, value_dim),
    })
    return params


@pytest.mark.parametrize("kwargs", [
    {},
    dict(hidden_size=64, head_dim=16, num_heads=2, num_v_heads=4, expand_v=1.5),
    dict(hidden_size=64, head_dim=8, num_heads=3, use_short_conv=False, safe_gate=True, lower_bound=-5.0),
    dict(hidden_size=32, head_dim=8, num_heads=2, conv_size=3, conv_bias=True),
])
def test_parameter_names_shapes_and_initialisation_are_fla_s(kwargs):
    torch.manual_seed(0)
    layer = KimiDeltaAttention(**kwargs)
    ours = {name: tuple(p.shape) for name, p in layer.state_dict().items()}
    assert ours == expected_parameters(**kwargs)
    # FLA's initialisation: A_log = log U(1, 16) (zeros under safe_gate), dt = softplus(dt_bias) in [1e-4, 0.1]
    if kwargs.get("safe_gate"):
        assert not layer.A_log.any()
    else:
        assert layer.A_log.min() >= 0 and layer.A_log.max() <= math.log(16)
    dt = F.softplus(layer.dt_bias)
    assert dt.min() >= 1e-4 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    assert layer.A_log._no_weight_decay and layer.dt_bias._no_weight_decay
    assert layer.A_log.dtype == layer.dt_bias.dtype == torch.float32
    assert layer.o_norm.activation == "sigmoid"
    layer.load_state_dict({name: torch.zeros(shape) for name, shape in expected_parameters(**kwargs).items()},
                          strict=True)


def test_initialisation_draws_fla_s_distributions():
    """4,096 value heads: A = exp(A_log) uniform in [1, 16] (GDN's layer draws
    [0, 16]), dt = softplus(dt_bias) log-uniform in [1e-3, 0.1], both fp32
    under any default dtype, as FLA pins them."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        layer = KimiDeltaAttention(hidden_size=8, head_dim=4, num_heads=1, num_v_heads=4096)
    finally:
        torch.set_default_dtype(default)
    assert layer.A_log.dtype == layer.dt_bias.dtype == torch.float32
    A = layer.A_log.exp()
    assert A.min() >= 1 and A.max() <= 16 and abs(A.mean().item() - 8.5) < 0.3
    log_dt = F.softplus(layer.dt_bias.double()).log()
    assert abs(log_dt.mean().item() - (math.log(0.1) + math.log(1e-3)) / 2) < 0.05


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(safe_gate=True), ValueError, "safe_gate=True with use_gate_in_kernel=True needs lower_bound"),
    (dict(safe_gate=True, lower_bound=-6.0), ValueError, r"lower_bound must be in \[-5, 0\) with safe_gate"),
    (dict(lower_bound=0.5), ValueError, "lower_bound must be negative"),
    (dict(lower_bound="-5"), TypeError, "lower_bound must be a float or None"),
    (dict(safe_gate=1), TypeError, "safe_gate must be a bool, got int 1"),
    (dict(head_dim=16, expand_v=1.03), ValueError, "expand_v = 1.03 times head_dim = 16"),
    (dict(num_heads=4, num_v_heads=6), ValueError, "num_v_heads = 6 must be a multiple of num_heads = 4"),
    (dict(mode="recurrent"), ValueError, "mode must be one of"),
])
def test_bad_constructor_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        KimiDeltaAttention(hidden_size=64, **{"head_dim": 8, "num_heads": 2, **kwargs})


def plain_layer(layer: KimiDeltaAttention, x: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """The layer's math in plain torch, document by document: conv1d with zero
    history, FLA's gate, the fp64 naive KDA recurrence, RMS norm with the
    sigmoid gate."""
    HV, K, V = layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    outputs = []
    for start, end in zip(bounds, bounds[1:]):
        if end == start:
            continue
        xd, T = x[:, start:end], end - start
        q, k, v = plain_qkv(layer, xd)
        raw = layer.f_proj[1](layer.f_proj[0](xd)).view(1, T, HV, K)
        if layer.lower_bound is None:
            g = -layer.A_log.exp()[:, None] * F.softplus(raw + layer.dt_bias.view(HV, K))
        else:
            g = layer.lower_bound * torch.sigmoid(layer.A_log.exp()[:, None] * (raw + layer.dt_bias.view(HV, K)))
        beta = layer.b_proj(xd).sigmoid() * (2 if layer.allow_neg_eigval else 1)
        o, _ = naive_kda_recurrence(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight
        o = o * torch.sigmoid(layer.g_proj[1](layer.g_proj[0](xd)).view(1, T, HV, V))
        outputs.append(layer.o_proj(o.reshape(1, T, HV * V)))
    return torch.cat(outputs, dim=1)


def small_layer(**kwargs) -> KimiDeltaAttention:
    torch.manual_seed(0)
    layer = KimiDeltaAttention(**{**SMALL, **kwargs}).double()
    with torch.no_grad():  # a decay that does not vanish in a few tokens
        layer.A_log.copy_(torch.linspace(-3, -1, layer.num_v_heads))
    return layer


@pytest.mark.parametrize("kwargs", [
    dict(num_v_heads=4, conv_bias=True),
    dict(use_short_conv=False, allow_neg_eigval=True, safe_gate=True, lower_bound=-5.0),
    dict(num_v_heads=4, expand_v=1.5, lower_bound=-1.0),
])
def test_layer_equals_the_plain_composition(kwargs):
    assert_layer_equals_plain(small_layer(**kwargs), plain_layer, BOUNDS)


@pytest.mark.parametrize("kwargs", [dict(num_v_heads=4, conv_bias=True), dict(use_short_conv=False)])
def test_prefill_and_steps_equal_the_full_forward(kwargs):
    """Two documents: a prefill of a few tokens through the cache, then one
    token per row per step (the step programs): the outputs equal the layer
    on the whole rows, and the cached state is chunk_kda's final state in
    FLA's ``[N, HV, V, K]`` layout."""
    layer = small_layer(layer_idx=0, **kwargs).eval()
    x = torch.randn(2, 20, 32, dtype=torch.float64)
    cache = Cache()
    with torch.no_grad():
        full = layer(x)[0]
        pieces = [layer(x[:, :7], past_key_values=cache, use_cache=True)[0]]
        for t in range(7, 20):
            pieces.append(layer(x[:, t:t + 1], past_key_values=cache, use_cache=True)[0])
    assert (torch.cat(pieces, 1) - full).abs().max() < 1e-12
    assert cache.get_seq_length() == 20
    with pytest.raises(ValueError, match=r"past_key_values needs the layer's layer_idx \(KimiDeltaAttention"):
        small_layer(**kwargs)(x, past_key_values=Cache())


def test_cached_state_is_fla_s_layout():
    layer = small_layer(num_v_heads=4, layer_idx=0).eval()
    x = torch.randn(1, 30, 32, dtype=torch.float64)
    cache = Cache()
    with torch.no_grad():
        layer(x, past_key_values=cache, use_cache=True, cu_seqlens=torch.tensor([0, 12, 30]))
        qkv = layer._qkv_proj(x)
        from gdn_kcp.layers.short_conv import short_conv
        q, k, v = layer._heads(short_conv(qkv, *layer._conv_params(), torch.tensor([0, 12])))
        g, beta = layer._gate_inputs(x)
        _, state = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True,
                             cu_seqlens=torch.tensor([0, 12, 30]), **layer._gates())
    held = cache[0]["recurrent_state"]
    assert held.shape == (2, 4, layer.head_v_dim, layer.head_k_dim)  # [N, HV, V, K]
    assert (held - state.transpose(-1, -2)).abs().max() < 1e-12


def test_padding_masks_equal_each_row_alone():
    layer = small_layer(num_v_heads=4, conv_bias=True)
    T = 40
    x = torch.randn(2, T, 32, dtype=torch.float64)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :15] = 0  # left padding
    o, _, _ = layer(x, attention_mask=mask)
    assert (o[0:1] - layer(x[0:1])[0]).abs().max() < 1e-12
    assert (o[1:2, 15:] - layer(x[1:2, 15:])[0]).abs().max() < 1e-12
    assert not o[1, :15].any()


def test_kcp_options_are_the_channel_gate_s():
    layer = KimiDeltaAttention(**SMALL)
    assert layer.kcp_options() == OptionsKcp(use_qk_l2norm=True, with_conv=True, conv_size=4, gate="channel")
    with pytest.raises(ValueError, match="kcp_options.gate must be 'channel' for KimiDeltaAttention, got 'head'"):
        layer.kcp_options(OptionsKcp(use_qk_l2norm=True))
    from gdn_kcp.layers import GatedDeltaNet
    with pytest.raises(ValueError, match="kcp_options.gate must be 'head' for GatedDeltaNet, got 'channel'"):
        GatedDeltaNet(**SMALL).kcp_options(OptionsKcp(use_qk_l2norm=True, gate="channel"))


@pytest.mark.parametrize("R", [2, 3, 4])
def test_layer_kcp_equals_one_rank(R):
    """Rows, input gradients and summed parameter gradients on R ranks equal
    one rank; the halo's traffic and kept rows equal the KDA queries (one
    rank: the tests above; one graph over packings on 2 ranks:
    tests/test_layer_kcp.py, which compiles both layers in one spawn)."""
    spawn_ranks(R, check_layer_on_rank, "kda")
