"""KcpContext: this rank's view of how one packed stream is split over the
ranks of a process group.

Built once per packing (host work, one small collective; see
:mod:`gdn_kcp.context.build`); every KCP call and byte query reads it. It knows
every rank's fragment counts, so each rank can size every exchange without
asking the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gdn_kcp.kernels import ChunkIndex


@dataclass(frozen=True, eq=False)
class KcpContext:
    """This rank's view of a KCP split.

    Group: ``R`` ranks, this one is ``rank``; ``group`` (None on a single rank
    without torch.distributed) and its ``group_name``.
    Split: ``rank_ranges[r] = (start, end)`` global token range of rank r;
    ``n_tokens`` is this rank's length, ``n_tokens_global`` the stream's.
    Per rank r (host tuples, every rank knows them): ``rank_n_in[r]``,
    ``rank_n_out[r]`` (0 or 1: a crossing-in / crossing-out fragment) and
    ``rank_middle[r]`` (1 when its one fragment crosses in and out),
    ``rank_prev[r]`` / ``rank_next[r]`` (the chain neighbours of its crossing-in /
    crossing-out fragment, -1 for none).
    Chains: ``chains`` lists, per document that crosses a rank boundary, the
    ranks holding its fragments in order (the owners compose along them).
    This rank: ``index`` (a :class:`ChunkIndex` on the CPU; on the call's device
    in a context rebuilt inside an op) and ``device_index`` (the same tables on
    ``device``); fragments carry global document ids.

    Capped (``max_docs`` set, docs/design.md, "Capture once"): every int above is a function of
    the caps (R, the rank ranges, ``max_docs``), never of the packing. The
    index has the sizes of :func:`~gdn_kcp.kernels.chunk_index.capped_sizes`
    with sentinel rows, ``n_docs = max_docs`` (the stream is padded with
    zero-length documents at T), and the crossing facts are those of a document
    that crosses every boundary between non-empty ranks: each such rank joins
    every exchange, and one whose fragment does not cross sends the identity of
    the composition (``M = 0``, ``S_loc = 0``), read from the device tables.
    """

    R: int
    rank: int
    group: object
    group_name: str
    rank_ranges: tuple[tuple[int, int], ...]
    n_docs: int
    rank_n_in: tuple[int, ...]
    rank_n_out: tuple[int, ...]
    rank_middle: tuple[int, ...]
    rank_prev: tuple[int, ...]
    rank_next: tuple[int, ...]
    chains: tuple[tuple[int, ...], ...]
    index: ChunkIndex
    device_index: ChunkIndex = field(repr=False)
    max_docs: int | None = None
    n_sms: int = 1
    """Streaming multiprocessors of the device (CPU cores on the CPU): what the
    segment plan (:func:`gdn_kcp.plan.plan_segments`) fills."""
    plan_chunks: int = 0
    """Chunks of the longest fragment on any rank (a cap on a capped context):
    the plan's metadata, the same on every rank."""
    plan_frags: int = 0
    """The most fragments any rank holds (``max_docs`` on a capped context)."""
    segment_rows: tuple[int, ...] = ()
    """Summary rows of this rank at P = 1, ..., 64 segments
    (:mod:`gdn_kcp.kernels.segments`): counted from the fragments of an exact
    context, the caps' bound on a capped one."""
    doc_rows: tuple[tuple[int, ...], tuple[int, ...]] | None = field(default=None, compare=False)
    """``(start_docs, end_docs)`` as host facts when the packing was read on
    the host at build time (None for a capped context built without that
    read: from a fake or traced tensor): not caps."""
    frag_tokens: tuple[int, ...] | None = field(default=None, compare=False)
    """Each fragment's token count as host facts, on an exact context built
    from host bounds (None on a capped one, or one rebuilt from ``meta``):
    what the byte queries count real rows from without reading the index."""
    packing_digest: int = field(default=0, compare=False)
    """A digest of the packing a capped context was built from on the host (0
    when unknown): not a cap (``meta`` leaves it out), read by the
    ``GDN_KCP_CHECK_RANKS`` check to tell two packings of the same caps apart."""

    @property
    def capped(self) -> bool:
        return self.max_docs is not None

    @property
    def n_tokens(self) -> int:
        return self.rank_ranges[self.rank][1] - self.rank_ranges[self.rank][0]

    @property
    def n_tokens_global(self) -> int:
        return self.rank_ranges[-1][1]

    @property
    def n_in(self) -> int:
        return self.rank_n_in[self.rank]

    @property
    def n_out(self) -> int:
        return self.rank_n_out[self.rank]

    @property
    def n_frag(self) -> int:
        return self.index.n_frag

    @property
    def n_start_docs(self) -> int:
        """Rows of a :func:`gdn_kcp` initial state: the documents that start on
        this rank (zero-length ones included); ``max_docs`` on a capped context,
        whose rows past ``len(start_docs)`` are padding (not read)."""
        return self.index.n_frag if self.capped else self.index.n_frag - self.n_in

    @property
    def n_end_docs(self) -> int:
        """Rows of a :func:`gdn_kcp` final state: the documents that end on this
        rank; ``max_docs`` on a capped context (rows past ``len(end_docs)`` are zero)."""
        return self.index.n_frag if self.capped else self.index.n_frag - self.n_out

    def _doc_list(self, which: int) -> list[int]:
        if self.doc_rows is None:
            raise ValueError(
                "this capped context was built without reading its bounds on the host (from a fake or traced "
                "cu_seqlens_global), so which documents start and end on this rank is data on the device: "
                "build the context from readable bounds (a list or a real tensor) to know them"
            )
        return list(self.doc_rows[which])

    @property
    def start_docs(self) -> list[int]:
        """Global ids of the documents that start on this rank, in order: the
        leading rows of the initial state (host facts of the build; no read
        of a table)."""
        return self._doc_list(0)

    @property
    def end_docs(self) -> list[int]:
        """Global ids of the documents that end on this rank, in order: the
        leading rows of the final state."""
        return self._doc_list(1)

    @property
    def exchanges(self) -> bool:
        """True when some document crosses a rank boundary (the collectives run)."""
        return bool(self.chains)

    @property
    def meta(self) -> list[int]:
        """Every host fact of this rank's view as ints (the ops take it):
        ``[R, rank, n_tokens, n_chunks, n_frag, max_frag_chunks, n_docs, capped]``,
        then the flat rank ranges and, per rank, n_in, n_out, middle, prev, next,
        then ``n_sms, plan_chunks, plan_frags`` and the 64 ``segment_rows``.
        On a capped context every one is a cap."""
        index = self.index
        head = [self.R, self.rank, index.n_tokens, index.n_chunks, index.n_frag, index.max_frag_chunks, self.n_docs,
                int(self.capped)]
        per_rank = [x for pair in self.rank_ranges for x in pair]
        for column in (self.rank_n_in, self.rank_n_out, self.rank_middle, self.rank_prev, self.rank_next):
            per_rank.extend(column)
        return head + per_rank + [self.n_sms, self.plan_chunks, self.plan_frags, *self.segment_rows]

    @property
    def layout_key(self) -> tuple[int, ...]:
        """The host facts every byte query of this rank is a function of
        (:attr:`meta`): two contexts with equal keys have equal layouts, so a
        workspace made for one serves the other (every packing of a capped
        context's caps has the same key)."""
        return tuple(self.meta)

    def summary_rows(self, P: int) -> int:
        """Summary rows of this rank at P segments (:attr:`segment_rows`)."""
        return self.segment_rows[P - 1] if P > 1 else 0

    def index_for(self, device: torch.device) -> ChunkIndex:
        """The index the programs read for tensors on ``device``: the host
        tables on the CPU, the device copy elsewhere."""
        return self.index if device.type == "cpu" else self.device_index

    def owner_heads(self, HV: int) -> int:
        """``s_owner = ceil(HV / R)``: value heads per owner slice (the last padded)."""
        return -(-HV // self.R)

    def padded_heads(self, HV: int) -> int:
        """``s_pad = R * s_owner``: heads of a padded summary or state on the wire."""
        return self.R * self.owner_heads(HV)
