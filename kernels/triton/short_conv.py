"""The short causal convolution with SiLU (Triton): one launch over every
channel of q, k and v together. Same signatures as ``kernels.torch.short_conv``.

Forward: grid (token blocks, channel blocks), W shifted tile loads per block.
Backward: pre is recomputed (nothing but the inputs is kept). The input
gradient runs over the source rows ``[-(W - 1), T)`` (the halo's rows first);
each reads dpre at ``s .. s + W - 1``, so it recomputes W rows of pre per row
(W^2 tile loads: 16 at W = 4, from L2). The weight and bias gradients are
per-program partial sums over a range of tokens, reduced by one torch sum (a
fixed order: deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..precision import accumulator_dtype
from ._common import acc_dtype, cast_to, launch, pointer

BT_CONV = 32
BD_CONV = 64  # 128 channels took 168 registers and spilled 2,552 B per thread in the dx backward (sm_90)
BD_STEP = 256  # channels per program of a decode step: 24 per row at FLA's layer defaults (D = 6,144)
DW_BLOCKS = 16  # token blocks per program of the weight gradient: [T / 512, D, W] fp32 partials


@triton.jit
def _ext_rows(x, halo, src, m_src, o_d, m_d, D, ROWS: tl.constexpr, HAS_HALO: tl.constexpr, ACC: tl.constexpr):
    """``ext[src]`` ``[BT, BD]``: x's rows for ``src >= 0``, the halo's for
    ``-ROWS <= src < 0``, zero where ``m_src`` is false."""
    m = (m_src & (src >= 0))[:, None] & m_d[None, :]
    rows = tl.load(x + src[:, None] * D + o_d[None, :], mask=m, other=0.0).to(ACC)
    if HAS_HALO:
        m_h = (m_src & (src < 0) & (src >= -ROWS))[:, None] & m_d[None, :]
        rows += tl.load(halo + (src + ROWS)[:, None] * D + o_d[None, :], mask=m_h, other=0.0).to(ACC)
    return rows


@triton.jit
def _pre_rows(x, w, b, reach, halo, t, m_t, o_d, m_d, D, W: tl.constexpr, HAS_BIAS: tl.constexpr,
              HAS_HALO: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """``pre[t]`` ``[BT, BD]`` and ``reach[t]`` for the rows ``t`` (masked by ``m_t``)."""
    r = tl.load(reach + t, mask=m_t, other=-1)
    acc = tl.zeros([BT, BD], dtype=ACC)
    if HAS_BIAS:
        acc += tl.load(b + o_d, mask=m_d, other=0.0).to(ACC)[None, :]
    for i in tl.static_range(W):
        taps = _ext_rows(x, halo, t - i, m_t & (r >= i), o_d, m_d, D, W - 1, HAS_HALO, ACC)
        acc += taps * tl.load(w + o_d * W + (W - 1 - i), mask=m_d, other=0.0).to(ACC)[None, :]
    return acc, r


@triton.jit
def short_conv_fwd_kernel(x, w, b, reach, halo, y, T, D, W: tl.constexpr, HAS_BIAS: tl.constexpr,
                          HAS_HALO: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, ACC: tl.constexpr):
    """y = silu(pre); grid (cdiv(T, BT), cdiv(D, BD))."""
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t, m_d = t < T, o_d < D
    pre, _ = _pre_rows(x, w, b, reach, halo, t, m_t, o_d, m_d, D, W, HAS_BIAS, HAS_HALO, ACC, BT, BD)
    out = pre * tl.sigmoid(pre)
    tl.store(y + t[:, None] * D + o_d[None, :], cast_to(out, y), mask=m_t[:, None] & m_d[None, :])


@triton.jit
def _dpre(x, w, b, reach, halo, dy, t, m_t, o_d, m_d, D, W: tl.constexpr, HAS_BIAS: tl.constexpr,
          HAS_HALO: tl.constexpr, ACC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """``dL/dpre`` at rows ``t`` (zero where masked) and their reach."""
    pre, r = _pre_rows(x, w, b, reach, halo, t, m_t, o_d, m_d, D, W, HAS_BIAS, HAS_HALO, ACC, BT, BD)
    sig = tl.sigmoid(pre)
    g = tl.load(dy + t[:, None] * D + o_d[None, :], mask=m_t[:, None] & m_d[None, :], other=0.0).to(ACC)
    return g * sig * (1 + pre * (1 - sig)), r


@triton.jit
def short_conv_bwd_dx_kernel(x, w, b, reach, halo, dy, dx, dhalo, T, D, W: tl.constexpr,
                             HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr, BT: tl.constexpr,
                             BD: tl.constexpr, ACC: tl.constexpr):
    """``d ext[s] = sum_i weight[:, W - 1 - i] dpre[s + i]`` (where s + i reaches
    back i rows) for s in ``[-(W - 1), T)``; grid (cdiv(T + W - 1, BT), cdiv(D, BD))."""
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    s = i_t.to(tl.int64) * BT + tl.arange(0, BT) - (W - 1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    acc = tl.zeros([BT, BD], dtype=ACC)
    for i in tl.static_range(W):
        t = s + i
        m_t = (t >= 0) & (t < T)
        dpre, r = _dpre(x, w, b, reach, halo, dy, t, m_t, o_d, m_d, D, W, HAS_BIAS, HAS_HALO, ACC, BT, BD)
        keep = (m_t & (r >= i))[:, None]
        acc += tl.where(keep, dpre, 0.0) * tl.load(w + o_d * W + (W - 1 - i), mask=m_d, other=0.0).to(ACC)[None, :]
    m_x = ((s >= 0) & (s < T))[:, None] & m_d[None, :]
    tl.store(dx + s[:, None] * D + o_d[None, :], cast_to(acc, dx), mask=m_x)
    if HAS_HALO:
        m_h = (s < 0)[:, None] & m_d[None, :]
        tl.store(dhalo + (s + W - 1)[:, None] * D + o_d[None, :], cast_to(acc, dhalo), mask=m_h)


@triton.jit
def short_conv_bwd_dw_kernel(x, w, b, reach, halo, dy, dw_part, db_part, T, D, W: tl.constexpr,
                             HAS_BIAS: tl.constexpr, HAS_HALO: tl.constexpr, BT: tl.constexpr,
                             BD: tl.constexpr, BLOCKS: tl.constexpr, ACC: tl.constexpr):
    """Partial weight and bias gradients over ``BLOCKS`` token blocks:
    ``dw_part[p, d, W - 1 - i] = sum_t dpre[t, d] ext[t - i, d]``; grid
    (cdiv(T, BT * BLOCKS), cdiv(D, BD))."""
    i_p, i_d = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_w = tl.arange(0, W)
    dw = tl.zeros([BD, W], dtype=ACC)
    db = tl.zeros([BD], dtype=ACC)
    for blk in range(BLOCKS):
        t = (i_p.to(tl.int64) * BLOCKS + blk) * BT + tl.arange(0, BT)
        m_t = t < T
        dpre, r = _dpre(x, w, b, reach, halo, dy, t, m_t, o_d, m_d, D, W, HAS_BIAS, HAS_HALO, ACC, BT, BD)
        db += tl.sum(dpre, 0)
        for i in tl.static_range(W):
            taps = _ext_rows(x, halo, t - i, m_t & (r >= i), o_d, m_d, D, W - 1, HAS_HALO, ACC)
            dw += tl.where(o_w[None, :] == W - 1 - i, tl.sum(dpre * taps, 0)[:, None], 0.0)
    base = i_p.to(tl.int64) * D
    tl.store(dw_part + (base + o_d[:, None]) * W + o_w[None, :], dw, mask=m_d[:, None])
    if HAS_BIAS:
        tl.store(db_part + base + o_d, db, mask=m_d)


def short_conv_fwd(x, weight, bias, reach, halo, *, y_out: torch.Tensor) -> None:
    """See ``kernels.torch.short_conv.short_conv_fwd``."""
    T, D = x.shape
    if T == 0:
        return
    W = weight.shape[1]
    grid = (triton.cdiv(T, BT_CONV), triton.cdiv(D, BD_CONV))
    launch(short_conv_fwd_kernel)[grid](
        x, weight, pointer(bias, weight), reach, pointer(halo, x), y_out, T, D,
        W=W, HAS_BIAS=bias is not None, HAS_HALO=halo is not None, BT=BT_CONV, BD=BD_CONV, ACC=acc_dtype(x),
    )


def short_conv_bwd(dy, x, weight, bias, reach, halo, *, dx_out, dweight_out, dbias_out, dhalo_out) -> None:
    """See ``kernels.torch.short_conv.short_conv_bwd``."""
    T, D = x.shape
    W = weight.shape[1]
    flags = dict(W=W, HAS_BIAS=bias is not None, HAS_HALO=halo is not None, BT=BT_CONV, BD=BD_CONV,
                 ACC=acc_dtype(x))
    args = (x, weight, pointer(bias, weight), reach, pointer(halo, x), dy)
    grid = (triton.cdiv(T + W - 1, BT_CONV), triton.cdiv(D, BD_CONV))
    launch(short_conv_bwd_dx_kernel)[grid](*args, dx_out, pointer(dhalo_out, dx_out), T, D, **flags)
    programs = max(1, triton.cdiv(T, BT_CONV * DW_BLOCKS))
    cdt = accumulator_dtype(x.dtype)
    dw_part = torch.empty(programs, D, W, dtype=cdt, device=x.device)
    db_part = torch.empty(programs, D, dtype=cdt, device=x.device) if bias is not None else dw_part
    launch(short_conv_bwd_dw_kernel)[(programs, triton.cdiv(D, BD_CONV))](
        *args, dw_part, db_part, T, D, BLOCKS=DW_BLOCKS, **flags)
    dweight_out.copy_(dw_part.sum(0))
    if dbias_out is not None:
        dbias_out.copy_(db_part.sum(0))


@triton.jit
def conv_silu(x, conv_in, conv_w, conv_b, conv_out, row, D, ch, m_c, m_write, W: tl.constexpr, BC: tl.constexpr,
               HAS_BIAS: tl.constexpr, ACC: tl.constexpr):
    """``silu(conv)`` of channels ``ch`` of ``[N, D]`` at row's token, from
    the cache ``conv_in`` ``[N, D, W]`` (the last W inputs, newest last) and x,
    taps summed newest first as :func:`short_conv_fwd_kernel` sums them; the advanced
    window goes to ``conv_out`` where ``m_write``."""
    at = row * D + ch
    acc = tl.zeros([BC], dtype=ACC)
    if HAS_BIAS:
        acc += tl.load(conv_b + ch, mask=m_c, other=0.0).to(ACC)
    for i in tl.static_range(W):
        if i == 0:
            tap = tl.load(x + at, mask=m_c, other=0.0)
        else:
            tap = tl.load(conv_in + at * W + (W - i), mask=m_c, other=0.0)
        tl.store(conv_out + at * W + (W - 1 - i), cast_to(tap, conv_out), mask=m_write)
        acc += tap.to(ACC) * tl.load(conv_w + ch * W + (W - 1 - i), mask=m_c, other=0.0).to(ACC)
    return acc * tl.sigmoid(acc)


@triton.jit
def conv_step_kernel(x, state, w, b, y, state_out, D, W: tl.constexpr, HAS_BIAS: tl.constexpr, BD: tl.constexpr,
                     ACC: tl.constexpr):
    """One decode token per row; grid (N, cdiv(D, BD)). Column j of the new
    state is the old column j + 1 (x for the last); taps summed newest first,
    as :func:`short_conv_fwd_kernel` sums them."""
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    b_y = conv_silu(x, state, w, b, state_out, i_n.to(tl.int64), D, o_d, m_d, m_d, W, BD, HAS_BIAS, ACC)
    tl.store(y + i_n.to(tl.int64) * D + o_d, cast_to(b_y, y), mask=m_d)


def conv_step(x, state, weight, bias, *, y_out: torch.Tensor, state_out: torch.Tensor) -> None:
    """See ``kernels.torch.short_conv.conv_step``."""
    N, D = x.shape
    if N == 0:
        return
    launch(conv_step_kernel)[(N, triton.cdiv(D, BD_STEP))](
        x, state, weight, pointer(bias, weight), y_out, state_out, D, W=weight.shape[1], HAS_BIAS=bias is not None,
        BD=BD_STEP, ACC=acc_dtype(x),
    )
