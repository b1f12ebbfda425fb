"""GatedDeltaNet with decode caches (FLA's ``past_key_values`` protocol):
prefill + one-token steps equal the full forward at every position (fp64),
with a chunked continuation, padded rows, packed rows and the Triton step
programs; the step programs run in eval only; bf16 decoding against the fp64
layer; the cache's errors."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch

from gdn_kcp import build_kcp_context
from gdn_kcp.host.programs import use_programs
from gdn_kcp.layers import Cache, GatedDeltaNet
from gdn_kcp.layers import gated_deltanet as layer_module

CONFIGS = [
    dict(num_v_heads=4, conv_bias=True),
    dict(use_short_conv=False, allow_neg_eigval=True),
    dict(conv_size=3, use_gate=False),
]


def make_layer(dtype=torch.float64, **kwargs) -> GatedDeltaNet:
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=32, head_dim=8, num_heads=2, layer_idx=0, **kwargs).to(dtype).eval()
    with torch.no_grad():  # a decay that does not vanish in a few tokens
        layer.A_log.copy_(torch.linspace(-3, -1, layer.num_v_heads))
    return layer


def decode(layer, x, prefill: int, **kwargs) -> torch.Tensor:
    """Prefill ``x[:, :prefill]``, then one step per token; the outputs joined."""
    cache = Cache()
    o, _, returned = layer(x[:, :prefill], use_cache=True, past_key_values=cache, **kwargs)
    assert returned is cache
    outputs = [o]
    for t in range(prefill, x.shape[1]):
        o, _, _ = layer(x[:, t:t + 1], use_cache=True, past_key_values=cache, **kwargs)
        outputs.append(o)
    assert cache.get_seq_length() == x.shape[1]
    return torch.cat(outputs, dim=1)


@contextlib.contextmanager
def step_counter():
    """Counts the layer's decode steps: ``gdn_kcp::decode_step`` (with a short
    convolution) or the recurrent entry (without)."""
    with mock.patch.object(layer_module, "fused_recurrent_gated_delta_rule",
                           wraps=layer_module.fused_recurrent_gated_delta_rule) as plain, \
            mock.patch.object(layer_module, "decode_step_op", wraps=layer_module.decode_step_op) as fused:
        yield lambda: plain.call_count + fused.call_count


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_prefill_and_steps_equal_the_full_forward(kwargs):
    """A prefill across a chunk boundary (67 tokens), then 8 steps, B = 2."""
    layer = make_layer(**kwargs)
    x = torch.randn(2, 75, 32, dtype=torch.float64)
    full, _, _ = layer(x)
    with step_counter() as steps:
        ours = decode(layer, x, 67)
    assert steps() == 8  # every one-token call ran the step programs
    assert (ours - full).abs().max() < 1e-10


def test_chunked_continuation_from_the_cache():
    """Two multi-token calls (the second continues from the first's states)
    equal one call; so does a prompt of one token followed by a chunk."""
    layer = make_layer(num_v_heads=4, conv_bias=True)
    x = torch.randn(2, 100, 32, dtype=torch.float64)
    full, _, _ = layer(x)
    for split in (30, 1, 2):
        cache = Cache()
        a, _, _ = layer(x[:, :split], use_cache=True, past_key_values=cache)
        b, _, _ = layer(x[:, split:], use_cache=True, past_key_values=cache)
        assert (torch.cat([a, b], 1) - full).abs().max() < 1e-10, split


def test_cached_states_are_the_documents_final_states():
    """The stored recurrent state is the chunked path's final state, and the
    convolution cache the last W projected inputs (zeros before the start)."""
    layer = make_layer(num_v_heads=4, conv_bias=True)
    x = torch.randn(1, 2, 32, dtype=torch.float64)
    cache = Cache()
    layer(x, use_cache=True, past_key_values=cache)
    q_state, k_state, v_state = cache[0]["conv_state"]
    W = layer.conv_size
    assert q_state.shape == (1, layer.key_dim, W) and v_state.shape == (1, layer.value_dim, W)
    assert not q_state[..., :W - 2].any()
    assert (k_state[0, :, W - 2:] - layer.k_proj(x)[0].T).abs().max() < 1e-14
    assert cache[0]["recurrent_state"].shape == (1, 4, 8, 16)


def test_padded_batch_decodes_like_each_row_alone():
    """Left padding in the prompt (FLA's generation batches), then steps with
    the mask grown by ones: each row equals its own unpadded decode."""
    layer = make_layer(num_v_heads=4, conv_bias=True)
    x = torch.randn(2, 80, 32, dtype=torch.float64)
    lead = [0, 17]  # row 1 is left-padded by 17 tokens
    prompt, mask = 70, torch.ones(2, 80, dtype=torch.long)
    mask[1, :lead[1]] = 0
    cache = Cache()
    o, _, _ = layer(x[:, :prompt], attention_mask=mask[:, :prompt], use_cache=True, past_key_values=cache)
    outputs = [o]
    for t in range(prompt, 80):
        o, _, _ = layer(x[:, t:t + 1], attention_mask=mask[:, :t + 1], use_cache=True, past_key_values=cache)
        outputs.append(o)
    ours = torch.cat(outputs, 1)
    assert cache.get_seq_length() == 80  # the padded width, as FLA's cache counts it
    for row in range(2):
        alone, _, _ = layer(x[row:row + 1, lead[row]:])
        assert (ours[row:row + 1, lead[row]:] - alone).abs().max() < 1e-10
        assert not ours[row, :lead[row]].any()


def test_packed_rows_decode_with_cu_seqlens():
    """Three documents packed in one row: a prefill with cu_seqlens, then one
    token of each per step (cu_seqlens = [0, 1, 2, 3])."""
    layer = make_layer(num_v_heads=4, conv_bias=True)
    lengths, steps = [5, 64, 1], 3
    x = torch.randn(3, max(lengths) + steps, 32, dtype=torch.float64)
    prompt = torch.cat([x[i, :n] for i, n in enumerate(lengths)])[None]
    cache = Cache()
    bounds = torch.tensor([0, 5, 69, 70])
    o, _, _ = layer(prompt, use_cache=True, past_key_values=cache, cu_seqlens=bounds)
    produced = [[o[:, s:e]] for s, e in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
    for t in range(steps):
        tokens = torch.stack([x[i, n + t] for i, n in enumerate(lengths)])[None]
        o, _, _ = layer(tokens, use_cache=True, past_key_values=cache, cu_seqlens=torch.arange(4))
        for i in range(3):
            produced[i].append(o[:, i:i + 1])
    for i, n in enumerate(lengths):
        alone, _, _ = layer(x[i:i + 1, :n + steps])
        assert (torch.cat(produced[i], 1) - alone).abs().max() < 1e-10


def test_training_mode_runs_the_chunked_path_and_differentiates():
    """In training a one-token call with a cache runs the chunked path (FLA
    trains in chunk mode only), so gradients flow through the cached history."""
    layer = make_layer(num_v_heads=4, conv_bias=True).train()
    x = torch.randn(1, 6, 32, dtype=torch.float64, requires_grad=True)
    cache = Cache()
    a, _, _ = layer(x[:, :5], use_cache=True, past_key_values=cache)
    with step_counter() as steps:
        b, _, _ = layer(x[:, 5:], use_cache=True, past_key_values=cache)
    assert steps() == 0
    full, _, _ = layer(x)
    grads = torch.autograd.grad(b.sum(), x)[0]
    want = torch.autograd.grad(full[:, 5:].sum(), x)[0]
    assert (grads - want).abs().max() < 1e-10


def test_triton_step_programs_in_the_layer():
    pytest.importorskip("triton")
    layer = make_layer(dtype=torch.float32, num_v_heads=4, conv_bias=True)
    x = torch.randn(2, 70, 32)
    with torch.no_grad():
        reference = decode(layer, x, 66)
        with use_programs("cpu", "triton"):
            ours = decode(layer, x, 66)
    assert (ours - reference).abs().max() < 1e-5


def test_bf16_decoding_against_the_fp64_layer():
    """bf16 decoding is in the bf16 chunked layer's class: against the fp64
    layer's full forward, the steps' relative RMS error (measured 8.3e-3) is
    at most 1.1 times the bf16 chunked forward's at the same positions
    (9.0e-3), and the whole decode's (9.0e-3) within 1.2e-2."""
    from gdn_inputs import rel_rms

    layer = make_layer(dtype=torch.bfloat16, num_v_heads=4, conv_bias=True)
    twin = make_layer(num_v_heads=4, conv_bias=True)
    twin.load_state_dict({name: p.double() for name, p in layer.state_dict().items()})
    x = torch.randn(2, 75, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = decode(layer, x.bfloat16(), 67)
        chunked, _, _ = layer(x.bfloat16())
        expected, _, _ = twin(x.double())
    assert rel_rms(ours[:, 67:], expected[:, 67:]) <= 1.1 * rel_rms(chunked[:, 67:], expected[:, 67:])
    assert rel_rms(ours, expected) < 1.2e-2


def test_a_model_of_layers_counts_each_token_once():
    """Three layers share one cache: the prompt and each step count their
    tokens once, as FLA's cache does; each layer keeps its own states."""
    layers = [GatedDeltaNet(hidden_size=32, head_dim=8, num_heads=2, layer_idx=i).double().eval() for i in range(3)]
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    cache = Cache()
    for t, width in ((0, 5), (5, 1), (6, 1)):
        h = x[:, t:t + width]
        for layer in layers:
            h = layer(h, use_cache=True, past_key_values=cache)[0]
        assert cache.get_seq_length() == t + width and len(cache) == 3
    assert cache[0]["recurrent_state"] is not cache[1]["recurrent_state"]


def test_reading_a_cache_without_use_cache_leaves_it_as_it_was():
    """use_cache=False with past_key_values continues from the states and
    stores nothing; use_cache=True without a cache is the plain forward."""
    layer = make_layer(num_v_heads=4, conv_bias=True)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    full, _, _ = layer(x)
    cache = Cache()
    layer(x[:, :10], use_cache=True, past_key_values=cache)
    before = {name: cache[0][name] for name in ("recurrent_state", "conv_state")}
    for width in (1, 2):  # a step and a chunk
        o, _, _ = layer(x[:, 10:10 + width], use_cache=False, past_key_values=cache)
        assert (o - full[:, 10:10 + width]).abs().max() < 1e-10
    assert cache.get_seq_length() == 10 and all(cache[0][name] is before[name] for name in before)
    o, _, returned = layer(x, use_cache=True)
    assert returned is None and torch.equal(o, full)


def test_fully_padded_calls_keep_the_states():
    """A call whose mask keeps no token (a prompt row of padding only, or a
    step where every row pads) returns zeros and leaves the states as they were."""
    layer = make_layer(num_v_heads=4, conv_bias=True)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    cache = Cache()
    layer(x[:, :5], use_cache=True, past_key_values=cache)
    state = cache[0]["recurrent_state"].clone()
    o, _, _ = layer(x[:, 5:], attention_mask=torch.zeros(2, 6, dtype=torch.long), use_cache=True,
                    past_key_values=cache)
    assert not o.any() and torch.equal(cache[0]["recurrent_state"], state)


def test_cache_errors_name_the_argument():
    layer = make_layer()
    x = torch.randn(1, 4, 32, dtype=torch.float64)
    unnamed = GatedDeltaNet(hidden_size=32, head_dim=8, num_heads=2).double()
    with pytest.raises(ValueError, match="past_key_values needs the layer's layer_idx"):
        unnamed(x, use_cache=True, past_key_values=Cache())
    with pytest.raises(ValueError, match="decode caches .* run on one rank"):
        layer(x, use_cache=True, past_key_values=Cache(), kcp_context=build_kcp_context([0, 4]))
    with pytest.raises(ValueError, match="cu_seqlens must end at"):  # checked as without a cache
        layer(x[:, :3], use_cache=True, past_key_values=Cache(), cu_seqlens=torch.tensor([0, 1, 2]))
    cache = Cache()
    layer(x[:1], use_cache=True, past_key_values=cache)
    for width in (1, 4):
        with pytest.raises(ValueError, match=r"past_key_values\[0\]\['recurrent_state'\] holds 1 rows, the call has 3"):
            layer(torch.randn(3, width, 32, dtype=torch.float64), use_cache=True, past_key_values=cache)
    with pytest.raises(ValueError, match="attn_state .* is not kept"):
        Cache().update(attn_state=(x, x), layer_idx=0)
    with pytest.raises(ValueError, match=r"layer_idx must be an int in \[0, 0\]"):
        Cache().update(recurrent_state=x, layer_idx=2)
    with pytest.raises(KeyError, match="the cache holds 0 layers"):
        Cache()[0]


def test_decode_steps_compile_with_fullgraph():
    """A decode step (cache read, both step programs, cache update) traces as
    one graph; two compiled steps continue a prefill as the full forward does."""
    layer = make_layer(dtype=torch.float32, num_v_heads=4, conv_bias=True)
    x = torch.randn(2, 12, 32)
    step = torch.compile(lambda token, cache: layer(token, use_cache=True, past_key_values=cache)[0],
                         fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        full, _, _ = layer(x)
        cache = Cache()
        layer(x[:, :10], use_cache=True, past_key_values=cache)
        steps = torch.cat([step(x[:, t:t + 1], cache) for t in (10, 11)], dim=1)
    assert (steps - full[:, 10:]).abs().max() < 1e-5 and cache.get_seq_length() == 12


def test_step_reads_the_convolution_weights_as_they_are_now():
    """The decode step keeps one concatenation of the q, k, v convolution
    weights; an in-place update (an optimizer step) or a dtype move is seen by
    the next step, never a stale copy."""
    layer = make_layer(num_v_heads=4, conv_bias=True)
    x = torch.randn(2, 70, 32, dtype=torch.float64)
    with torch.no_grad():
        decode(layer, x, 66)  # fills the kept copy
        for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
            conv.weight.mul_(-0.5)
            conv.bias.add_(0.25)
        full, _, _ = layer(x)
        assert (decode(layer, x, 66) - full).abs().max() < 1e-10
        layer.float()
        full32, _, _ = layer(x.float())
        assert (decode(layer, x.float(), 66) - full32).abs().max() < 1e-4
