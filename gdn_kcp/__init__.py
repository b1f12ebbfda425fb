"""gdn_kcp: Gated DeltaNet training kernels with key-context parallelism.

See README.md for the quick start and DESIGN.md for the contract.
"""

from gdn_kcp.chunk import chunk_gated_delta_rule
from gdn_kcp.reference import naive_recurrence

__version__ = "0.1.0"

__all__ = [
    "chunk_gated_delta_rule",
    "naive_recurrence",
]
