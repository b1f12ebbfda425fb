"""Seeded GDN inputs and the comparison helpers the tests share."""

from __future__ import annotations

import random

import torch


def make_inputs(
    T: int,
    H_qk: int,
    HV: int,
    K: int,
    V: int,
    *,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    l2: bool = False,
    B: int = 1,
) -> list[torch.Tensor]:
    """q, k ``[B, T, H_qk, K]``, v ``[B, T, HV, V]``, g, beta ``[B, T, HV]``.

    Without the in-kernel norm, k is given unit rows (the recurrence is only
    contractive for ``beta ||k||^2 < 2``, as in a trained model); with it, q and
    k are raw Gaussians that the kernel normalises.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = randn(B, T, H_qk, K), randn(B, T, H_qk, K)
    if not l2:
        q = q / q.norm(dim=-1, keepdim=True)
        k = k / k.norm(dim=-1, keepdim=True)
    v = randn(B, T, HV, V)
    g = torch.nn.functional.logsigmoid(randn(B, T, HV) + 4.0)  # exp(g) ~ 0.98: states live ~50 tokens
    beta = torch.sigmoid(randn(B, T, HV))
    return [x.to(dtype) for x in (q, k, v, g, beta)]


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
