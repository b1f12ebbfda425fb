"""Seeded GDN inputs and the comparison helpers the tests share."""

from __future__ import annotations

import random

import torch

from gdn_kcp import chunk_gated_delta_rule, naive_recurrence
from gdn_kcp.kernels.twin_check import make_inputs  # noqa: F401 (the tests' seeded inputs)

NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "d_initial_state")


def random_bounds(T: int, seed: int, max_len: int = 40) -> list[int]:
    """Document bounds ``[0, ..., T]`` of a random packing with zero- and
    one-token documents among short ones."""
    rng = random.Random(seed)
    bounds = [0, 0, min(1, T)]  # a zero-length and a one-token document first
    while bounds[-1] < T:
        bounds.append(min(T, bounds[-1] + rng.choice([0, 1, rng.randint(2, max_len)])))
    return bounds


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``rms(actual - expected) / rms(expected)`` in fp64."""
    a, e = actual.double(), expected.double()
    if e.numel() == 0:
        return 0.0
    return ((a - e).square().mean().sqrt() / e.square().mean().sqrt().clamp_min(1e-30)).item()


def max_abs(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0


def against_oracle(inputs: list[torch.Tensor], bounds: list[int], *, l2: bool, h0: bool,
                   seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (ours, oracle)}`` for o, the final states and every gradient
    (NAMES) of a random loss over both outputs, on documents ``bounds``."""
    HV, K, V = inputs[2].shape[2], inputs[0].shape[3], inputs[2].shape[3]
    dtype = inputs[0].dtype
    cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
    N = len(bounds) - 1
    gen = torch.Generator().manual_seed(seed + 1)
    state0 = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64) * 0.5 if h0 else None

    ours_in = [x.clone().requires_grad_() for x in inputs]
    ref_in = [x.double().requires_grad_() for x in inputs]
    ours_s0 = state0.to(torch.float32 if dtype != torch.float64 else dtype).requires_grad_() if h0 else None
    ref_s0 = ours_s0.detach().double().requires_grad_() if h0 else None

    o, fs = chunk_gated_delta_rule(
        *ours_in, initial_state=ours_s0, output_final_state=True,
        use_qk_l2norm_in_kernel=l2, cu_seqlens=cu_seqlens,
    )
    ro, rfs = naive_recurrence(
        *ref_in, initial_state=ref_s0, output_final_state=True, use_qk_l2norm=l2, cu_seqlens=cu_seqlens
    )
    do = torch.randn(ro.shape, generator=gen, dtype=torch.float64)
    dfs = torch.randn(rfs.shape, generator=gen, dtype=torch.float64)
    leaves = ours_in + ([ours_s0] if h0 else [])
    ref_leaves = ref_in + ([ref_s0] if h0 else [])
    grads = torch.autograd.grad((o.double() * do).sum() + (fs.double() * dfs).sum(), leaves)
    ref_grads = torch.autograd.grad((ro * do).sum() + (rfs * dfs).sum(), ref_leaves)
    return dict(zip(NAMES, zip([o, fs, *grads], [ro, rfs, *ref_grads])))


def channel_gates(g: torch.Tensor, K: int, seed: int) -> torch.Tensor:
    """KDA gates ``[B, T, HV, K]`` from GDN's ``[B, T, HV]``: each channel a
    random multiple (0.2 to 3) of the head's gate, one token's channel 0 a hard
    reset (``-inf``) and another's channel 1 a strong decay (``-1000``)."""
    gen = torch.Generator().manual_seed(seed + 11)
    gk = g[..., None] * (0.2 + 2.8 * torch.rand(K, generator=gen)).to(g.dtype)
    T = g.shape[1]
    if T > 2 and K > 1:
        gk[:, T // 3, :, 0] = float("-inf")
        gk[:, 2 * T // 3, :, 1] = -1000.0
    return gk
