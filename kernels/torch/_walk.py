"""One chunk step of the state walk and of the adjoint walk, shared by the
programs that walk (tape walk, summary walk, adjoint walk, adjoint summary)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..precision import matmul_mode, mm
from ._chunks import ChunkRows, chunk_gates, load_qk, to_chunks


class WalkOperands(NamedTuple):
    """Per chunk: ``w`` ``[NC, HV, C, K]``, ``k_decayed = diag(gamma_C / gamma) K``
    ``[NC, HV, C, K]``, ``gamma_last = gamma_C`` ``[NC, HV]``."""

    w: torch.Tensor
    k_decayed: torch.Tensor
    gamma_last: torch.Tensor
    mode: str  # the precision rule of the products (kernels.precision)


def walk_operands(
    k: torch.Tensor, k_rstd: torch.Tensor | None, w: torch.Tensor, g: torch.Tensor, rows: ChunkRows,
    dtype: torch.dtype, gate_params: torch.Tensor | None = None,
) -> WalkOperands:
    """The walk's per-chunk operands; products under the rule of k's dtype."""
    HV = w.shape[1]
    gates = chunk_gates(g, rows, dtype, gate_params)
    k_decayed = torch.exp(gates.tail)[..., None] * load_qk(k, k_rstd, rows, dtype, HV)
    return WalkOperands(to_chunks(w, rows, dtype), k_decayed, torch.exp(gates.cum[..., -1]), matmul_mode(k.dtype))


def state_step(ops: WalkOperands, u: torch.Tensor, c: torch.Tensor, S: torch.Tensor):
    """Chunks ``c`` ``[F]`` from start states ``S`` ``[F, HV, K, V]`` (u in chunk
    layout): returns ``(v_new, S_end)``."""
    vn = u[c] - mm(ops.w[c], S, ops.mode)
    return vn, ops.gamma_last[c][..., None, None] * S + mm(ops.k_decayed[c].mT, vn, ops.mode)


def adjoint_step(
    ops: WalkOperands, dv_local: torch.Tensor, q_decayed_do: torch.Tensor, c: torch.Tensor, dS: torch.Tensor
):
    """Chunks ``c`` ``[F]`` from end adjoints ``dS`` ``[F, HV, K, V]``; ``q_decayed_do``
    is ``scale (diag(gamma) Q)^T dO`` per chunk ``[NC, HV, K, V]``. Returns
    ``(dv_new, dS_start)``."""
    dvn = dv_local[c] + mm(ops.k_decayed[c], dS, ops.mode)
    return dvn, ops.gamma_last[c][..., None, None] * dS + q_decayed_do[c] - mm(ops.w[c].mT, dvn, ops.mode)


def q_decayed_do(
    q: torch.Tensor, q_rstd: torch.Tensor | None, do: torch.Tensor, g: torch.Tensor, rows: ChunkRows,
    dtype: torch.dtype, scale: float, gate_params: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scale (diag(gamma) Q)^T dO`` per chunk, ``[NC, HV, K, V]``: the output's
    pull on the chunk's start state."""
    HV = do.shape[1]
    gamma = torch.exp(chunk_gates(g, rows, dtype, gate_params).cum)
    qc = load_qk(q, q_rstd, rows, dtype, HV)
    return mm((scale * gamma[..., None] * qc).mT, to_chunks(do, rows, dtype), matmul_mode(q.dtype))
