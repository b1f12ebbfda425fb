"""The input dtypes and the dtype rules of every buffer, in one place (docs/design.md,
"Precision"): fp64 inputs compute (and keep tapes, states and boundary messages) in
fp64, the oracle's precision; every other input dtype computes in fp32, and
the buffers of :data:`INPUT_DTYPE_BUFFERS` are stored in the input dtype. Every
byte query and ``WorkspaceKcp`` reads its ``dtype=`` through
:func:`compute_dtype` / :func:`buffer_dtype`, so each refuses a dtype the
calls do not take."""

from __future__ import annotations

import torch

from gdn_kcp.kernels.precision import accumulator_dtype

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The input dtypes of every public function."""


def check_input_dtype(dtype: object, name: str = "dtype") -> torch.dtype:
    """``dtype`` itself when it is one of FLOAT_DTYPES; else ``TypeError`` (not a
    ``torch.dtype``) or ``ValueError`` (another dtype) naming ``name`` and the value."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, one of float16, bfloat16, float32, float64; "
                        f"got {type(dtype).__name__} {dtype!r}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be one of float16, bfloat16, float32, float64 (the input dtype), got {dtype}")
    return dtype


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The compute dtype of inputs of ``dtype`` (checked by :func:`check_input_dtype`)."""
    return accumulator_dtype(check_input_dtype(dtype))


INPUT_DTYPE_BUFFERS = ("A", "w", "v_new", "h", "scores", "dh", "dv_new", "dq_heads", "dk_heads", "dw", "k_decayed",
                       "q_decayed")
"""Buffers stored in the input dtype (bf16 / fp16 inputs; fp32 and fp64 inputs
keep them in the compute dtype, which is then the input dtype): the forward
tapes A, w, v_new (u until the tape walk) and h, the scores of a forward that
keeps no tape (read only as a product's operand), and the backward's dh, dv_new
and per-value-head dq, dk, dw, as flash-linear-attention keeps them. Each is a
product's output that later programs read as a matrix-product operand, which
the precision rule rounds to the input dtype there anyway, so storing it
rounded moves half the bytes and changes only the other reads: u in
``v_new = u - W S``, h and dh in the gate gradient's ``<dh, h>``, the local dv
and dk that later programs complete in place (rounded twice), and the GVA sum
of dq / dk (in fp32, over rounded terms). The programs that write a buffer keep
using their fp32 values, the walks their fp32 states. Measured at bf16 against
the fp64 oracle (tests/test_precision.py, the table of docs/api.md; relative RMS,
with these buffers in fp32 -> in bf16): o 4.07e-3 -> 4.31e-3, final state
2.06e-3 -> 2.33e-3, dq 3.95e-3 -> 4.49e-3, dk 4.26e-3 -> 5.19e-3, dv 3.96e-3 ->
4.00e-3, dg 3.94e-3 -> 4.46e-3, dbeta 4.29e-3 -> 4.59e-3, d initial state
0.80e-3 -> 0.80e-3: every output within FLA's classes (5e-3 for o and the
final state, 8e-3 for dq / dk / dv). KDA's decayed q and k (``k_decayed``,
``q_decayed``: operands only, stored as the products read them, so exactly
what the walks formed before) join them. The gate cumsums and their gradient,
q/k norms, the chunks' decays, states and boundary messages stay in the
compute dtype."""


CHANNEL_COMPUTE_BUFFERS = ("dq_heads", "dk_heads")
"""Of :data:`INPUT_DTYPE_BUFFERS`, those a call with a gate per key channel
(KDA, ``OptionsKcp.gate="channel"``) keeps in the compute dtype: the
per-value-head dq and dk, as FLA's KDA backward keeps its dq and dk in fp32.
Rounded to bf16 after ``bwd_dqkwg``, again after ``bwd_wy`` added its terms,
and summed over the value heads of a key head from rounded terms, they were
up to 1.2x FLA's kernels' error: on FLA's KDA grid at bf16 (error ratio x 1e-3,
tests/precision_grid.py, bf16 -> fp32 buffers; FLA 0.5.1's kernels,
tools/fla_kda_errors.py) dk 5.06 -> 4.42 (FLA 4.42) on B1 T63, dk 6.02 -> 5.45
on B2 T500 H3, and on B2 T1024 H2 HV4 dq 6.35 -> 5.31, dk 5.29 -> 4.36;
every other figure unchanged. dw in fp32 changed no figure, so it stays in
the input dtype. GDN's calls keep all three in the input dtype (their
figures are within 1.05x of FLA's already: docs/testing.md)."""


INDEX_BUFFERS = ("seg_index",)
"""int32 pools: the segment tables (:mod:`gdn_kcp.kernels.segments`)."""


def buffer_dtype(name: str, dtype: torch.dtype, *, channel: bool = False) -> torch.dtype:
    """The dtype of workspace pool or saved tensor ``name`` for ``dtype`` inputs
    (``channel``: of a call with a gate per key channel, KDA's)."""
    if name in INDEX_BUFFERS:
        return torch.int32
    if name in INPUT_DTYPE_BUFFERS and not (channel and name in CHANNEL_COMPUTE_BUFFERS):
        return check_input_dtype(dtype)
    return compute_dtype(dtype)


def compute_element_size(dtype: torch.dtype) -> int:
    """Bytes of one compute-dtype element for inputs of ``dtype``."""
    return 8 if compute_dtype(dtype) == torch.float64 else 4
