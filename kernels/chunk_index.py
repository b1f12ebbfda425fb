"""The chunk index every program reads: where each chunk and fragment lies.

A *fragment* is the part of one document that lies in this rank's token range
(on a single rank, a fragment is a whole document). Chunks of ``CHUNK_SIZE``
tokens are cut relative to each fragment's start, so a fragment of length L
holds ``ceil(L / CHUNK_SIZE)`` chunks and the last one may be short.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK_SIZE = 64
"""Chunk length C of the chunk form (DESIGN.md §2)."""

CROSSING_IN = 1
"""Fragment flag: the document started on an earlier rank."""

CROSSING_OUT = 2
"""Fragment flag: the document continues on a later rank."""


@dataclass(frozen=True)
class ChunkIndex:
    """Per-chunk and per-fragment tables (int32 tensors) plus shape facts.

    Per chunk ``[n_chunks]``: ``chunk_start`` (first token, rank-local),
    ``chunk_len`` (tokens, 1..C), ``chunk_frag`` (fragment id).
    Per fragment ``[n_frag]``: ``frag_start`` (first token), ``frag_len``,
    ``frag_first_chunk``, ``frag_n_chunks``, ``frag_doc`` (document id, the row
    of initial / final states), ``frag_flags`` (``CROSSING_IN | CROSSING_OUT``).
    Ints: ``n_tokens``, ``n_chunks``, ``n_frag``, ``max_frag_chunks`` (the
    number of steps of a state walk).
    """

    chunk_start: torch.Tensor
    chunk_len: torch.Tensor
    chunk_frag: torch.Tensor
    frag_start: torch.Tensor
    frag_len: torch.Tensor
    frag_first_chunk: torch.Tensor
    frag_n_chunks: torch.Tensor
    frag_doc: torch.Tensor
    frag_flags: torch.Tensor
    n_tokens: int
    n_chunks: int
    n_frag: int
    max_frag_chunks: int

    @staticmethod
    def from_fragments(
        frag_bounds: list[int],
        *,
        frag_doc: list[int] | None = None,
        frag_flags: list[int] | None = None,
        device: torch.device | str = "cpu",
    ) -> "ChunkIndex":
        """Build the index from host fragment boundaries ``[0, e_1, ..., T]``.

        ``frag_doc`` defaults to ``0..n_frag-1`` and ``frag_flags`` to no
        crossing. Example: ``ChunkIndex.from_fragments([0, 100, 100, 130])``
        has fragments of 100, 0 and 30 tokens in 2 + 0 + 1 chunks.
        """
        n_frag = len(frag_bounds) - 1
        lengths = [frag_bounds[i + 1] - frag_bounds[i] for i in range(n_frag)]
        n_chunks_per = [-(-length // CHUNK_SIZE) for length in lengths]
        chunk_start, chunk_len, chunk_frag, first = [], [], [], []
        for f, (start, length, count) in enumerate(zip(frag_bounds, lengths, n_chunks_per)):
            first.append(len(chunk_start))
            for c in range(count):
                chunk_start.append(start + c * CHUNK_SIZE)
                chunk_len.append(min(CHUNK_SIZE, length - c * CHUNK_SIZE))
                chunk_frag.append(f)
        if frag_doc is None:
            frag_doc = list(range(n_frag))
        if frag_flags is None:
            frag_flags = [0] * n_frag

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return ChunkIndex(
            chunk_start=i32(chunk_start),
            chunk_len=i32(chunk_len),
            chunk_frag=i32(chunk_frag),
            frag_start=i32(frag_bounds[:-1]),
            frag_len=i32(lengths),
            frag_first_chunk=i32(first),
            frag_n_chunks=i32(n_chunks_per),
            frag_doc=i32(frag_doc),
            frag_flags=i32(frag_flags),
            n_tokens=frag_bounds[-1] if frag_bounds else 0,
            n_chunks=len(chunk_start),
            n_frag=n_frag,
            max_frag_chunks=max(n_chunks_per, default=0),
        )

    def to(self, device: torch.device | str) -> "ChunkIndex":
        """The same index with its tensors on ``device``."""
        fields = {
            name: getattr(self, name).to(device) if isinstance(getattr(self, name), torch.Tensor)
            else getattr(self, name)
            for name in self.__dataclass_fields__
        }
        return ChunkIndex(**fields)
