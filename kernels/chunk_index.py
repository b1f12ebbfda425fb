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
"""Chunk length C of the chunk form (docs/design.md)."""

CROSSING_IN = 1
"""Fragment flag: the document started on an earlier rank."""

CROSSING_OUT = 2
"""Fragment flag: the document continues on a later rank."""

PADDING = 4
"""Fragment flag of a sentinel row of a capped index. A sentinel is stored as
``PADDING | CROSSING_IN | CROSSING_OUT`` with no chunks: it reads no initial
state and writes no final state, so the walks need no branch of their own."""

SENTINEL_FLAGS = PADDING | CROSSING_IN | CROSSING_OUT


@dataclass(frozen=True)
class ChunkIndex:
    """Two int32 tables plus shape facts.

    ``chunk_table`` ``[3, n_chunks]``, one row each: ``chunk_start`` (first
    token, rank-local), ``chunk_len`` (tokens, 1..C), ``chunk_frag`` (fragment).
    ``frag_table`` ``[6, n_frag]``: ``frag_start`` (first token), ``frag_len``,
    ``frag_first_chunk``, ``frag_n_chunks``, ``frag_doc`` (global document id),
    ``frag_flags`` (``CROSSING_IN | CROSSING_OUT``).
    State rows: fragment f's final state (and its gradient) is row f of this
    rank's final states, its initial state (and gradient) row ``f - n_in``
    (:func:`initial_row_shift`): documents ending here, and starting here, in
    order. Only fragment 0 can cross in and only the last can cross out.
    Each row is a property (a view). Ints: ``n_tokens``, ``n_chunks``,
    ``n_frag``, ``max_frag_chunks`` (the number of steps of a state walk).
    The two tables are what the ops take.

    A *capped* index (:func:`capped_index`) has the ints of its caps and
    sentinel rows after the real ones: chunks of length 0 (every program
    masks all of their rows) and fragments flagged ``SENTINEL_FLAGS`` with
    document id -1.
    """

    chunk_table: torch.Tensor
    frag_table: torch.Tensor
    n_tokens: int
    n_chunks: int
    n_frag: int
    max_frag_chunks: int

    chunk_start = property(lambda self: self.chunk_table[0])
    chunk_len = property(lambda self: self.chunk_table[1])
    chunk_frag = property(lambda self: self.chunk_table[2])
    frag_start = property(lambda self: self.frag_table[0])
    frag_len = property(lambda self: self.frag_table[1])
    frag_first_chunk = property(lambda self: self.frag_table[2])
    frag_n_chunks = property(lambda self: self.frag_table[3])
    frag_doc = property(lambda self: self.frag_table[4])
    frag_flags = property(lambda self: self.frag_table[5])
    frag_carry = property(lambda self: self.frag_table[6])
    """Row of the carry plane a segment row starts (ends) at: the seventh row
    of a phase-3 index of :mod:`gdn_kcp.kernels.segments` only."""

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
        chunks: list[tuple[int, int, int]] = []
        first = []
        for f, (start, length, count) in enumerate(zip(frag_bounds, lengths, n_chunks_per)):
            first.append(len(chunks))
            chunks.extend(
                (start + c * CHUNK_SIZE, min(CHUNK_SIZE, length - c * CHUNK_SIZE), f) for c in range(count)
            )
        frag_rows = [
            frag_bounds[:-1], lengths, first, n_chunks_per,
            list(range(n_frag)) if frag_doc is None else frag_doc,
            [0] * n_frag if frag_flags is None else frag_flags,
        ]
        return ChunkIndex(
            chunk_table=torch.tensor([list(row) for row in zip(*chunks)] if chunks else [[], [], []],
                                     dtype=torch.int32, device=device).view(3, len(chunks)),
            frag_table=torch.tensor(frag_rows, dtype=torch.int32, device=device).view(6, n_frag),
            n_tokens=frag_bounds[-1] if frag_bounds else 0,
            n_chunks=len(chunks),
            n_frag=n_frag,
            max_frag_chunks=max(n_chunks_per, default=0),
        )

    def to(self, device: torch.device | str) -> "ChunkIndex":
        """The same index with its tables on ``device``."""
        return ChunkIndex(
            self.chunk_table.to(device), self.frag_table.to(device),
            self.n_tokens, self.n_chunks, self.n_frag, self.max_frag_chunks,
        )


def capped_sizes(n_tokens: int, max_docs: int) -> tuple[int, int, int]:
    """``(n_chunks, n_frag, max_frag_chunks)`` of a capped index: the most any
    packing of ``max_docs`` documents can give a range of ``n_tokens`` tokens.

    Fragments are parts of distinct documents, so at most ``max_docs``; at most
    ``m = min(max_docs, n_tokens)`` of them hold tokens, and ``m`` fragments of
    lengths ``L_i`` summing to ``n_tokens`` cut ``sum ceil(L_i / C) <=
    (n_tokens + m (C - 1)) // C`` chunks (equality at lengths ``= 1 mod C``).
    """
    m = min(max_docs, n_tokens)
    return (n_tokens + m * (CHUNK_SIZE - 1)) // CHUNK_SIZE, max_docs, -(-n_tokens // CHUNK_SIZE)


def static_length(x: torch.Tensor) -> int:
    """``len(x)`` as a Python int even when torch.compile traces it as a symbol
    (after a length changed between calls): the document count is a cap, so
    every length gets its own graph. ``range`` is a place where Dynamo turns a
    symbol into its value, with a guard on it. (A symbolic count would have to
    pass through the byte queries, whose layout code Dynamo does not trace.)"""
    return len(range(x.shape[0]))


def capped_index(cu_seqlens: torch.Tensor, start: int, end: int, *, last_rank: bool) -> ChunkIndex:
    """The index of token range ``[start, end)`` of the stream ``cu_seqlens``
    (``[N + 1]``, valid bounds ending at the stream's T), at the caps of ``N``
    documents (:func:`capped_sizes`), built on ``cu_seqlens``'s device.

    Torch ops at static shapes only (no host read, no data-dependent shape), so
    it traces into one graph for every packing of N documents. A zero-length
    document at position p belongs to the range with ``start <= p < end`` (the
    last range for p = T), as in an exact index. Example: ``capped_index(
    torch.tensor([0, 100, 100, 130]), 0, 130, last_rank=True)`` has fragments of
    100, 0 and 30 tokens in 2 + 0 + 1 chunks, padded to 4 chunk rows.
    """
    C = CHUNK_SIZE
    cu = cu_seqlens.to(torch.int64)
    N, device = static_length(cu) - 1, cu.device
    if N == 0:  # an empty stream
        return ChunkIndex.from_fragments([0], device=device)
    n_chunks, n_frag, max_frag_chunks = capped_sizes(end - start, N)
    s, e = cu[:-1], cu[1:]
    lo, hi = s.clamp(start, end), e.clamp(start, end)
    length = hi - lo
    here = (s >= start) & ((s < end) | (s == end) if last_rank else (s < end))
    exists = (length > 0) | ((s == e) & here)
    flags = (s < start).long() * CROSSING_IN + (e > end).long() * CROSSING_OUT
    frag_chunks = torch.where(exists, (length + C - 1) // C, 0)
    first_chunk = torch.cumsum(frag_chunks, 0) - frag_chunks
    columns = torch.stack([lo - start, length, first_chunk, frag_chunks, torch.arange(N, device=device), flags])
    # real fragments go to their rank order, the others to a spare column N that is dropped
    slot = torch.where(exists, torch.cumsum(exists.long(), 0) - 1, N)
    # A sentinel's chunk range is empty and starts at T_r, past every real chunk
    # (a chunk holds a token): the range ends stay sorted for searchsorted.
    sentinel = torch.tensor([end - start, 0, end - start, 0, -1, SENTINEL_FLAGS], dtype=torch.int64, device=device)
    # repeat, not expand: Inductor (torch 2.13, CPU) miscompiled index_copy into an
    # expanded sentinel that was computed (torch.where), writing every column into one.
    frag_table = sentinel[:, None].repeat(1, N + 1).index_copy(1, slot, columns)[:, :N]

    # chunk j lies in the first fragment whose chunk range ends after j
    j = torch.arange(n_chunks, device=device)
    f = torch.searchsorted(frag_table[2] + frag_table[3], j, right=True).clamp(max=N - 1)
    real = j < frag_chunks.sum()
    offset = (j - frag_table[2].gather(0, f)) * C
    chunk_table = torch.stack([
        torch.where(real, frag_table[0].gather(0, f) + offset, 0),
        torch.where(real, (frag_table[1].gather(0, f) - offset).clamp(max=C), 0),
        torch.where(real, f, 0),
    ])
    return ChunkIndex(chunk_table.to(torch.int32), frag_table.to(torch.int32), end - start, n_chunks, n_frag,
                      max_frag_chunks)


def crosses(frag_flags: torch.Tensor, flag: int) -> torch.Tensor:
    """Where a real fragment crosses ``flag``'s way (``CROSSING_IN`` or
    ``CROSSING_OUT``); a sentinel row never does."""
    return (frag_flags & (flag | PADDING)) == flag


def last_real_fragment(frag_flags: torch.Tensor) -> torch.Tensor:
    """``[1]``: the last fragment that is not a sentinel (sentinels follow the
    real rows; 0 when there is none). Read on the device, no host sync."""
    return ((frag_flags & PADDING) == 0).sum().sub(1).clamp(min=0).reshape(1)


def initial_row_shift(frag_flags: torch.Tensor) -> torch.Tensor:
    """``n_in`` as a ``[1]`` tensor (``[0]`` without fragments): fragment f's row
    in the initial states is ``f - n_in``. Read on the device, no host sync."""
    return (frag_flags[:1] & CROSSING_IN).ne(0).long()
