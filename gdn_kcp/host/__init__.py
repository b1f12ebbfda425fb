"""The host path: the ordered program sequence of one forward and one backward.

It owns every allocation and every exchange; programs only fill the buffers it
hands them. ``forward_local`` / ``backward_local`` run the rank-local part
(prep, tape walk, output; local dv, adjoint walk, gradient programs) given the
boundary states that the KCP layer supplies.
"""

from .local import ForwardTapes, backward_local, forward_local

__all__ = ["ForwardTapes", "backward_local", "forward_local"]
