"""One chunk step of the state walk and of the adjoint walk, shared by the
programs that walk (tape walk, summary walk, adjoint walk, adjoint summary)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..precision import matmul_mode, mm
from ._chunks import ChunkRows, chunk_gates, load_qk, scalars_to_chunks, to_chunks


class WalkOperands(NamedTuple):
    """Per chunk: ``w`` and ``k`` ``[NC, HV, C, K]`` as stored (k's head repeated
    per value head), ``k_scale = gamma_C / gamma`` (times k's reciprocal norm)
    ``[NC, HV, C]``, ``gamma_last = gamma_C`` ``[NC, HV]``. The steps put
    ``k_scale`` on the value side of their K products, ``K^T diag(k_scale) V``
    and ``diag(k_scale) (K dS)``, as the Triton walks do (no scaled copy of K)."""

    w: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor
    gamma_last: torch.Tensor
    mode: str  # the precision rule of the products (kernels.precision)


def head_scalars(x: torch.Tensor, rows: ChunkRows, dtype: torch.dtype, n_value_heads: int) -> torch.Tensor:
    """Per-token scalars of the key heads ``[T, H_qk]`` -> ``[NC, HV, C]`` (a norm's
    reciprocal), key head ``i // (HV // H_qk)`` repeated for value head ``i``."""
    return scalars_to_chunks(x, rows, dtype).repeat_interleave(n_value_heads // x.shape[1], dim=1)


def walk_operands(
    k: torch.Tensor, k_rstd: torch.Tensor | None, w: torch.Tensor, g: torch.Tensor, rows: ChunkRows,
    dtype: torch.dtype, gate_params: torch.Tensor | None = None,
) -> WalkOperands:
    """The walk's per-chunk operands; products under the rule of k's dtype."""
    HV = w.shape[1]
    gates = chunk_gates(g, rows, dtype, gate_params)
    k_scale = torch.exp(gates.tail)
    if k_rstd is not None:
        k_scale = k_scale * head_scalars(k_rstd, rows, dtype, HV)
    return WalkOperands(to_chunks(w, rows, dtype), load_qk(k, None, rows, dtype, HV), k_scale,
                        torch.exp(gates.cum[..., -1]), matmul_mode(k.dtype))


def state_step(ops: WalkOperands, u: torch.Tensor, c: torch.Tensor, S: torch.Tensor):
    """Chunks ``c`` ``[F]`` from start states ``S`` ``[F, HV, K, V]`` (u in chunk
    layout): returns ``(v_new, S_end)``."""
    vn = u[c] - mm(ops.w[c], S, ops.mode)
    return vn, ops.gamma_last[c][..., None, None] * S + mm(ops.k[c].mT, ops.k_scale[c][..., None] * vn, ops.mode)


def adjoint_step(
    ops: WalkOperands, dv_local: torch.Tensor, q_decayed_do: torch.Tensor, c: torch.Tensor, dS: torch.Tensor
):
    """Chunks ``c`` ``[F]`` from end adjoints ``dS`` ``[F, HV, K, V]``; ``q_decayed_do``
    is ``scale (diag(gamma) Q)^T dO`` per chunk ``[NC, HV, K, V]``. Returns
    ``(dv_new, dS_start)``."""
    dvn = dv_local[c] + ops.k_scale[c][..., None] * mm(ops.k[c], dS, ops.mode)
    return dvn, ops.gamma_last[c][..., None, None] * dS + q_decayed_do[c] - mm(ops.w[c].mT, dvn, ops.mode)


def q_decayed_do(
    q: torch.Tensor, q_rstd: torch.Tensor | None, do: torch.Tensor, g: torch.Tensor, rows: ChunkRows,
    dtype: torch.dtype, scale: float, gate_params: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scale (diag(gamma) Q)^T dO`` per chunk, ``[NC, HV, K, V]``: the output's
    pull on the chunk's start state (the row scale on dO, Q as stored)."""
    HV = do.shape[1]
    q_scale = scale * torch.exp(chunk_gates(g, rows, dtype, gate_params).cum)
    if q_rstd is not None:
        q_scale = q_scale * head_scalars(q_rstd, rows, dtype, HV)
    qc = load_qk(q, None, rows, dtype, HV)
    return mm(qc.mT, q_scale[..., None] * to_chunks(do, rows, dtype), matmul_mode(q.dtype))
