"""Program #1, prep: per chunk the gate cumsum, the WY factors and q/k norms.

    G = cumsum(g)                         (inside each chunk)
    A = (I + strict_lower(diag(beta) K K^T * exp(G_i - G_j)))^-1
    W = A diag(beta * exp(G)) K           U = A diag(beta) V
"""

from __future__ import annotations

import torch

from ..chunk_index import ChunkIndex
from ._chunks import causal_decay, chunk_rows, from_chunks, l2_rstd, load_qk, scalars_to_chunks, to_chunks


def prep(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    index: ChunkIndex,
    *,
    gcum_out: torch.Tensor,
    A_out: torch.Tensor | None,
    w_out: torch.Tensor,
    u_out: torch.Tensor,
    q_rstd_out: torch.Tensor | None = None,
    k_rstd_out: torch.Tensor | None = None,
) -> None:
    """Fill the prep tapes.

    q, k: ``[T, H_qk, K]``; v: ``[T, HV, V]``; g, beta: ``[T, HV]``.
    Writes gcum_out ``[T, HV]``, A_out ``[T, HV, C]`` (row i of its chunk's A;
    None when no backward reads it),
    w_out ``[T, HV, K]``, u_out ``[T, HV, V]``, all in the compute dtype
    (``gcum_out.dtype``). With ``q_rstd_out`` / ``k_rstd_out`` (``[T, H_qk]``)
    given, q and k are L2-normalised and their reciprocal norms written there.
    """
    cdt = gcum_out.dtype
    HV = v.shape[1]
    rows = chunk_rows(index)
    k_rstd = None
    if k_rstd_out is not None:
        q_rstd_out.copy_(l2_rstd(q, cdt))
        k_rstd_out.copy_(l2_rstd(k, cdt))
        k_rstd = k_rstd_out
    G = scalars_to_chunks(g, rows, cdt).cumsum(-1)  # padded g is 0: padded G is G_last
    kc = load_qk(k, k_rstd, rows, cdt, HV)
    bc = scalars_to_chunks(beta, rows, cdt)
    strict = (bc[..., :, None] * (kc @ kc.mT)) * causal_decay(G, strict=True)
    eye = torch.eye(strict.shape[-1], dtype=cdt, device=strict.device)
    A = torch.linalg.solve_triangular(strict + eye, eye.expand_as(strict), upper=False, unitriangular=True)
    from_chunks(G, rows, gcum_out)
    if A_out is not None:
        from_chunks(A, rows, A_out)
    from_chunks(A @ ((bc * torch.exp(G))[..., None] * kc), rows, w_out)
    from_chunks(A @ (bc[..., None] * to_chunks(v, rows, cdt)), rows, u_out)
