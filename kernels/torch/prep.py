"""Program #1, prep: per chunk the WY factors and the q/k norms.

    A = (I + strict_lower(diag(beta) K K^T * exp(G_i - G_j)))^-1
    W = A diag(beta * exp(G)) K           U = A diag(beta) V

(G: the gate cumsum inside the chunk; every later program sums the gates it
needs itself, see ``_chunks.chunk_gates``.)
"""

from __future__ import annotations

import torch

from ..chunk_index import ChunkIndex
from ..precision import matmul_mode
from ._chunks import causal_scores, chunk_gates, chunk_rows, from_chunks, l2_rstd, load_qk, lower_matmul
from ._chunks import chunk_beta, to_chunks


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
    A_out: torch.Tensor | None,
    w_out: torch.Tensor,
    u_out: torch.Tensor,
    q_rstd_out: torch.Tensor | None = None,
    k_rstd_out: torch.Tensor | None = None,
) -> None:
    """Fill the prep tapes.

    q, k: ``[T, H_qk, K]``; v: ``[T, HV, V]``; g, beta: ``[T, HV]``.
    Writes A_out ``[T, HV, C]`` (row i of its chunk's A; None when no backward
    reads it), w_out ``[T, HV, K]``, u_out ``[T, HV, V]``, all in the compute
    dtype (``w_out.dtype``). With ``q_rstd_out`` / ``k_rstd_out`` (``[T, H_qk]``)
    given, q and k are L2-normalised and their reciprocal norms written there.
    """
    cdt = w_out.dtype
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
    eye = torch.eye(strict.shape[-1], dtype=cdt, device=strict.device)
    # forward substitution: row i of A reads rows <= i of L only
    A = torch.linalg.solve_triangular(strict + eye, eye.expand_as(strict), upper=False, unitriangular=True)
    if A_out is not None:
        from_chunks(A, rows, A_out)
    from_chunks(lower_matmul(A, (bc * torch.exp(gates.cum))[..., None] * kc, mode), rows, w_out)
    from_chunks(lower_matmul(A, bc[..., None] * to_chunks(v, rows, cdt), mode), rows, u_out)
