"""The token-by-token recurrence (Triton): decode steps and short prompts. Same
signature as ``kernels.torch.recurrent``.

Grid (N x HV, value tiles): a program holds its document's state columns
``[K, BV]`` in registers and walks the document's tokens, one rank-1 update
and two matrix-vector products per token, fp32 FMA (no product is big
enough for tensor cores). At decode (one token) the launch reads each initial
state once and writes the final state once: 2 x 4 K V bytes per value head,
its main cost. A program reads and writes only its own state columns, so the
final state may overwrite the initial one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch._chunks import L2NORM_EPS
from ._common import acc_dtype, cast_to, launch, pointer, softplus
from .short_conv import conv_silu

# [BK, 8] state columns at 2 warps: no spill at K = 128 (113 registers) or 256 (184), where
# [128, 16] at 1 warp spilled 112 B per thread and [256, 16] at 2 warps 128 B (sm_90, triton 3.9).
# One decode token of HV = 32, V = 128 is 512 programs.
BV_RECURRENT = 8
NUM_WARPS = 2


@triton.jit
def _normed(x, ON: tl.constexpr, EPS: tl.constexpr):
    if ON:
        x = x / tl.sqrt(tl.sum(x * x) + EPS)
    return x


@triton.jit
def recurrent_kernel(q, k, v, g, beta, gate_params, doc_bounds, state0, state, o, scale, H_qk, HV, K, V,
                     conv_in, conv_w, conv_b, conv_out, D,
                     BK: tl.constexpr, BV: tl.constexpr, GATE: tl.constexpr, BETA_SIGMOID: tl.constexpr,
                     BETA_SCALE: tl.constexpr, QK_NORM: tl.constexpr, HAS_INITIAL: tl.constexpr, EPS: tl.constexpr,
                     ACC: tl.constexpr, CONV: tl.constexpr, W: tl.constexpr, CONV_BIAS: tl.constexpr,
                     CHANNEL: tl.constexpr, BETA_V: tl.constexpr):
    """Grid (N * HV, cdiv(V, BV)): the state columns ``[i_v BV, (i_v + 1) BV)`` of
    one document and value head through its tokens, from ``state0`` (zeros
    without ``HAS_INITIAL``) into ``state``. With ``CONV`` (a decode step: one
    token per document, row n of q = the raw projections ``[N, D]``, q, k, v
    channels side by side) q, k and v are the short convolution of the row
    and its cache ``conv_in``, computed here: every program of a key head's
    group recomputes that head's q and k channels (K FMAs a tap), the first
    writes their advanced window to ``conv_out``, each its own v columns', so
    no program reads what another writes (``conv_out`` is not ``conv_in``).
    With ``CHANNEL`` (KDA) g holds a decay per key row of the state
    ``[T, HV, K]`` (activated: no ``GATE``), with ``BETA_V`` beta one per
    value channel ``[T, HV, V]``."""
    tl.static_assert(not (CHANNEL and GATE), "KDA's gate is activated before the recurrence")
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H_qk)
    bos = tl.load(doc_bounds + i_n).to(tl.int64)
    eos = tl.load(doc_bounds + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    o_s = (i_nh.to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    if HAS_INITIAL:
        b_s = tl.load(state0 + o_s, mask=m_s, other=0.0).to(ACC)
    else:
        b_s = tl.zeros([BK, BV], dtype=ACC)
    if GATE:
        rate = tl.load(gate_params + i_hv).to(ACC)
        bias = tl.load(gate_params + HV + i_hv).to(ACC)
    for t in range(bos, eos):
        if CONV:
            # the group's first program (value head and tile 0) writes the q and k window
            m_lead = m_k & ((o_k * 0 + i_hv % (HV // H_qk) + i_v) == 0)
            b_q = conv_silu(q, conv_in, conv_w, conv_b, conv_out, t, D, i_h * K + o_k, m_k, m_lead, W, BK,
                             CONV_BIAS, ACC)
            b_k = conv_silu(q, conv_in, conv_w, conv_b, conv_out, t, D, (H_qk + i_h) * K + o_k, m_k, m_lead, W, BK,
                             CONV_BIAS, ACC)
            b_v = conv_silu(q, conv_in, conv_w, conv_b, conv_out, t, D, 2 * H_qk * K + i_hv * V + o_v, m_v, m_v,
                             W, BV, CONV_BIAS, ACC)
            b_q, b_k = _normed(b_q, QK_NORM, EPS), _normed(b_k, QK_NORM, EPS)
        else:
            b_q = _normed(tl.load(q + (t * H_qk + i_h) * K + o_k, mask=m_k, other=0.0).to(ACC), QK_NORM, EPS)
            b_k = _normed(tl.load(k + (t * H_qk + i_h) * K + o_k, mask=m_k, other=0.0).to(ACC), QK_NORM, EPS)
            b_v = tl.load(v + (t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(ACC)
        if CHANNEL:  # a -inf gate is a hard reset of its key row: exp gives an exact 0
            b_s = b_s * tl.exp(tl.load(g + (t * HV + i_hv) * K + o_k, mask=m_k, other=0.0).to(ACC))[:, None]
        else:
            b_g = tl.load(g + t * HV + i_hv).to(ACC)
            if GATE:
                b_g = rate * softplus(b_g + bias)
            b_s = b_s * tl.exp(b_g)
        if BETA_V:
            b_beta = tl.load(beta + (t * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(ACC)
        else:
            b_beta = tl.load(beta + t * HV + i_hv).to(ACC)
        if BETA_SIGMOID:
            b_beta = tl.sigmoid(b_beta)
        b_u = BETA_SCALE * b_beta * (b_v - tl.sum(b_s * b_k[:, None], 0))
        b_s += b_k[:, None] * b_u[None, :]
        b_o = scale * tl.sum(b_s * b_q[:, None], 0)
        tl.store(o + (t * HV + i_hv) * V + o_v, cast_to(b_o, o), mask=m_v)
    tl.store(state + o_s, cast_to(b_s, state), mask=m_s)


def recurrent(q, k, v, g, beta, gate_params, doc_bounds, initial_state, scale, *, o_out, state_out, use_qk_l2norm,
              beta_mode) -> None:
    """See ``kernels.torch.recurrent.recurrent``."""
    N, HV, K, V = state_out.shape
    if N == 0:
        return
    sigmoid, beta_scale = beta_mode
    channel = g.dim() == 3  # KDA: a decay per key channel, activated (gate_params None)
    if channel and gate_params is not None:
        raise ValueError("recurrent: a gate per key channel (g [BT, HV, K]) comes activated; gate_params must be None")
    # documents on axis 0 (up to 2^31 - 1 programs; axis 1 stops at 65,535)
    launch(recurrent_kernel)[(N * HV, triton.cdiv(V, BV_RECURRENT))](
        q, k, v, g, beta, pointer(gate_params, state_out), doc_bounds, pointer(initial_state, state_out), state_out,
        o_out, scale, q.shape[1], HV, K, V, state_out, state_out, state_out, state_out, 0,
        BK=triton.next_power_of_2(K), BV=BV_RECURRENT, GATE=gate_params is not None, BETA_SIGMOID=sigmoid,
        BETA_SCALE=beta_scale, QK_NORM=use_qk_l2norm, HAS_INITIAL=initial_state is not None, EPS=L2NORM_EPS,
        ACC=acc_dtype(state_out), CONV=False, W=1, CONV_BIAS=False, CHANNEL=channel, BETA_V=beta.dim() == 3,
        num_warps=NUM_WARPS,
    )


def decode_step(qkv, conv_state, weight, bias, g, beta, gate_params, initial_state, scale, *, H_qk, o_out,
                state_out, conv_state_out, use_qk_l2norm, beta_mode) -> None:
    """See ``kernels.torch.recurrent.decode_step``: one launch of
    :func:`recurrent_kernel` with the convolution in it."""
    N, HV, K, V = state_out.shape
    if N == 0:
        return
    sigmoid, beta_scale = beta_mode
    doc_bounds = torch.arange(N + 1, dtype=torch.int64, device=qkv.device)  # one token per row
    launch(recurrent_kernel)[(N * HV, triton.cdiv(V, BV_RECURRENT))](
        qkv, qkv, qkv, g, beta, pointer(gate_params, state_out), doc_bounds, pointer(initial_state, state_out),
        state_out, o_out, scale, H_qk, HV, K, V, conv_state, weight, pointer(bias, weight), conv_state_out,
        qkv.shape[1], BK=triton.next_power_of_2(K), BV=BV_RECURRENT, GATE=gate_params is not None,
        BETA_SIGMOID=sigmoid, BETA_SCALE=beta_scale, QK_NORM=use_qk_l2norm, HAS_INITIAL=initial_state is not None,
        EPS=L2NORM_EPS, ACC=acc_dtype(state_out), CONV=True, W=weight.shape[1], CONV_BIAS=bias is not None,
        CHANNEL=False, BETA_V=False, num_warps=NUM_WARPS,
    )
