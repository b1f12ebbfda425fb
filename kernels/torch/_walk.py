"""One chunk step of the state walk and of the adjoint walk, shared by the
programs that walk (tape walk, summary walk, adjoint walk, adjoint summary)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch

from ..precision import matmul_mode, mm, pull, pull_mode, round_operands
from ._chunks import ChunkRows, chunk_gates, load_qk, scalars_to_chunks, to_chunks


class WalkOperands(NamedTuple):
    """Per chunk: ``w`` and ``k`` ``[NC, HV, C, K]`` (k L2-normalised when a norm
    is given, its head repeated per value head), ``k_scale = gamma_C / gamma``
    ``[NC, HV, C]``, ``gamma_last = gamma_C`` ``[NC, HV]``. The steps put the
    decay ``k_scale`` (at most 1) on the value side of their K products,
    ``K^T diag(k_scale) V`` and ``diag(k_scale) (K dS)``, as the Triton walks
    do (no decayed copy of K). Per-channel gates (KDA) cannot go on the value
    side: there ``k`` is the decayed ``K * exp(G_C - G)`` (every exponent <= 0),
    ``k_scale`` is None and ``gamma_last`` is ``[NC, HV, K]``, a row scale of the state."""

    w: torch.Tensor
    k: torch.Tensor
    k_scale: torch.Tensor | None
    gamma_last: torch.Tensor
    mode: str  # the precision rule of the products (kernels.precision)


def walk_operands(
    k: torch.Tensor, k_rstd: torch.Tensor | None, w: torch.Tensor, g: torch.Tensor, rows: ChunkRows,
    dtype: torch.dtype, gate_params: torch.Tensor | None = None, k_decayed: torch.Tensor | None = None,
    chunk_decay: torch.Tensor | None = None,
) -> WalkOperands:
    """The walk's per-chunk operands; products under the rule of k's dtype.
    A gate per key channel may come with its decays already formed
    (``k_decayed`` ``[T, HV, K]``, ``chunk_decay`` ``[NC, HV, K]``:
    :func:`.channel_decays.channel_decays`), read in place of K's and g's."""
    HV = w.shape[1]
    if k_decayed is not None:
        return WalkOperands(to_chunks(w, rows, dtype), to_chunks(k_decayed, rows, dtype), None,
                            chunk_decay.to(dtype), matmul_mode(k.dtype))
    gates = chunk_gates(g, rows, dtype, gate_params)
    kc = load_qk(k, k_rstd, rows, dtype, HV)
    gamma_last = torch.exp(gates.last)
    if gates.per_channel:
        return WalkOperands(to_chunks(w, rows, dtype), kc * torch.exp(gates.tail), None, gamma_last,
                            matmul_mode(k.dtype))
    return WalkOperands(to_chunks(w, rows, dtype), kc, torch.exp(gates.tail), gamma_last, matmul_mode(k.dtype))


def forward_steps(index) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Step j of a forward walk over ``index`` (a :class:`ChunkIndex`):
    ``(active, c)``, the fragments that have a chunk j and that chunk of
    every fragment ``[F]`` (clamped to a valid chunk where there is none)."""
    last_chunk = max(index.n_chunks - 1, 0)
    for j in range(index.max_frag_chunks):
        yield index.frag_n_chunks > j, (index.frag_first_chunk.long() + j).clamp(max=last_chunk)


def decay_state(gamma_last: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """``gamma_C S`` for states ``[F, HV, K, X]``: a scalar per head, or per key row (KDA)."""
    return (gamma_last[..., None] if gamma_last.dim() == 3 else gamma_last[..., None, None]) * S


def state_step(ops: WalkOperands, u: torch.Tensor, c: torch.Tensor, S: torch.Tensor):
    """Chunks ``c`` ``[F]`` from start states ``S`` ``[F, HV, K, V]`` (u in chunk
    layout): returns ``(v_new, S_end)``."""
    vn = u[c] - mm(ops.w[c], S, ops.mode)
    decayed_vn = vn if ops.k_scale is None else ops.k_scale[c][..., None] * vn
    return vn, decay_state(ops.gamma_last[c], S) + mm(ops.k[c].mT, decayed_vn, ops.mode)


def adjoint_step(
    ops: WalkOperands, dv_local: torch.Tensor, q_decayed_do: torch.Tensor, c: torch.Tensor, dS: torch.Tensor
):
    """Chunks ``c`` ``[F]`` from end adjoints ``dS`` ``[F, HV, K, V]``; ``q_decayed_do``
    is ``scale (diag(gamma) Q)^T dO`` per chunk ``[NC, HV, K, V]``. Returns
    ``(dv_new, dS_start)``."""
    pulled = mm(ops.k[c], dS, ops.mode)
    dvn = dv_local[c] + (pulled if ops.k_scale is None else ops.k_scale[c][..., None] * pulled)
    return dvn, decay_state(ops.gamma_last[c], dS) + q_decayed_do[c] - mm(ops.w[c].mT, dvn, ops.mode)


def q_decayed_do(
    q: torch.Tensor, q_rstd: torch.Tensor | None, do: torch.Tensor, g: torch.Tensor, rows: ChunkRows,
    dtype: torch.dtype, scale: float, gate_params: torch.Tensor | None = None, q_decayed: torch.Tensor | None = None,
) -> torch.Tensor:
    """``scale (diag(gamma) Q)^T dO`` per chunk, ``[NC, HV, K, V]``: the output's
    pull on the chunk's start state. The decay, the scale and q's reciprocal
    norm go on dO (no decayed copy of Q; the raw q is exact in its dtype), the
    product runs under :func:`gdn_kcp.kernels.precision.pull_mode`. A per-channel
    decay (KDA) goes on Q instead, read as the tensor cores read an operand
    (``q_decayed`` ``[T, HV, K]``: that operand already formed, from raw q,
    :func:`.channel_decays.channel_decays`)."""
    HV = do.shape[1]
    mode = matmul_mode(q.dtype)
    doc = to_chunks(do, rows, dtype)
    gates = None if q_decayed is not None else chunk_gates(g, rows, dtype, gate_params)
    per_channel = gates is None or gates.per_channel
    factor = doc.new_full(doc.shape[:-1], scale) if per_channel else scale * torch.exp(gates.cum)
    if q_rstd is not None:
        factor = factor * scalars_to_chunks(q_rstd, rows, dtype).repeat_interleave(HV // q.shape[1], dim=1)
    if q_decayed is not None:
        qc = to_chunks(q_decayed, rows, dtype)
    else:
        qc = load_qk(q, None, rows, dtype, HV)
        if per_channel:
            qc, = round_operands(mode, qc * torch.exp(gates.cum))
    return pull(qc.mT, factor[..., None] * doc, pull_mode(mode))
