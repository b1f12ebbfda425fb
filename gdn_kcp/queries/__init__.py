"""Byte queries: pure functions of (context, shapes, dtypes, options). The host
path and the exchanges size what they allocate and send by calling them."""

from .comm import COLLECTIVES, a2a_split_elements, gdn_comm_bytes_kcp, ring_elements

__all__ = ["COLLECTIVES", "a2a_split_elements", "gdn_comm_bytes_kcp", "ring_elements"]
