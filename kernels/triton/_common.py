"""Triton helpers shared by the programs: chunk rows, decays, tile loads.

Layouts are the torch programs' (token layout ``[T, H, D]``, contiguous);
addresses are int64. ``ACC`` is the compute dtype (fp32, or fp64 for fp64
inputs) of every tile and accumulator; ``MM`` is the precision rule of every
``tl.dot`` (:func:`dot`), which the torch twins round to at the same points.
"""

from __future__ import annotations

import os

import torch
import triton
from torch.library import wrap_triton
import triton.language as tl

from ..chunk_index import CHUNK_SIZE
from ..precision import matmul_mode
from ..tracing import traced

BT = CHUNK_SIZE


def acc_dtype(t: torch.Tensor):
    """The Triton compute dtype (fp64 for fp64 tensors, else fp32) of a
    program on inputs, or compute-dtype buffers, like ``t``."""
    return tl.float64 if t.dtype == torch.float64 else tl.float32


def head_block(d: int) -> int:
    """A whole head dim as one tile (``tl.dot`` wants at least 16)."""
    return max(16, triton.next_power_of_2(d))


def heads_per_program(H_qk: int, HV: int) -> int:
    """Value heads one program of the local dv serves: a pair of one key
    head's (its ``Q K^T`` formed once for both) where the key head has an
    even number of them (GVA), else one."""
    return 2 if (HV // H_qk) % 2 == 0 else 1


def value_block(V: int) -> int:
    """Value tiles of at most 64 columns: a ``[K, BV]`` fp32 state stays in registers."""
    return min(64, head_block(V))


WALK_STAGES = 2
"""Software-pipeline stages of the tape and adjoint walks (their loads do not
wait for the state, so two stages fetch the next chunk under this one)."""


def walk_block(V: int) -> int:
    """Value tiles of the walks: at most 32 columns. At 64 columns, 8 warps and
    2 stages, with the state in halves (:func:`state_chunk`), the tape walk
    spills 168 B per thread and the adjoint walk 328 under triton 3.6,
    reloaded every step; at 32 they spill 0 and 24 B, at the price of reading
    k and w once more per value tile (sm_90, bf16, K = V = 128;
    ``compile_specs --report``)."""
    return min(32, head_block(V))


def register_cap(max_registers: int) -> dict:
    """ptxas's registers per thread as a launch keyword (``maxnreg``), left out
    while torch.compile traces the launch: Dynamo's Triton tracing takes warps
    and stages as launch options but would pass ``maxnreg`` on as a kernel
    argument (torch 2.13, ``triton_kernel_wrap.SPECIAL_CONFIG_NAMES``), so a
    traced launch compiles uncapped."""
    return {} if traced() else {"maxnreg": max_registers}


def launch(kernel):
    """``kernel`` as a launch site calls it (``launch(kernel)[grid](...)``):
    while traced (:mod:`gdn_kcp.kernels.tracing`), through
    ``torch.library.wrap_triton``, so the launch becomes a
    ``triton_kernel_wrapper`` node of the trace (a no-op on fake tensors);
    on real tensors, the kernel itself (no dispatch on the hot path)."""
    return wrap_triton(kernel) if traced() else kernel


def pointer(x: torch.Tensor | None, spare: torch.Tensor) -> torch.Tensor:
    """``x``, or ``spare`` in the place of an absent tensor (a kernel whose
    constexpr flag is off never reads it)."""
    return x if x is not None else spare


def mm_mode(x: torch.Tensor) -> str:
    """The ``MM`` constexpr for inputs like ``x``: the precision rule of
    :func:`gdn_kcp.kernels.precision.matmul_mode`, except that under
    ``TRITON_INTERPRET=1`` bf16 runs as ``"bf16_emulated"``: the interpreter's
    ``tl.dot`` on bf16 tiles returns garbage (numpy has no bf16; seen with
    triton 3.9) and its fp32 -> bf16 cast does not round to nearest."""
    mode = matmul_mode(x.dtype)
    return "bf16_emulated" if mode == "bf16" and os.environ.get("TRITON_INTERPRET") == "1" else mode


@triton.jit
def round_to_bf16(x):
    """fp32 rounded to the nearest bf16 (ties to even), kept in fp32: the
    operand the tensor cores would read."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def round_to_tf32(x):
    """fp32 rounded to tf32's 10 mantissa bits (to nearest, ties away), kept in
    fp32, as ``kernels.precision.round_operands("tf32", ...)`` rounds it; inf
    and NaN pass unchanged."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return tl.where((bits & 0x7F800000) == 0x7F800000, x, rounded)


@triton.jit
def cast_to(x, ptr):
    """``x`` in ``ptr``'s element type, rounded to nearest (a bf16 store under
    the interpreter would otherwise truncate: twice the rounding error)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        x = round_to_bf16(x.to(tl.float32))
    return x.to(ptr.dtype.element_ty)


@triton.jit
def operand(x, MM: tl.constexpr):
    """``x`` as the products of rule ``MM`` read it (:func:`dot`): cast to
    bf16 / fp16 under ``"bf16"`` / ``"fp16"``, rounded to bf16 but kept fp32
    under ``"bf16_emulated"``, as is otherwise (tf32 rounds inside the
    product). Idempotent: a tile rounded early (so that only its narrow copy
    stays live) reads the same in :func:`dot`."""
    if MM == "bf16_emulated":
        return round_to_bf16(x)
    elif MM == "bf16":
        return x.to(tl.bfloat16)
    elif MM == "fp16":
        return x.to(tl.float16)
    else:
        return x


@triton.jit
def dot(a, b, MM: tl.constexpr):
    """Matrix product under the precision rule ``MM`` (:mod:`gdn_kcp.kernels.precision`):
    ``"bf16"`` / ``"fp16"`` cast both operands to the input dtype (tensor
    cores, fp32 accumulation), ``"tf32"`` reads fp32 operands as tf32,
    ``"ieee"`` multiplies in the operands' dtype (fp32 or fp64) exactly, and
    ``"bf16_emulated"`` (the interpreter, :func:`mm_mode`) rounds the operands
    to bf16 and multiplies them exactly, as the tensor cores do (:func:`operand`)."""
    if MM == "bf16_emulated":
        return tl.dot(operand(a, MM), operand(b, MM), input_precision="ieee")
    elif MM == "bf16" or MM == "fp16":
        return tl.dot(operand(a, MM), operand(b, MM), out_dtype=tl.float32)
    elif MM == "tf32":
        return tl.dot(a, b, input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def pull_operand(x, MM: tl.constexpr):
    """The fp32 factor ``c dO`` of the adjoint walks' pull as ``(hi, lo)``
    under ``kernels.precision.pull_mode`` (``split_operand`` there): two bf16
    terms beside bf16 products (rounded but fp32 under ``"bf16_emulated"``),
    two tf32 terms beside fp16 ones; ``(x, x)`` otherwise (``lo`` unused)."""
    if MM == "bf16_emulated":
        hi = round_to_bf16(x)
        return hi, round_to_bf16(x - hi)
    elif MM == "bf16":
        hi = x.to(tl.bfloat16)
        return hi, (x - hi.to(tl.float32)).to(tl.bfloat16)
    elif MM == "fp16":
        hi = round_to_tf32(x)
        return hi, round_to_tf32(x - hi)
    else:
        return x, x


@triton.jit
def pull_dot(q, hi, lo, MM: tl.constexpr):
    """The adjoint walks' pull ``Q^T (c dO)``: ``q`` the raw (transposed) q
    tile as stored, ``(hi, lo)`` from :func:`pull_operand`; both terms'
    products under a split rule (q read in bf16, or as fp32 for the tf32
    products, exactly either way), one product under ``MM`` otherwise."""
    if MM == "bf16_emulated":
        b_q = q.to(tl.float32)
        return tl.dot(b_q, hi, input_precision="ieee") + tl.dot(b_q, lo, input_precision="ieee")
    elif MM == "bf16":
        return tl.dot(q, hi, out_dtype=tl.float32) + tl.dot(q, lo, out_dtype=tl.float32)
    elif MM == "fp16":
        b_q = q.to(tl.float32)
        return tl.dot(b_q, hi, input_precision="tf32") + tl.dot(b_q, lo, input_precision="tf32")
    else:
        return dot(q, hi, MM)


@triton.jit
def chunk_tokens(start, length, BT: tl.constexpr):
    """A chunk's rows from its two ``chunk_table`` entries (first token, length):
    token of each row (int64), row offsets, valid rows.

    The kernel loads the entries itself (``start, length = tl.load(chunk_table
    + c), tl.load(chunk_table + n_chunks + c)``) and passes the values: under
    ``torch.compile`` a launch is functionalised by torch's analysis of the
    kernel's TTIR, which counts every tensor a store address depends on as
    written, and follows a helper call's results back to all of its
    arguments (a load in the kernel body ends the chain). Read inside a
    helper, ``chunk_table`` (and the q, k, g of the same call) counted as
    written, so Inductor cloned them before every launch, and the backward
    mutated its inputs and failed to partition. ``tests/test_traced_triton.py``
    checks every kernel's written set."""
    o_t = tl.arange(0, BT)
    return start.to(tl.int64) + o_t, o_t, o_t < length


@triton.jit
def load_tile(ptr, tok, m_t, H, h, D, col0, BD: tl.constexpr):
    """Columns ``[col0, col0 + BD)`` of rows ``tok`` of head ``h`` of ``[T, H, D]``, in its stored dtype."""
    o_d = col0 + tl.arange(0, BD)
    p = ptr + (tok[:, None] * H + h) * D + o_d[None, :]
    return tl.load(p, mask=m_t[:, None] & (o_d[None, :] < D), other=0.0)


@triton.jit
def load_rows_cols(ptr, tok, m_t, H, h, D, col0, BD: tl.constexpr, ACC: tl.constexpr):
    """:func:`load_tile` in ``ACC``."""
    return load_tile(ptr, tok, m_t, H, h, D, col0, BD).to(ACC)


@triton.jit
def load_operand(ptr, tok, m_t, H, h, D, BD: tl.constexpr, MM: tl.constexpr, ACC: tl.constexpr):
    """Rows ``tok`` of head ``h`` of ``[T, H, D]`` as the products of rule ``MM``
    read them (:func:`operand`): under ``"bf16"`` / ``"fp16"`` the stored tile
    itself, never an fp32 copy (a ``[64, 128]`` tile takes 32 registers a thread
    at 4 warps in bf16, 64 in fp32)."""
    x = load_tile(ptr, tok, m_t, H, h, D, 0, BD)
    if MM == "bf16" or MM == "fp16":
        return operand(x, MM)
    return operand(x.to(ACC), MM)


@triton.jit
def load_operand_cols(ptr, tok, m_t, H, h, D, col0, BD: tl.constexpr, MM: tl.constexpr, ACC: tl.constexpr):
    """Columns ``[col0, col0 + BD)`` of :func:`load_operand`'s tile."""
    x = load_tile(ptr, tok, m_t, H, h, D, col0, BD)
    if MM == "bf16" or MM == "fp16":
        return operand(x, MM)
    return operand(x.to(ACC), MM)


@triton.jit
def store_rows_cols(ptr, x, tok, m_t, H, h, D, col0, BD: tl.constexpr):
    o_d = col0 + tl.arange(0, BD)
    p = ptr + (tok[:, None] * H + h) * D + o_d[None, :]
    tl.store(p, cast_to(x, ptr), mask=m_t[:, None] & (o_d[None, :] < D))


@triton.jit
def load_scalars(ptr, tok, m_t, H, h, ACC: tl.constexpr):
    """Per-token scalars of head ``h`` of a ``[T, H]`` tensor (zero padded)."""
    return tl.load(ptr + tok * H + h, mask=m_t, other=0.0).to(ACC)


@triton.jit
def store_scalars(ptr, x, tok, m_t, H, h):
    """Per-token scalars ``x`` into head ``h`` of a ``[T, H]`` tensor (rounded to its dtype)."""
    tl.store(ptr + tok * H + h, cast_to(x, ptr), mask=m_t)


@triton.jit
def softplus(x):
    """``log(1 + exp(x))`` as torch computes it (x past 20 is returned as is);
    ``log(u) * e / (u - 1)`` keeps log1p's accuracy where ``1 + e`` rounds."""
    e = tl.exp(x)
    u = 1.0 + e
    return tl.where(x > 20.0, x, tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0))))


@triton.jit
def gate_rows(g, gate_params, tok, m_t, H, h, GATE: tl.constexpr, ACC: tl.constexpr):
    """The gates of rows ``tok`` of head ``h`` (rows outside ``m_t`` 0); with
    ``GATE`` computed from the raw input as :func:`load_gates` says."""
    b_g = load_scalars(g, tok, m_t, H, h, ACC)
    if GATE:
        decay_rate = tl.load(gate_params + h).to(ACC)
        bias = tl.load(gate_params + H + h).to(ACC)
        b_g = tl.where(m_t, decay_rate * softplus(b_g + bias), 0.0)
    return b_g


@triton.jit
def channel_gates(g, gate_params, tok, m_t, HV, h, K, col0, BKS: tl.constexpr, GATE: tl.constexpr,
                  ACC: tl.constexpr):
    """:func:`gate_rows` for a gate per key channel (KDA): ``[rows, BKS]`` of
    value head ``h``, channels ``[col0, col0 + BKS)`` (rows outside ``m_t``
    and channels past K 0); with ``GATE`` from the raw input and
    ``gate_params`` ``[2, HV, K]``: ``rate * softplus(g + bias)``."""
    o_d = col0 + tl.arange(0, BKS)
    m = m_t[:, None] & (o_d[None, :] < K)
    x = tl.load(g + (tok[:, None] * HV + h) * K + o_d[None, :], mask=m, other=0.0).to(ACC)
    if GATE:
        # volatile: not hoisted out of a walk's chunk loop, where every call's rate and bias vectors
        # stayed live across the loop: the adjoint walk spilled 52 B per thread, 0 volatile (252
        # registers), and every other channel kernel holds as many registers or up to 21 fewer
        # (sm_90, K = V = 128, triton 3.9; compile_specs --report)
        rate = tl.load(gate_params + h * K + o_d, mask=o_d < K, other=0.0, volatile=True).to(ACC)
        bias = tl.load(gate_params + (HV + h) * K + o_d, mask=o_d < K, other=0.0, volatile=True).to(ACC)
        x = tl.where(m, rate[None, :] * softplus(x + bias[None, :]), 0.0)
    return x


@triton.jit
def load_gates(g, gate_params, tok, m_t, H, h, GATE: tl.constexpr, ACC: tl.constexpr):
    """The chunk's gates (padded rows 0), their cumsum ``G`` (padded rows hold
    ``G_C``) and the suffix sums ``sum_{l > i} g_l`` (``log(gamma_C / gamma_i)``).
    Each sum adds exactly the gates it spans: a -inf gate gives an exact zero
    decay (never ``-inf - -inf``) and a -1e4 gate never cancels in fp32.
    With ``GATE``, g holds the raw input a and the gate is computed here:
    ``gate_params[0, h] * softplus(a + gate_params[1, h])`` (FLA's
    ``-exp(A_log) * softplus(a + dt_bias)``), so no gate tensor exists."""
    b_g = gate_rows(g, gate_params, tok, m_t, H, h, GATE, ACC)
    o_i = tl.arange(0, b_g.shape[0])
    tail = tl.sum(tl.where(o_i[None, :] > o_i[:, None], b_g[None, :], 0.0), 1)
    return b_g, tl.cumsum(b_g, 0), tail


@triton.jit
def load_beta(beta, tok, m_t, H, h, BETA_SIGMOID: tl.constexpr, BETA_SCALE: tl.constexpr, ACC: tl.constexpr):
    """``(beta, d beta / d input)`` per token (padded rows 0): the input itself,
    or its sigmoid with ``BETA_SIGMOID``, times ``BETA_SCALE`` (2 with FLA's
    ``allow_neg_eigval``)."""
    b = load_scalars(beta, tok, m_t, H, h, ACC)
    if BETA_SIGMOID:
        s = tl.sigmoid(b)
        return tl.where(m_t, BETA_SCALE * s, 0.0), BETA_SCALE * s * (1.0 - s)
    return BETA_SCALE * b, tl.zeros_like(b) + BETA_SCALE


@triton.jit
def load_qk_cols(ptr, rstd, tok, m_t, H_qk, hk, K, col0, BD: tl.constexpr, HAS_NORM: tl.constexpr,
                 ACC: tl.constexpr):
    """Columns ``[col0, col0 + BD)`` of :func:`load_qk`'s rows (a K block)."""
    x = load_rows_cols(ptr, tok, m_t, H_qk, hk, K, col0, BD, ACC)
    if HAS_NORM:
        x = x * load_scalars(rstd, tok, m_t, H_qk, hk, ACC)[:, None]
    return x


@triton.jit
def load_qk(ptr, rstd, tok, m_t, H_qk, hk, K, BK: tl.constexpr, HAS_NORM: tl.constexpr, ACC: tl.constexpr):
    """q or k rows of key head ``hk``, L2-normalised when ``HAS_NORM`` (in
    ``ACC``; the products then round the normalised rows once). The norm stays
    on this side of every product: its reciprocal is unbounded (1,000 for a
    zero row at eps 1e-6), so on the other operand it would overflow fp16."""
    return load_qk_cols(ptr, rstd, tok, m_t, H_qk, hk, K, 0, BK, HAS_NORM, ACC)


@triton.jit
def causal_segments(b_g, STRICT: tl.constexpr):
    """``sum_{j < l <= i} g_l`` ``[BT, BT]`` (column j sums g_l down the rows
    l > j, so each gate is added once) and the mask ``i >= j`` (``i > j``)."""
    o_i = tl.arange(0, b_g.shape[0])
    below = o_i[:, None] > o_i[None, :]
    segment = tl.cumsum(tl.where(below, b_g[:, None], 0.0), 0)
    if STRICT:
        keep = below
    else:
        keep = o_i[:, None] >= o_i[None, :]
    return segment, keep


@triton.jit
def causal_decay(b_g, STRICT: tl.constexpr):
    """``exp(G_i - G_j)`` on ``i >= j`` (``i > j`` when STRICT), zero above."""
    segment, keep = causal_segments(b_g, STRICT)
    return tl.where(keep, tl.exp(segment), 0.0)


@triton.jit
def causal_scores(a, b, b_g, STRICT: tl.constexpr, MM: tl.constexpr):
    """``(A B^T) * exp(G_i - G_j)`` on the causal part, zero above: a select, so
    a non-finite row of A or B (or gate) at token t reaches no row ``i < t``."""
    segment, keep = causal_segments(b_g, STRICT)
    return tl.where(keep, dot(a, tl.trans(b), MM) * tl.exp(segment), 0.0)


@triton.jit
def rows_reached(finite):
    """Rows at or after the first row with a ``False`` in ``finite`` (an
    elementwise mask ``[R, D]``): the rows a non-finite entry reaches."""
    return tl.cumsum(tl.max(tl.where(finite, 0, 1), 1), 0) > 0


@triton.jit
def lower_dot(lower, x, MM: tl.constexpr):
    """``lower @ x`` for a lower-triangular ``lower`` without the ``0 * inf`` of
    its zeros: row i is NaN exactly when a row ``l <= i`` of ``x`` is not
    finite, and exact otherwise (a plain product is NaN in every row), so a
    NaN or inf of token t stays at and after t."""
    finite = (x - x) == 0.0
    reached = rows_reached(finite)
    out = dot(lower, tl.where(finite, x, 0.0), MM)
    return tl.where(reached[:, None], float("nan"), out)


@triton.jit
def load_state(ptr, row, H, h, K, V, col0, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr):
    """``[BK, BV]`` tile (columns from ``col0``) of state ``row`` of an ``[N, H, K, V]`` tensor."""
    o_k = tl.arange(0, BK)
    o_v = col0 + tl.arange(0, BV)
    p = ptr + ((row * H + h).to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
    return tl.load(p, mask=(o_k[:, None] < K) & (o_v[None, :] < V), other=0.0).to(ACC)


@triton.jit
def load_state_rows(ptr, row, H, h, K, V, k0, col0, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr):
    """``[BK, BV]`` tile (rows from ``k0``, columns from ``col0``) of state ``row``
    of an ``[N, H, K, V]`` tensor: a K block of :func:`load_state`."""
    o_k = k0 + tl.arange(0, BK)
    o_v = col0 + tl.arange(0, BV)
    p = ptr + ((row * H + h).to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
    return tl.load(p, mask=(o_k[:, None] < K) & (o_v[None, :] < V), other=0.0).to(ACC)


@triton.jit
def load_state_cols(ptr, row, H, h, K, W, col0, width, BK: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr):
    """``[BK, BV]`` tile (columns ``[col0, col0 + BV)`` below ``width``, zero past it) of
    state ``row`` of an ``[N, H, K, W]`` tensor: the S or M block of a ``[S | M]`` plane."""
    o_k = tl.arange(0, BK)
    o_v = col0 + tl.arange(0, BV)
    p = ptr + ((row * H + h).to(tl.int64) * K + o_k[:, None]) * W + o_v[None, :]
    return tl.load(p, mask=(o_k[:, None] < K) & (o_v[None, :] < width), other=0.0).to(ACC)


@triton.jit
def exact_product(summary, row, H, h, K, V, x, BK: tl.constexpr, BV: tl.constexpr, BKB: tl.constexpr,
                  TRANS: tl.constexpr, ACC: tl.constexpr):
    """``M x`` (``M^T x`` with ``TRANS``), exact in ``ACC`` (``input_precision="ieee"``),
    for the M of row ``row`` of a ``[N, H, K, V + K]`` plane ``[S | M]`` and a
    ``[BK, BV]`` tile ``x``. K is summed in blocks of BKB: each block's rows of x
    come out of the registers by a masked sum (exact: it adds zeros) and its M
    columns (rows) from memory, so an FMA product holds BKB-long operands per
    thread (``compose_segments.BV_COMPOSE`` has the measurements)."""
    o_i = tl.arange(0, BK)
    o_j = tl.arange(0, BKB)
    o_b = tl.arange(0, BK // BKB)
    x_blocks = tl.reshape(x, [BK // BKB, BKB, BV])
    base = summary + (row * H + h).to(tl.int64) * K * (V + K) + V
    acc = tl.zeros([BK, BV], dtype=ACC)
    for i_b in range(0, BK // BKB):
        o_kb = i_b * BKB + o_j
        if TRANS:  # element (i, j) = M[kb + j, i]
            p = base + o_kb[None, :].to(tl.int64) * (V + K) + o_i[:, None]
        else:  # element (i, j) = M[i, kb + j]
            p = base + o_i[:, None].to(tl.int64) * (V + K) + o_kb[None, :]
        b_m = tl.load(p, mask=(o_i[:, None] < K) & (o_kb[None, :] < K), other=0.0).to(ACC)
        b_x = tl.sum(tl.where(o_b[:, None, None] == i_b, x_blocks, 0.0), 0)
        acc += tl.dot(b_m, b_x, input_precision="ieee")
    return acc


@triton.jit
def store_state(ptr, x, row, H, h, K, V, col0, BK: tl.constexpr, BV: tl.constexpr):
    store_state_rows(ptr, x, row, H, h, K, V, 0, col0, BK, BV)


@triton.jit
def store_state_rows(ptr, x, row, H, h, K, V, k0, col0, BK: tl.constexpr, BV: tl.constexpr):
    """:func:`store_state` of rows ``[k0, k0 + BK)`` (a half of a walk's state)."""
    o_k = k0 + tl.arange(0, BK)
    o_v = col0 + tl.arange(0, BV)
    p = ptr + ((row * H + h).to(tl.int64) * K + o_k[:, None]) * V + o_v[None, :]
    tl.store(p, cast_to(x, ptr), mask=(o_k[:, None] < K) & (o_v[None, :] < V))


@triton.jit
def store_state_strided(ptr, x, h, stride_h, stride_k, K, V, k0, col0, BK: tl.constexpr, BV: tl.constexpr):
    """Store a ``[BK, BV]`` tile (rows from ``k0``) of head ``h`` into a strided
    ``[1, H, K, V]`` view (a column slice of a wider pool)."""
    o_k = k0 + tl.arange(0, BK)
    o_v = col0 + tl.arange(0, BV)
    p = ptr + h.to(tl.int64) * stride_h + o_k[:, None] * stride_k + o_v[None, :]
    tl.store(p, cast_to(x, ptr), mask=(o_k[:, None] < K) & (o_v[None, :] < V))


@triton.jit
def last_real_fragment(frag_table, n_frag, BF: tl.constexpr):
    """The last fragment that is not a sentinel (sentinels follow the real
    ones; 0 when there is none)."""
    n_real = tl.sum(tl.zeros([BF], dtype=tl.int32), 0)
    for f0 in range(0, n_frag, BF):
        o_f = f0 + tl.arange(0, BF)
        b_flags = tl.load(frag_table + 5 * n_frag + o_f, mask=o_f < n_frag, other=4)
        n_real += tl.sum(((b_flags & 4) == 0).to(tl.int32), 0)
    return tl.maximum(n_real - 1, 0)


@triton.jit
def frag_info(frag_table, n_frag, f):
    """Fragment ``f``: first chunk, chunk count, its row in the initial states
    (``f - n_in``; its final-state row is f) and its crossing flags. A kernel
    that stores at rows derived from the first chunk or the initial row reads
    them itself (:func:`chunk_tokens`' note)."""
    first = tl.load(frag_table + 2 * n_frag + f)
    count = tl.load(frag_table + 3 * n_frag + f)
    initial_row = f - (tl.load(frag_table + 5 * n_frag) & 1)  # fragment 0 is the only one that can cross in
    flags = tl.load(frag_table + 5 * n_frag + f)
    return first, count, initial_row, flags


@triton.jit
def carry_row(frag_table, n_frag, f):
    """Row ``f``'s row of the carry plane (``frag_carry``, the seventh row of a
    phase-3 index of :mod:`gdn_kcp.kernels.segments`; read for ``SEGMENT`` rows only)."""
    return tl.load(frag_table + 6 * n_frag + f)


@triton.jit
def walk_operands(g, gate_params, tok, length, HV, h, BT: tl.constexpr, GATE: tl.constexpr, ACC: tl.constexpr):
    """The decays one step of a walk over a chunk (rows ``tok``, ``length`` of
    them: :func:`chunk_tokens`) needs: the gate prefix sums ``G``,
    ``k_scale = gamma_C / gamma_i`` and ``gamma_C``.

    The walks put ``k_scale`` (at most 1) on the ``[BT, BV]`` side of their K
    products (``K^T diag(k_scale) V_new``, ``diag(k_scale) (K dS)``), so no
    decayed ``[BT, BK]`` copy of K is made: on sm_90 at 4 warps the tape walk
    spilled 1,864 bytes a thread with that fp32 copy and the ``[BT, BT]``
    suffix sums of :func:`load_gates`, and spills 200 without them.
    ``gamma_C / gamma_i = exp(sum_{l > i} g_l)`` is a reverse cumsum of the
    gates one row on (read again from memory), which adds exactly the gates it
    spans, as :func:`load_gates` does, without its ``[BT, BT]`` temporary."""
    o_t = tl.arange(0, BT)
    b_g = gate_rows(g, gate_params, tok, o_t < length, HV, h, GATE, ACC)
    b_after = gate_rows(g, gate_params, tok + 1, o_t + 1 < length, HV, h, GATE, ACC)
    return tl.cumsum(b_g, 0), tl.exp(tl.cumsum(b_after, 0, reverse=True)), tl.exp(tl.sum(b_g, 0))


@triton.jit
def load_state_halves(ptr, row, H, h, K, V, col0, BH: tl.constexpr, BV: tl.constexpr, ACC: tl.constexpr):
    """Rows ``[0, BH)`` and ``[BH, 2 BH)`` of :func:`load_state`'s tile (a walk's two state halves)."""
    return (load_state_rows(ptr, row, H, h, K, V, 0, col0, BH, BV, ACC),
            load_state_rows(ptr, row, H, h, K, V, BH, col0, BH, BV, ACC))


@triton.jit
def boundary_halves(own, own_row, crossing, carry_in, frag_table, n_frag, f, flags, H, h, K, V, col,
                    BH: tl.constexpr, BV: tl.constexpr, CROSS: tl.constexpr, HAS_OWN: tl.constexpr,
                    HAS_CROSSING: tl.constexpr, HAS_CARRY: tl.constexpr, ACC: tl.constexpr):
    """A walk's boundary state of fragment ``f`` (a forward walk's start, an
    adjoint walk's end) as its two halves (:func:`load_state_halves`): zero;
    row ``own_row`` of ``own`` (the initial states; the final states'
    adjoints) when the fragment does not cross that way (bit ``CROSS`` of its
    flags: 1 in, 2 out); ``crossing[0]`` (s_in; lambda_end) when it does; with
    ``HAS_CARRY``, a ``SEGMENT`` row's carry-plane row (``frag_table`` row 6)."""
    X1 = tl.zeros([BH, BV], dtype=ACC)
    X2 = tl.zeros([BH, BV], dtype=ACC)
    if HAS_OWN:
        if (flags & CROSS) == 0:
            X1, X2 = load_state_halves(own, own_row, H, h, K, V, col, BH, BV, ACC)
    if HAS_CROSSING:
        if (flags & CROSS) != 0:
            X1, X2 = load_state_halves(crossing, 0, H, h, K, V, col, BH, BV, ACC)
    if HAS_CARRY:
        if (flags & 8) != 0:  # SEGMENT
            X1, X2 = load_state_halves(carry_in, carry_row(frag_table, n_frag, f), H, h, K, V, col, BH, BV, ACC)
    return X1, X2


@triton.jit
def store_state_halves(ptr, X1, X2, row, H, h, K, V, col0, BH: tl.constexpr, BV: tl.constexpr):
    """:func:`store_state` of a walk's two state halves."""
    store_state_rows(ptr, X1, row, H, h, K, V, 0, col0, BH, BV)
    store_state_rows(ptr, X2, row, H, h, K, V, BH, col0, BH, BV)


@triton.jit
def state_chunk(k, k_rstd, w, u, v_new, X1, X2, tok, m_t, k_scale, gamma_last, H_qk, hk, HV, h, K, V, col,
                BH: tl.constexpr, BV: tl.constexpr, HAS_NORM: tl.constexpr, HAS_U: tl.constexpr,
                STORE: tl.constexpr, MM: tl.constexpr, ACC: tl.constexpr):
    """One chunk of the state walk from ``X = [X1; X2]`` (rows ``[0, BH)`` and
    ``[BH, 2 BH)`` of K, columns ``[col, col + BV)``; the walks take ``BH = BK / 2``,
    and 16 at ``BK = 16``, where the second half lies past K, masked): ``V_new = U - W X``
    (``U = 0`` without ``HAS_U``; stored into ``v_new`` with ``STORE``), then
    ``gamma_C X + K^T diag(k_scale) V_new``, each half against the matching
    columns of W and K. Held as two halves, with W and K read in two
    ``[BT, BH]`` slices, the tape walk spills nothing on sm_90 (bf16, K = V =
    128, value tiles of 32, 8 warps, triton 3.6): as one ``[K, BV]`` state
    beside whole ``[BT, K]`` W and K tiles it spilled 92 B per thread, reloaded
    every step. Returns ``(X1, X2)``."""
    b_vn = chunk_values(w, u, X1, X2, tok, m_t, HV, h, K, V, col, BH, BV, HAS_U, MM, ACC)
    if STORE:
        store_rows_cols(v_new, b_vn, tok, m_t, HV, h, V, col, BV)
    return advance_state(k, k_rstd, X1, X2, b_vn, tok, m_t, k_scale, gamma_last, H_qk, hk, K, BH, HAS_NORM, MM, ACC)


@triton.jit
def chunk_values(w, u, X1, X2, tok, m_t, HV, h, K, V, col, BH: tl.constexpr, BV: tl.constexpr,
                 HAS_U: tl.constexpr, MM: tl.constexpr, ACC: tl.constexpr):
    """:func:`state_chunk`'s ``V_new = U - W X`` (``U = 0`` without ``HAS_U``),
    each half of X against the matching columns of W."""
    b_w1 = load_operand_cols(w, tok, m_t, HV, h, K, 0, BH, MM, ACC)
    b_w2 = load_operand_cols(w, tok, m_t, HV, h, K, BH, BH, MM, ACC)
    b_vn = -(dot(b_w1, X1, MM) + dot(b_w2, X2, MM))
    if HAS_U:
        b_vn += load_rows_cols(u, tok, m_t, HV, h, V, col, BV, ACC)
    return b_vn


@triton.jit
def advance_state(k, k_rstd, X1, X2, b_vn, tok, m_t, k_scale, gamma_last, H_qk, hk, K, BH: tl.constexpr,
                  HAS_NORM: tl.constexpr, MM: tl.constexpr, ACC: tl.constexpr):
    """:func:`state_chunk`'s update ``gamma_C X + K^T diag(k_scale) V_new``,
    each half of X against the matching columns of K. Returns ``(X1, X2)``."""
    b_vs = operand(k_scale[:, None] * b_vn, MM)
    b_k1 = operand(load_qk_cols(k, k_rstd, tok, m_t, H_qk, hk, K, 0, BH, HAS_NORM, ACC), MM)
    X1 = gamma_last * X1 + dot(tl.trans(b_k1), b_vs, MM)
    b_k2 = operand(load_qk_cols(k, k_rstd, tok, m_t, H_qk, hk, K, BH, BH, HAS_NORM, ACC), MM)
    X2 = gamma_last * X2 + dot(tl.trans(b_k2), b_vs, MM)
    return X1, X2


@triton.jit
def chunk_qk(q, k, q_rstd, k_rstd, tok, m_t, H_qk, hk, K, BT: tl.constexpr, BKS: tl.constexpr,
             HAS_NORM: tl.constexpr, ACC: tl.constexpr, MM: tl.constexpr):
    """``Q K^T`` ``[BT, BT]`` of key head ``hk`` (shared by its value heads),
    summed over key slices of ``BKS``."""
    b_qk = tl.zeros([BT, BT], dtype=ACC)
    for k0 in range(0, K, BKS):
        b_q = load_qk_cols(q, q_rstd, tok, m_t, H_qk, hk, K, k0, BKS, HAS_NORM, ACC)
        b_k = load_qk_cols(k, k_rstd, tok, m_t, H_qk, hk, K, k0, BKS, HAS_NORM, ACC)
        b_qk += dot(b_q, tl.trans(b_k), MM)
    return b_qk


@triton.jit
def decayed_scores(b_qk, g, gate_params, tok, m_t, HV, h, GATE: tl.constexpr, ACC: tl.constexpr):
    """``b_qk * exp(G_i - G_j) * [i >= j]`` with value head ``h``'s gates."""
    b_g = gate_rows(g, gate_params, tok, m_t, HV, h, GATE, ACC)
    segment, keep = causal_segments(b_g, False)
    return tl.where(keep, b_qk * tl.exp(segment), 0.0)