"""Program #1, prep: per chunk the WY factors and the q/k norms.

    A = (I + strict_lower(diag(beta) K K^T * exp(G_i - G_j)))^-1
    W = A diag(beta * exp(G)) K           U = A diag(beta) V

(G: the gate cumsum inside the chunk; every later program sums the gates it
needs itself, see ``_chunks.chunk_gates``.)
"""

from __future__ import annotations

import torch

from ..chunk_index import ChunkIndex
from ..precision import accumulator_dtype, matmul_mode, mm
from ._chunks import causal_scores, chunk_gates, chunk_rows, from_chunks, l2_rstd, load_qk, lower_matmul
from ._chunks import chunk_beta, rows_reached, to_chunks

INVERSE_BLOCK = 16
"""Diagonal blocks of :func:`unit_lower_inverse` (a quarter of a chunk), inverted
exactly in the compute dtype (the Triton twin: substitution on their 8-row
halves, 7 steps instead of 63, and one merge); the rest is tensor-core products."""


def diagonal_block_inverse(L: torch.Tensor, block: int) -> torch.Tensor:
    """``(I + L)^-1`` on the ``[block, block]`` diagonal blocks of a strictly
    lower ``[..., C, C]`` L, zero off them: forward substitution in L's dtype
    (no operand rounding, as the Triton twin's substitution and fp32 merge)."""
    n = L.shape[-1] // block
    blocks = L.unflatten(-1, (n, block)).unflatten(-3, (n, block)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
    eye = torch.eye(block, dtype=L.dtype, device=L.device)
    inverse = torch.linalg.solve_triangular(blocks + eye, eye.expand_as(blocks), upper=False, unitriangular=True)
    out = torch.zeros(*L.shape[:-2], n, block, n, block, dtype=L.dtype, device=L.device)
    out.diagonal(dim1=-4, dim2=-2).copy_(inverse.movedim(-3, -1))
    return out.flatten(-4, -3).flatten(-2, -1)


def merge_blocks(L: torch.Tensor, block: int) -> torch.Tensor:
    """The ``M21`` blocks :func:`merge_lower_inverse` reads: L on its
    ``[2 block, 2 block]`` diagonal blocks but off the ``[block, block]`` ones,
    zero elsewhere."""
    o_i = torch.arange(L.shape[-1], device=L.device)
    same_pair = o_i[:, None] // (2 * block) == o_i[None, :] // (2 * block)
    m_21 = same_pair & (o_i[:, None] // block != o_i[None, :] // block)
    return torch.where(m_21, L, torch.zeros((), dtype=L.dtype, device=L.device))


def merge_lower_inverse(Ai: torch.Tensor, L: torch.Tensor, block: int, mode: str) -> torch.Tensor:
    """The inverses of ``I + L`` on its ``[2 block, 2 block]`` diagonal blocks
    from those on its ``[block, block]`` ones (``Ai``, zero off them):
    ``[[M11, 0], [M21, M22]]^-1 = [[Ai11, 0], [-Ai22 M21 Ai11, Ai22]]``, every
    block pair at once as two ``[C, C]`` products under the rule ``mode``
    (``(Ai M21) Ai``, the Triton twin's rounding points)."""
    M = merge_blocks(L, block)
    return Ai - mm(mm(Ai, M, mode), Ai, mode)


def unit_lower_inverse(L: torch.Tensor, mode: str) -> torch.Tensor:
    """``(I + L)^-1`` of a strictly lower ``[..., C, C]`` L (``C = 4 INVERSE_BLOCK``):
    the diagonal blocks by substitution, merged to ``2 INVERSE_BLOCK`` and ``C``
    with products under the rule ``mode``. A non-finite entry of L is zeroed and
    its row and every row after it made NaN: the dense products would spread
    ``0 * inf`` to rows before it, and row i of the inverse depends on rows
    ``<= i`` of L only.

    >>> L = torch.randn(64, 64, dtype=torch.float64).tril(-1) / 8
    >>> eye = torch.eye(64, dtype=torch.float64)
    >>> bool(torch.allclose(unit_lower_inverse(L, "ieee") @ (eye + L), eye))
    True
    """
    assert L.shape[-1] == 4 * INVERSE_BLOCK, L.shape
    finite = torch.isfinite(L)
    L = torch.where(finite, L, torch.zeros((), dtype=L.dtype, device=L.device))
    Ai = diagonal_block_inverse(L, INVERSE_BLOCK)
    Ai = merge_lower_inverse(Ai, L, INVERSE_BLOCK, mode)
    Ai = merge_lower_inverse(Ai, L, 2 * INVERSE_BLOCK, mode)
    return torch.where(rows_reached(finite), torch.full((), float("nan"), dtype=Ai.dtype, device=Ai.device), Ai)


def prep(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    beta_sigmoid: bool = False,
    beta_scale: float = 1.0,
    A_out: torch.Tensor,
    w_out: torch.Tensor,
    u_out: torch.Tensor,
    q_rstd_out: torch.Tensor | None = None,
    k_rstd_out: torch.Tensor | None = None,
) -> None:
    """Fill the prep tapes.

    q, k: ``[T, H_qk, K]``; v: ``[T, HV, V]``; g, beta: ``[T, HV]`` (g per
    key channel, KDA: ``[T, HV, K]``).
    Writes A_out ``[T, HV, C]`` (row i of its chunk's A: the Triton twin's W, U
    launch reads it back, so a forward without a backward still binds it),
    w_out ``[T, HV, K]``, u_out ``[T, HV, V]``, each computed in fp32 (fp64
    for fp64 inputs) and rounded to its own dtype. With ``q_rstd_out`` /
    ``k_rstd_out`` (``[T, H_qk]``) given, q and k are L2-normalised and their
    reciprocal norms written there.
    """
    cdt = accumulator_dtype(k.dtype)
    HV = v.shape[1]
    rows = chunk_rows(index)
    k_rstd = None
    if k_rstd_out is not None:
        q_rstd_out.copy_(l2_rstd(q, cdt))
        k_rstd_out.copy_(l2_rstd(k, cdt))
        k_rstd = k_rstd_out
    gates = chunk_gates(g, rows, cdt, gate_params)
    kc = load_qk(k, k_rstd, rows, cdt, HV)
    bc, _ = chunk_beta(beta, rows, cdt, beta_sigmoid, beta_scale)
    mode = matmul_mode(k.dtype)
    strict = causal_scores(bc[..., None] * kc, kc, gates, strict=True, mode=mode)
    A = unit_lower_inverse(strict, mode)
    from_chunks(A, rows, A_out)
    write_w_u(A, kc, bc, gates, v, rows, mode, w_out, u_out)


def write_w_u(A, kc, bc, gates, v, rows, mode: str, w_out: torch.Tensor, u_out: torch.Tensor) -> None:
    """W and U of chunked A, k, beta and gates into ``w_out`` / ``u_out``. The
    products round A to the input dtype (``mode``), the dtype of prep's
    ``A_out``: from the A prep holds or from the one it wrote, the same bits."""
    from_chunks(lower_matmul(A, bc[..., None] * gates.rows(torch.exp(gates.cum)) * kc, mode), rows, w_out)
    from_chunks(lower_matmul(A, bc[..., None] * to_chunks(v, rows, A.dtype), mode), rows, u_out)


def w_u(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    index: ChunkIndex,
    *,
    gate_params: torch.Tensor | None = None,
    beta_sigmoid: bool = False,
    beta_scale: float = 1.0,
    k_rstd: torch.Tensor | None = None,
    w_out: torch.Tensor,
    u_out: torch.Tensor,
) -> None:
    """Prep's second half from a written A (``[T, HV, C]``, as prep's
    ``A_out``): w_out ``[T, HV, K]`` and u_out ``[T, HV, V]``, the products
    at A's own rounding (its dtype is the products' operand dtype, so W and U
    equal prep's). With ``k_rstd`` (``[T, H_qk]``) k is L2-normalised. The
    backward of ``save_mode="inverse"`` runs it on the saved A."""
    cdt = accumulator_dtype(k.dtype)
    rows = chunk_rows(index)
    gates = chunk_gates(g, rows, cdt, gate_params)
    kc = load_qk(k, k_rstd, rows, cdt, v.shape[1])
    bc, _ = chunk_beta(beta, rows, cdt, beta_sigmoid, beta_scale)
    write_w_u(to_chunks(A, rows, cdt), kc, bc, gates, v, rows, matmul_mode(k.dtype), w_out, u_out)
