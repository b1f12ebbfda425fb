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
    """The rule of the adjoint walks' pull ``scale (diag(gamma) Q)^T dO`` for
    products under ``mode``: tf32 where they are bf16 / fp16, else ``mode``.

    The pull's operands are fp32 values no input carries (the decay and the
    scale go on dO, the norm on q), and its sum is the initial-state gradient,
    the adjoint that crosses ranks under KCP. Rounded to bf16 they made that
    gradient err 39 % more than flash-linear-attention's (3.13e-3 against
    2.25e-3 on its B2 T500 H3 HV3 case, tests/precision_grid.py); read as tf32,
    2.17e-3 (exact fp32: 2.14e-3). FLA's own kernel multiplies the same fp32
    tiles, which its ``tl.dot`` reads as tf32 on the GPU. In fp16 tf32 keeps
    fp16's 10 mantissa bits: 0.42e-3 there, against 0.30e-3 exact (and FLA's
    0.29e-3, measured under Triton's interpreter, which multiplies fp32
    exactly). Three tf32 products (``"tf32x3"``, fp32's accuracy) spilled 280 B
    per thread in the adjoint walk on sm_90 (triton 3.6), one none."""
    return "tf32" if mode in ("bf16", "fp16") else mode


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
