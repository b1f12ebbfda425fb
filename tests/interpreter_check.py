"""Whether Triton's interpreter runs a loop over an int argument (the shape
of every program's loops): see ``conftest.pytest_configure``."""

from __future__ import annotations

import numpy
import torch
import triton
import triton.language as tl


@triton.jit
def _count_kernel(x, n, STEP: tl.constexpr):
    acc = tl.zeros([16], dtype=tl.float32)
    for _ in range(0, n, STEP):
        acc += 1.0
    tl.store(x + tl.arange(0, 16), acc)


def interpreter_runs_loops() -> str | None:
    """None when it does; otherwise what to install instead."""
    x = torch.zeros(16)
    try:
        _count_kernel[(1,)](x, 64, STEP=16)
    except Exception as e:  # the interpreter wraps the numpy error in its own
        return (f"Triton {triton.__version__}'s interpreter cannot run the programs' loops with numpy "
                f"{numpy.__version__} ({e!r}); install numpy<2.4 (pip install 'numpy<2.4') or triton>=3.9")
    assert torch.equal(x, torch.full((16,), 4.0)), x
    return None
