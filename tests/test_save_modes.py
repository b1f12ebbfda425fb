"""The save modes change what the forward keeps, never a bit of the result:
the light backward recomputes A, W, U, h and the norms exactly as the forward
wrote them, so light, inverse and full give the same outputs and gradients, bit
for bit, on both program backends; the FLA-style entry and the one-rank layer
take the save mode, and the inverse backward runs W, U only."""

from __future__ import annotations

import pytest
import torch
from gdn_inputs import make_inputs

from gdn_kcp import OptionsKcp, chunk_gated_delta_rule
from gdn_kcp.host.programs import use_programs

MODES = ("light", "inverse", "full")


def entry_results(save_mode: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Output, final states and every gradient of the FLA-style entry with
    every in-kernel keyword (norm, gate, beta sigmoid) and initial states."""
    T, cu = 150, torch.tensor([0, 40, 41, 150])
    leaves = [x.to(dtype).requires_grad_() for x in make_inputs(T, 1, 2, 16, 8, seed=3)]
    A_log, dt_bias = torch.tensor([0.2, -0.5]), torch.tensor([0.1, 0.3])
    h0 = torch.randn(3, 2, 16, 8, generator=torch.Generator().manual_seed(4)).requires_grad_()
    o, final = chunk_gated_delta_rule(*leaves, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                      use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                      dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, save_mode=save_mode)
    loss = (o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() + final.square().sum()
    return [o, final, *torch.autograd.grad(loss, [*leaves, h0])]


@pytest.mark.parametrize("backend, dtype", [("torch", torch.float32), ("torch", torch.bfloat16),
                                            ("triton", torch.bfloat16)])
def test_every_save_mode_gives_the_same_bits(backend, dtype):
    if backend == "triton":
        pytest.importorskip("triton")
    with use_programs("cpu", backend):
        results = {mode: entry_results(mode, dtype) for mode in MODES}
    for mode in MODES[1:]:
        for i, (a, b) in enumerate(zip(results[mode], results["light"], strict=True)):
            assert a.dtype == b.dtype and torch.equal(a, b), (mode, i, float((a.double() - b.double()).abs().max()))


@pytest.mark.parametrize("layer_class", ["GatedDeltaNet", "KimiDeltaAttention"])
def test_the_layer_takes_the_save_mode_on_one_rank(monkeypatch, layer_class):
    """kcp_options' save_mode reaches the one-rank call (packed and padded):
    the inverse backward runs w_u instead of prep, with the same gradients
    (GDN's layer and KDA's)."""
    from gdn_kcp import layers
    from gdn_kcp.kernels import torch as programs

    calls = []

    def recorded(name, program):
        def record(*args, **kwargs):
            calls.append(name)
            return program(*args, **kwargs)
        return record

    for name in ("prep", "w_u"):
        monkeypatch.setattr(programs, name, recorded(name, getattr(programs, name)))
    torch.manual_seed(0)
    layer = getattr(layers, layer_class)(hidden_size=32, head_dim=8, num_heads=2)
    x = torch.randn(2, 20, 32)
    mask = torch.ones(2, 20, dtype=torch.long)
    mask[1, :5] = 0
    grads = {}
    for mode in ("light", "inverse"):
        calls.clear()
        options = OptionsKcp(use_qk_l2norm=True, save_mode=mode, gate=layer.GATE)
        packed, _, _ = layer(x[:1], cu_seqlens=torch.tensor([0, 7, 20]), kcp_options=options)
        padded, _, _ = layer(x, attention_mask=mask, kcp_options=options)
        grads[mode] = torch.autograd.grad(packed.sum() + padded.square().sum(), list(layer.parameters()))
        assert calls == (["prep"] * 4 if mode == "light" else ["prep", "prep", "w_u", "w_u"]), (mode, calls)
    for a, b in zip(grads["inverse"], grads["light"], strict=True):
        assert torch.equal(a, b)


def test_a_bad_save_mode_is_named():
    q, k, v, g, beta = make_inputs(10, 1, 1, 8, 8)
    with pytest.raises(ValueError, match=r"OptionsKcp.save_mode must be one of \('light', 'inverse', 'full'\), "
                                         r"got 'heavy'"):
        chunk_gated_delta_rule(q, k, v, g, beta, save_mode="heavy")
