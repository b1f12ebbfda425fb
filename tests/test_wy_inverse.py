"""The blocked WY inverse ``(I + L)^-1`` of prep (both twins): 16x16 diagonal
blocks inverted exactly (torch: a triangular solve; Triton: substitution on their
8x8 halves and an fp32 merge), merged to 32 and 64 with products under the precision
rule. Against ``torch.linalg.solve_triangular`` in fp64: exact to fp64 rounding
for fp64, and within the bound of its rounding points for bf16 products."""

from __future__ import annotations

import pytest
import torch
from gdn_kcp.kernels import CHUNK_SIZE
from gdn_kcp.kernels.torch.prep import INVERSE_BLOCK, merge_blocks, unit_lower_inverse

triton = pytest.importorskip("triton")
tl = triton.language

from gdn_kcp.kernels.triton._common import mm_mode
from gdn_kcp.kernels.triton.wy_inverse import BC
from gdn_kcp.kernels.triton.wy_inverse import unit_lower_inverse as triton_unit_lower_inverse

C = CHUNK_SIZE
BF16_UNIT_ROUNDOFF = 2.0**-8  # round to nearest with 8 significant bits
FP32_UNIT_ROUNDOFF = 2.0**-24


@triton.jit
def inverse_kernel(L, A, BT: tl.constexpr, MM: tl.constexpr):
    """``A[b] = (I + L[b])^-1`` of ``[B, BT, BT]`` chunk matrices; grid (B,)."""
    o_i = tl.arange(0, BT)
    p = tl.program_id(0).to(tl.int64) * BT * BT + o_i[:, None] * BT + o_i[None, :]
    tl.store(A + p, triton_unit_lower_inverse(tl.load(L + p), BC, MM))


def chunk_matrices(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``[6, C, C]`` strictly lower ``L = beta_i (k_i . k_j) exp(G_i - G_j)`` as
    prep builds it: unit keys with the test inputs' gates and betas (K = 16, 32,
    128), then keys around a shared direction (|cos| ~ 0.8) with betas up to 2
    (FLA's allow_neg_eigval): inverses with entries past 1 and cancelling sums."""
    gen = torch.Generator().manual_seed(31)
    mats = []
    for K, shared, beta_scale in ((16, 0.0, 1.0), (32, 0.0, 1.0), (128, 0.0, 1.0), (32, 2.0, 1.0), (32, 2.0, 2.0),
                                  (128, 4.0, 2.0)):
        k = torch.randn(C, K, generator=gen, dtype=torch.float64) + shared * torch.randn(K, generator=gen,
                                                                                         dtype=torch.float64)
        k = k / k.norm(dim=-1, keepdim=True)
        beta = beta_scale * torch.sigmoid(torch.randn(C, generator=gen, dtype=torch.float64))
        G = torch.nn.functional.logsigmoid(torch.randn(C, generator=gen, dtype=torch.float64) + 4.0).cumsum(0)
        mats.append((beta[:, None] * (k @ k.T) * torch.exp(G[:, None] - G[None, :])).tril(-1))
    return torch.stack(mats).to(dtype)


def reference(L: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(C, dtype=torch.float64)
    return torch.linalg.solve_triangular(eye + L.double(), eye.expand(L.shape), upper=False, unitriangular=True)


def triton_inverse(L: torch.Tensor, mode: str) -> torch.Tensor:
    A = torch.empty_like(L)
    inverse_kernel[(L.shape[0],)](L.contiguous(), A, BT=C, MM=mode)
    return A


def blocked_inverse(L: torch.Tensor, backend: str, mode: str) -> torch.Tensor:
    """The inverse under the rule ``mode`` (the torch name; the Triton kernel
    takes :func:`mm_mode`'s, which under the interpreter emulates bf16)."""
    if backend == "torch":
        return unit_lower_inverse(L, mode)
    return triton_inverse(L, mm_mode(torch.empty(0, dtype=torch.bfloat16)) if mode == "bf16" else mode)


def rounding_bound(L: torch.Tensor, u: float) -> torch.Tensor:
    """Elementwise bound on ``|A - (I + L)^-1|`` for merge products whose four
    operands (``Ai22``, ``M21``, their product, ``Ai11``) are each rounded with
    relative error at most u: ``((1 + u)^4 - 1) |Ai22| |M21| |Ai11|`` per merge,
    plus, at the second merge, what the first merge's error ``E`` carries:
    ``|E| |M21| |Ai11| + |Ai22| |M21| |E| + |E| |M21| |E|`` (fp64, exact inverses)."""
    L = L.double()
    o_i = torch.arange(C)
    bound = torch.zeros_like(L)
    for block in (INVERSE_BLOCK, 2 * INVERSE_BLOCK):
        on_blocks = (o_i[:, None] // block == o_i[None, :] // block).double()
        exact = reference(L * on_blocks).abs() * on_blocks  # |inverses on the diagonal blocks|
        M = merge_blocks(L, block).abs()
        bound = (bound + ((1 + u) ** 4 - 1) * exact @ M @ exact + bound @ M @ exact + exact @ M @ bound
                 + bound @ M @ bound)
    return bound


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp64_inverse_is_exact_to_fp64_rounding(backend):
    L = chunk_matrices()
    ref = reference(L)
    assert ref.abs().max() > 1.5  # the correlated chunks
    err = (blocked_inverse(L, backend, "ieee") - ref).abs().amax((-2, -1))
    assert (err <= 1e-14 * ref.abs().amax((-2, -1)) ** 2).all(), err


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_products_within_their_rounding_bound(backend):
    """fp32 substitution, bf16 operands in the merges: the error stays within
    :func:`rounding_bound` (plus fp32 rounding, ``C u_fp32`` of the entries)."""
    L = chunk_matrices(torch.float32)
    ref = reference(L)
    err = (blocked_inverse(L, backend, "bf16").double() - ref).abs()
    bound = rounding_bound(L, BF16_UNIT_ROUNDOFF) + C * FP32_UNIT_ROUNDOFF * ref.abs().amax((-2, -1), keepdim=True)
    assert (err <= bound).all(), (err / bound).max()
    assert (err / bound).max() > 0.05  # the bound is not vacuous
    diagonal_blocks = (torch.arange(C)[:, None] // INVERSE_BLOCK == torch.arange(C)[None, :] // INVERSE_BLOCK)
    assert (err[:, diagonal_blocks] <= C * FP32_UNIT_ROUNDOFF * ref.abs().max()).all()  # never rounded to bf16


def test_bf16_twins_round_at_the_same_points():
    """Under bf16 products the Triton inverse and its torch twin round the
    same operands at the same points, so they differ only where an fp32 sum
    taken in another order lands across a bf16 rounding boundary: at most
    8.2e-6 of a chunk's largest entry (1.5e-8 to 1.8e-7 in five of the six).
    A merge product left unrounded (or rounded once more) moves entries by
    3e-4 to 2.6e-3 of it, inside :func:`rounding_bound`, so the test above
    cannot see it."""
    L = chunk_matrices(torch.float32)
    gap = (blocked_inverse(L, "triton", "bf16").double() - blocked_inverse(L, "torch", "bf16").double()).abs()
    scale = reference(L).abs().amax((-2, -1))
    assert (gap.amax((-2, -1)) <= 1e-4 * scale).all(), gap.amax((-2, -1)) / scale


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["ieee", "bf16"])
def test_a_non_finite_entry_reaches_only_its_row_and_later_rows(backend, mode):
    """A NaN or inf of L in row t (each 16-row block, and a row's first entry)
    leaves rows before t bitwise as without it and makes rows t on NaN."""
    L = chunk_matrices(torch.float32)[:4]
    clean = blocked_inverse(L, backend, mode)
    poisoned, rows = L.clone(), (5, 16, 40, 63)
    for b, t in enumerate(rows):
        poisoned[b, t, t // 2] = float("nan") if b % 2 else float("inf")
        poisoned[b, t + 1:, t] = float("nan")  # a k or gate NaN also fills column t below the diagonal
    A = blocked_inverse(poisoned, backend, mode)
    for b, t in enumerate(rows):
        assert torch.equal(A[b, :t], clean[b, :t]), (b, t)
        assert A[b, t:].isnan().all(), (b, t)
