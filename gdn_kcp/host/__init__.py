"""The host path: the ordered program sequence of one forward and one backward.

It owns every allocation and every exchange; programs only fill the buffers it
hands them. The same sequence serves one rank (no document crosses a rank) and
KCP (summary, exchange, boundary states).
"""

from .backward import Grads, host_backward
from .forward import Buffers, Call, ForwardTapes, host_forward

__all__ = ["Buffers", "Call", "ForwardTapes", "Grads", "host_backward", "host_forward"]
