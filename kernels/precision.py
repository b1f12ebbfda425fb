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
