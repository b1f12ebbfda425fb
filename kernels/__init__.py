"""Program implementations of gdn_kcp, one file per program and backend.

Installed as ``gdn_kcp.kernels``. Every backend (``torch``, ``triton``; ``cute``
later) exposes the same programs with the same signatures: tensors in,
results written into buffers handed to the program, a :class:`ChunkIndex` of
int32 tensors, and Python ints that are shape facts.
"""

from .chunk_index import CHUNK_SIZE, CROSSING_IN, CROSSING_OUT, ChunkIndex

__all__ = ["CHUNK_SIZE", "CROSSING_IN", "CROSSING_OUT", "ChunkIndex"]
