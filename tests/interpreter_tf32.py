"""tf32 products under Triton's interpreter as sm_90's tensor cores take them.

The interpreter multiplies a ``tl.dot``'s fp32 operands exactly whatever its
``input_precision``; on a GPU a dot at ``"tf32"`` (Triton's default for fp32
operands) reads both as tf32. :func:`read_tf32_dots` patches the interpreter
so that it rounds them first (to tf32's 10 mantissa bits, to nearest with ties
away: ``gdn_kcp.kernels.precision``'s rule for the torch twins), which makes a
Triton program's precision under the interpreter its precision on a GPU.
``tools/fla_kda_errors.py`` reads FLA's kernels the same way."""

from __future__ import annotations

import numpy as np


def round_tf32(data: np.ndarray) -> np.ndarray:
    """fp32 values rounded to tf32's 10 mantissa bits (non-finite values kept)."""
    data = np.asarray(data, dtype=np.float32)
    bits = data.view(np.uint32)
    out = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)
    return np.where(np.isfinite(data), out, data)


def reads_as_tf32(a, b, input_precision) -> bool:
    """Whether a dot of interpreter handles ``a``, ``b`` at ``input_precision`` reads tf32 on a GPU."""
    import triton.language as tl

    fp32 = a.dtype.scalar == tl.float32 and b.dtype.scalar == tl.float32
    return fp32 and getattr(input_precision, "name", input_precision) == "TF32"


def tf32_handle(h):
    """An fp32 interpreter handle with its values rounded as :func:`round_tf32` (a tensor core's read)."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    return TensorHandle(round_tf32(h.data), tl.float32)


def read_tf32_dots() -> None:
    """Patch the interpreter's ``create_dot``: tf32 dots round their fp32 operands first."""
    from triton.runtime.interpreter import InterpreterBuilder

    dot = InterpreterBuilder.create_dot
    if getattr(dot, "reads_tf32", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if reads_as_tf32(a, b, input_precision):
            a, b = tf32_handle(a), tf32_handle(b)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot.reads_tf32 = True
    InterpreterBuilder.create_dot = create_dot
