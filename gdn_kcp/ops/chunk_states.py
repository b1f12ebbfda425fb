"""The states at the starts of chunks smaller than the programs' 64 tokens
(``return_intermediate_states`` with FLA's ``chunk_size`` 16 or 32), from the
tapes of a ``save_mode="full"`` forward, in torch ops (inference only).

Inside a 64-token chunk with start state ``S0`` (the tape ``h``), the state
after its first ``s`` rows is the chunk form cut at ``s`` (the WY inverse is
lower triangular, so rows ``j < s`` of ``v_new`` depend on those rows only):

    S_s = Diag(exp(sum_{l < s} g_l)) S0 + sum_{j < s} (k_j * exp(sum_{j < l < s} g_l)) v_new_j^T

(a scalar decay per value head for GDN, per key channel for KDA). Each
exponent is the sum of exactly the gates it spans (docs/design.md, "KDA"), so a
``-inf`` gate gives an exact zero, never ``-inf - -inf``.
"""

from __future__ import annotations

import torch

from gdn_kcp.dtypes import compute_dtype
from gdn_kcp.kernels import ChunkIndex
from gdn_kcp.kernels.chunk_index import CHUNK_SIZE
from gdn_kcp.kernels.torch._chunks import chunk_gates, chunk_rows, load_qk, to_chunks


def sub_chunk_states(h: torch.Tensor, k: torch.Tensor, k_rstd: torch.Tensor | None, v_new: torch.Tensor,
                     g: torch.Tensor, gate_params: torch.Tensor | None, index: ChunkIndex,
                     chunk_size: int) -> torch.Tensor:
    """``[NC * 64 / chunk_size, HV, K, V]`` in h's dtype: the state at every
    ``chunk_size``-token start of every document, in order (document, chunk,
    row), the real ones first and zeros after (a fixed shape: no host read).

    h ``[NC, HV, K, V]`` (the state each 64-token chunk starts from; zeros on
    sentinel chunks), k ``[T, H_qk, K]`` with its reciprocal norms ``[T,
    H_qk]`` (or None), v_new ``[T, HV, V]`` (the forward's tape), g ``[T, HV]``
    or ``[T, HV, K]`` (raw with ``gate_params``, as the programs take them)."""
    if CHUNK_SIZE % chunk_size:
        raise ValueError(f"chunk_size = {chunk_size!r} must divide {CHUNK_SIZE}")
    cdt = compute_dtype(h.dtype)
    rows = chunk_rows(index)
    HV = h.shape[1]
    kc = load_qk(k, k_rstd, rows, cdt, HV)  # [NC, HV, C, K], padded rows zero
    vc = to_chunks(v_new, rows, cdt)  # [NC, HV, C, V]
    gates = chunk_gates(g, rows, cdt, gate_params)  # .g: [NC, HV, C] or [NC, HV, C, K], padded rows zero
    per_channel = gates.per_channel
    states = [h.to(cdt)]
    for s in range(chunk_size, CHUNK_SIZE, chunk_size):
        gs = gates.g[..., :s, :] if per_channel else gates.g[..., :s]
        axis = -2 if per_channel else -1
        # sum_{j < l < s} g_l for each row j < s: the gates after j up to s - 1, summed from s - 1 down
        after = gs.narrow(axis, 1, s - 1).flip(axis).cumsum(axis).flip(axis)
        after = torch.nn.functional.pad(after, (0, 0, 0, 1) if per_channel else (0, 1))
        decay = gs.sum(axis).exp()  # [NC, HV] or [NC, HV, K]
        weighted = kc[..., :s, :] * (after.exp() if per_channel else after.exp()[..., None])
        start = (decay[..., None] if per_channel else decay[..., None, None]) * states[0]
        states.append(start + weighted.mT @ vc[..., :s, :])
    stacked = torch.stack(states, 1).flatten(0, 1)  # [NC * r, HV, K, V], row (chunk, offset)
    offsets = torch.arange(0, CHUNK_SIZE, chunk_size, device=h.device)
    real = (offsets[None, :] < index.chunk_len.to(h.device)[:, None]).flatten()
    # the real rows first, in order: each to its rank among them; the rest to a dropped extra row
    n = real.shape[0]
    at = torch.where(real, real.long().cumsum(0) - 1, n)
    out = stacked.new_zeros(n + 1, *stacked.shape[1:])
    out.index_copy_(0, at, torch.where(real[:, None, None, None], stacked, stacked.new_zeros(())))
    return out[:n].to(h.dtype)
