"""The precision rule of every matrix product, both backends (docs/design.md, "Precision"):

- bf16 / fp16 inputs: the operands in the input dtype, fp32 accumulation
  (tensor cores); states and accumulators stay fp32;
- fp32 inputs: ``torch.get_float32_matmul_precision()``: ``"highest"`` runs
  ieee fp32, ``"high"`` / ``"medium"`` tf32 (tensor cores);
- fp64 inputs: fp64.

:func:`matmul_mode` names the rule for an input dtype; the Triton programs take
it as the constexpr ``MM`` of their ``dot``, the torch programs round their
operands with :func:`round_operands` at the same points, so the twins agree.
"""

from __future__ import annotations

import torch


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype states, accumulators and fp32 tapes take for ``dtype`` inputs:
    fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.compiler.assume_constant_result
def float32_matmul_precision() -> str:
    """``torch.get_float32_matmul_precision()``, a constant of a traced graph
    (Dynamo cannot trace the call itself)."""
    return torch.get_float32_matmul_precision()


def matmul_mode(dtype: torch.dtype) -> str:
    """``"bf16"``, ``"fp16"``, ``"tf32"`` or ``"ieee"``: how the products of a
    call on ``dtype`` inputs run."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.float32 and float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def pull_mode(mode: str) -> str:
    """The rule of the adjoint walks' pull ``Q^T (c dO)`` (``c = scale gamma``,
    times q's reciprocal norm when the call normalises) for products under
    ``mode``: ``"bf16x2"`` where they are bf16, ``"tf32x2"`` where fp16, else
    ``mode``. Under the two split rules (:func:`pull`) Q is the raw input,
    which its dtype holds exactly, and the fp32 factor ``c dO`` is read as two
    terms, so the pull is fp32-accurate (16 and 22 mantissa bits of ``c dO``).

    Its sum is the initial-state gradient, the adjoint that crosses ranks under
    KCP. With ``c dO`` rounded to bf16 that gradient erred 39 % more than
    flash-linear-attention's (3.13e-3 against 2.25e-3 on its B2 T500 H3 HV3
    case, tests/precision_grid.py); with both fp32 operands read as one tf32
    product, 2.17e-3 in bf16 but 0.42e-3 in fp16 against FLA's 0.29e-3 (tf32
    keeps fp16's own 10 mantissa bits). Three tf32 products of the normalised
    q (``"tf32x3"``) spilled 280 B per thread in the adjoint walk on sm_90
    (triton 3.6); the split needs no split of Q, as the raw q is exact: two
    products, and in bf16 the two cost one tf32 product's tensor-core time."""
    return {"bf16": "bf16x2", "fp16": "tf32x2"}.get(mode, mode)


def channel_mode(mode: str) -> str:
    """The rule of KDA's intra-chunk products across sub-chunks (``kernels/torch/_channel.py``)
    for products under ``mode``: ``"tf32"`` where they are bf16 or fp16, else ``mode``.

    Both operands there are fp32 by construction (a key or query times its
    per-channel decay to the sub-chunk anchor, and the fp32 score gradients
    ``dP``), and no tape holds them: rounding them to bf16 threw away what the
    gate gradient's cancelling sums need. flash-linear-attention's KDA kernels
    take the same tiles as fp32 ``tl.dot`` operands (tf32 on tensor cores);
    tf32 also keeps fp32's exponent, so a strongly decayed operand does not
    underflow as it would in fp16. Measured (tests/precision_grid.py --kda,
    bf16, x 1e-3, bf16 operands -> this rule): on FLA's four gate-in-kernel
    cases dA 14.54 -> 4.56, 8.76 -> 6.53, 6.47 -> 4.01, 4.86 -> 3.61 and
    dbias 6.56 -> 2.37 at worst; dg 5.84 -> 3.57 at worst over the grid;
    fp16 within 0.01 of before (tf32 keeps fp16's 10 mantissa bits)."""
    return "tf32" if mode in ("bf16", "fp16") else mode


def split_operand(x: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``x`` as ``hi + lo``, each exact in the narrow type of the split
    rule ``mode`` (bf16 for ``"bf16x2"``, tf32 for ``"tf32x2"``), kept fp32."""
    narrow = "bf16" if mode == "bf16x2" else "tf32"
    hi, = round_operands(narrow, x)
    lo, = round_operands(narrow, x - hi)
    return hi, lo


def pull(q: torch.Tensor, x: torch.Tensor, mode: str) -> torch.Tensor:
    """``q @ x`` under :func:`pull_mode`'s rule ``mode``: for a split rule,
    ``q`` (exact in the narrow type) times both terms of ``x``; else :func:`mm`."""
    if mode not in ("bf16x2", "tf32x2"):
        return mm(q, x, mode)
    hi, lo = split_operand(x, mode)
    return q @ hi + q @ lo


def _round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 rounded to tf32's 10 mantissa bits (to nearest, ties away), as the
    tensor cores read it."""
    bits = x.contiguous().view(torch.int32)
    rounded = (bits + 0x1000) & ~0x1FFF
    return torch.where(torch.isfinite(x), rounded.view(torch.float32), x)


def round_operands(mode: str, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The operands of one product as the tensor cores see them under ``mode``,
    back in their own dtype (the product then accumulates in it)."""
    if mode == "bf16":
        return tuple(x.to(torch.bfloat16).to(x.dtype) for x in xs)
    if mode == "fp16":
        return tuple(x.to(torch.float16).to(x.dtype) for x in xs)
    if mode == "tf32":
        return tuple(_round_tf32(x) if x.dtype == torch.float32 else x for x in xs)
    return xs


def mm(a: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor:
    """``a @ b`` under the precision rule ``mode``."""
    a, b = round_operands(mode, a, b)
    return a @ b
