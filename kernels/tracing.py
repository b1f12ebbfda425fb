"""Whether a program runs on real tensors or is being traced.

A program is traced when Dynamo traces it, or when a ``gdn_kcp::<program>``
op (:mod:`gdn_kcp.ops.programs`) runs its body on fake or functional tensors:
its fake kernel (FakeTensorMode, Dynamo's and MemTracker's traces) and AOT
autograd's functional decomposition. A traced program must not read tensor
data into Python or make a shape from data (the torch programs then write
rows with a fixed-shape ``where`` instead of a masked write), and a traced
Triton launch goes through ``torch.library.wrap_triton`` (which takes warps
and stages as launch options, but not ``maxnreg``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_state = threading.local()


def traced() -> bool:
    """True while the running program is being traced (see the module)."""
    return torch.compiler.is_compiling() or getattr(_state, "traced", False)


@contextlib.contextmanager
def tracing(flag: bool) -> Iterator[None]:
    """Within the block, :func:`traced` is at least ``flag`` (the program ops
    set it for a body run on fake or functional tensors)."""
    previous = getattr(_state, "traced", False)
    _state.traced = previous or flag
    try:
        yield
    finally:
        _state.traced = previous
