"""Boundary exchanges of a KCP call (docs/kcp.md).

Forward: every rank with a crossing-out fragment contributes its summary
``(M, S_loc)``; every rank with a crossing-in fragment gets its true start
state ``S_in``. Backward: every crossing-in rank contributes ``nu`` (and its M),
every crossing-out rank gets its true end adjoint ``lambda_end``.
``exchange="a2a"`` runs c1/c2 and b1/b2 through owner slices; ``"ring"`` passes
states along each chain. Each exchange counts the bytes it hands to
torch.distributed (:func:`record_comm_bytes`).
"""

from .a2a import backward_a2a, forward_a2a
from .counting import record_comm_bytes
from .ring import backward_ring, forward_ring

__all__ = ["backward_a2a", "backward_ring", "forward_a2a", "forward_ring", "record_comm_bytes"]
