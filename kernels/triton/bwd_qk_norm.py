"""Backward (Triton): the GVA sum of q/k gradients over each key head's value
heads, then the L2-norm backward ``dx = rstd (dy - y <dy, y>)``; one program per
(token block, key head). Same signature as ``kernels.torch.bwd_qk_norm``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import acc_dtype, head_block, launch, load_rows_cols, load_scalars, store_rows_cols

BT_NORM = 16
"""Tokens per program: an elementwise kernel; [64, 128] fp32 tiles took 255
registers and spilled 1,392 B per thread on sm_90 (compile_specs --report)."""


@triton.jit
def bwd_qk_norm_kernel(dy_heads, x, rstd, dx, T, H_qk, HV, K,
                       BT: tl.constexpr, BK: tl.constexpr, HAS_NORM: tl.constexpr, ACC: tl.constexpr):
    i_t, i_hk = tl.program_id(0), tl.program_id(1)
    group = HV // H_qk
    tok = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    m_t = tok < T
    dy = tl.zeros([BT, BK], dtype=ACC)
    for i in range(0, group):
        dy += load_rows_cols(dy_heads, tok, m_t, HV, i_hk * group + i, K, 0, BK, ACC)
    if HAS_NORM:
        r = load_scalars(rstd, tok, m_t, H_qk, i_hk, ACC)[:, None]
        y = load_rows_cols(x, tok, m_t, H_qk, i_hk, K, 0, BK, ACC) * r
        dy = r * (dy - y * tl.sum(dy * y, 1)[:, None])
    store_rows_cols(dx, dy, tok, m_t, H_qk, i_hk, K, 0, BK)


def bwd_qk_norm(
    dq_heads: torch.Tensor,
    dk_heads: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    q_rstd: torch.Tensor | None,
    k_rstd: torch.Tensor | None,
    dq_out: torch.Tensor,
    dk_out: torch.Tensor,
) -> None:
    """See ``kernels.torch.bwd_qk_norm``."""
    T, H_qk, K = q.shape
    if T == 0:
        return
    for dy, x, rstd, out in ((dq_heads, q, q_rstd, dq_out), (dk_heads, k, k_rstd, dk_out)):
        launch(bwd_qk_norm_kernel)[(triton.cdiv(T, BT_NORM), H_qk)](
            dy, x, rstd if rstd is not None else dy, out, T, H_qk, dy.shape[1], K,
            BT=BT_NORM, BK=head_block(K), HAS_NORM=rstd is not None, ACC=acc_dtype(x),
        )
