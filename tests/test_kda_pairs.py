"""KDA's intra-chunk pairs (``kernels/torch/_channel.py``) against the direct
``[C, C, K]`` forms in fp64: the scores ``sum_d a_id b_jd exp(G_id - G_jd)``
and their two pulls, finite gates, hard resets (``-inf``), and which pairs a
non-finite value may reach."""

from __future__ import annotations

import sys

import pytest
import torch

import gdn_kcp.kernels.torch._channel  # noqa: F401 (the module, for monkeypatch)
from gdn_kcp.kernels.torch._channel import SUB_CHUNK, causal_mask, channel_pulls, channel_scores

CHANNEL = sys.modules["gdn_kcp.kernels.torch._channel"]
NC, H, C, K = 3, 2, 64, 20


def direct_decays(g: torch.Tensor) -> torch.Tensor:
    """``exp(G_i - G_j)`` ``[NC, H, C, C, K]`` on ``i >= j`` (0 above), G the
    in-chunk cumsum of finite gates."""
    G = g.cumsum(-2)
    decays = (G[..., :, None, :] - G[..., None, :, :]).exp()  # inf above the diagonal past a reset
    return torch.where(causal_mask(C, False, g.device)[..., None], decays, 0.0)


def inputs(seed: int, decay: float = 2.0) -> tuple[torch.Tensor, ...]:
    """Gates uniform in ``(-decay, 0]``; a, b, x standard normal (x lower)."""
    gen = torch.Generator().manual_seed(seed)
    g = -torch.rand(NC, H, C, K, generator=gen, dtype=torch.float64) * decay
    a, b = torch.randn(2, NC, H, C, K, generator=gen, dtype=torch.float64)
    x = torch.randn(NC, H, C, C, generator=gen, dtype=torch.float64).tril()
    return g, a, b, x


def direct(g, a, b, x):
    E = direct_decays(g)
    scores = torch.einsum("nhid,nhjd,nhijd->nhij", a, b, E)
    lower = torch.einsum("nhij,nhjd,nhijd->nhid", x, b, E)
    upper = torch.einsum("nhij,nhid,nhijd->nhjd", x, a, E)
    return scores, lower, upper


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("decay", [2.0, 0.05])
@pytest.mark.parametrize("pieces", ["one", "per chunk"])
def test_pairs_are_the_direct_form(strict, decay, pieces, monkeypatch):
    """Every pair, across sub-chunks (anchored products) and inside one (offset
    by offset), equals the direct ``[C, C, K]`` form within fp64 rounding:
    at weak decay (0.05 a row) the pairs three sub-chunks apart keep most of
    their size, so a wrong far block cannot hide under the tolerance; in one
    piece and in a piece per chunk."""
    assert C % SUB_CHUNK == 0 and C // SUB_CHUNK > 2  # pairs inside, next to and beyond a sub-chunk
    if pieces == "per chunk":
        monkeypatch.setattr(CHANNEL, "PIECE_ELEMENTS", 1)
        assert len(CHANNEL._pieces(torch.zeros(NC, H, C, K))) == NC
    g, a, b, x = inputs(0, decay)
    scores, lower, upper = direct(g, a, b, x)
    keep = causal_mask(C, strict, g.device)
    torch.testing.assert_close(channel_scores(a, b, g, keep, "ieee"), scores * keep, rtol=0, atol=1e-12)
    ours_lower, ours_upper = channel_pulls(x, b, a, g, "ieee")
    torch.testing.assert_close(ours_lower, lower, rtol=0, atol=1e-12)
    torch.testing.assert_close(ours_upper, upper, rtol=0, atol=1e-12)


def test_a_hard_reset_zeroes_exactly_the_pairs_it_separates():
    """``-inf`` gates of one channel inside a sub-chunk, on a sub-chunk's
    first row, on anchors and on a chunk's first and last rows (weak decay
    elsewhere): every result finite and equal to the direct
    form with ``-60`` there (decays below 1e-26; a larger gate would cost
    the direct form's differences of cumsums their digits)."""
    g, a, b, x = inputs(1, 0.05)
    hard = g.clone()
    hard[0, 1, 21, 3] = hard[2, 0, SUB_CHUNK, 7] = float("-inf")  # inside a sub-chunk; its first row
    hard[1, 0, SUB_CHUNK - 1, 2] = hard[1, 1, 2 * SUB_CHUNK - 1, 2] = float("-inf")  # anchors r_0, r_1
    hard[0, 0, 0, 5] = hard[2, 1, C - 1, 9] = float("-inf")  # a chunk's first and last rows
    soft = torch.where(torch.isinf(hard), torch.full_like(hard, -60.0), hard)
    scores, lower, upper = direct(soft, a, b, x)
    keep = causal_mask(C, False, g.device)
    ours = channel_scores(a, b, hard, keep, "ieee")
    ours_lower, ours_upper = channel_pulls(x, b, a, hard, "ieee")
    for mine, want in ((ours, scores), (ours_lower, lower), (ours_upper, upper)):
        assert torch.isfinite(mine).all()
        torch.testing.assert_close(mine, want, rtol=0, atol=1e-12)


def test_a_non_finite_row_reaches_only_its_own_pairs():
    """A NaN in row j of b reaches the scores ``(i >= j, j)`` and nothing else
    (pairs are selected, never multiplied by zero); entries of the gradient x
    above its diagonal are never read."""
    g, a, b, x = inputs(2)
    for j in (5, SUB_CHUNK - 1, SUB_CHUNK, 40):
        bad = b.clone()
        bad[1, 0, j, 4] = float("nan")
        scores = channel_scores(a, bad, g, causal_mask(C, False, g.device), "ieee")
        reached = torch.isnan(scores)
        expected = torch.zeros_like(reached)
        expected[1, 0, j:, j] = True
        assert torch.equal(reached, expected), j
    upper_nan = x + torch.full_like(x, float("nan")).triu(1)
    for mine, want in zip(channel_pulls(upper_nan, b, a, g, "ieee"), channel_pulls(x, b, a, g, "ieee")):
        assert torch.equal(mine, want)


def test_a_traced_program_takes_fewer_larger_pieces():
    """Eager on the CPU, pieces of at most ``PIECE_ELEMENTS`` in-sub-chunk
    decays (the caches); traced, or on another device, of
    ``TRACED_PIECE_ELEMENTS`` (a graph holds each piece's ops once, a GPU
    launches them once a piece). T = 32768 at HV = 32, K = 128: 512 chunks."""
    from gdn_kcp.kernels.tracing import tracing

    g = torch.empty(1, 32, C, 128).expand(512, -1, -1, -1)  # no memory behind the 512 chunks
    per_chunk = 32 * C * 128 * (SUB_CHUNK - 1) // 2
    eager = CHANNEL._pieces(g)
    with tracing(True):
        traced = CHANNEL._pieces(g)
    rows = CHANNEL.TRACED_PIECE_ELEMENTS // per_chunk
    assert len(eager) == 512 and rows == 17
    assert [(p.start, p.stop) for p in traced] == [(start, start + rows) for start in range(0, 512, rows)]
    assert CHANNEL._pieces(g.to("meta")) == traced  # a device other than the CPU
