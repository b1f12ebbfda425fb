"""KcpContext: how one packed stream is split over the ranks of a process group.

Built once per packing (host work, one small collective); every KCP call and
byte query reads it. It knows every rank's fragment counts, so each rank can
size every exchange without asking the others.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from gdn_kcp.groups import digest, group_device, resolve_group
from gdn_kcp.kernels import CROSSING_IN, CROSSING_OUT, ChunkIndex
from gdn_kcp.kernels.chunk_index import CHUNK_SIZE, capped_index
from gdn_kcp.kernels.segments import MAX_SEGMENTS, capped_summary_rows, summary_row_counts
from gdn_kcp.validate import (
    check_bounds,
    check_bounds_tensor,
    check_cu_seqlens,
    check_cu_seqlens_traced,
    check_max_docs,
    values_readable,
)


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

    Capped (``max_docs`` set, DESIGN.md §5.1): every int above is a function of
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


def default_ranges(T: int, R: int) -> list[tuple[int, int]]:
    """Contiguous ranges as equal as possible: rank r holds ``[r T // R, (r + 1) T // R)``."""
    return [(r * T // R, (r + 1) * T // R) for r in range(R)]


def check_ranges(ranges: object, T: int, R: int) -> list[tuple[int, int]]:
    if not isinstance(ranges, (list, tuple)) or len(ranges) != R:
        raise ValueError(f"rank_ranges must list one (start, end) per rank (R = {R}), got {ranges!r}")
    pairs = [tuple(int(x) for x in pair) for pair in ranges]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"rank_ranges must hold (start, end) pairs, got {ranges!r}")
    if pairs[0][0] != 0 or pairs[-1][1] != T:
        raise ValueError(f"rank_ranges must cover [0, T = {T}), got {pairs}")
    for r, (start, end) in enumerate(pairs):
        if end < start:
            raise ValueError(f"rank_ranges[{r}] = {(start, end)} ends before it starts")
        if r + 1 < R and pairs[r + 1][0] != end:
            raise ValueError(
                f"rank_ranges must be contiguous, got rank_ranges[{r}] = {(start, end)} and "
                f"rank_ranges[{r + 1}] = {pairs[r + 1]}"
            )
    return pairs


def rank_fragments(bounds: list[int], start: int, end: int, last_rank: bool) -> list[tuple[int, int, int, int]]:
    """``(doc, local_start, local_end, flags)`` of every document part in
    ``[start, end)``. A zero-length document at position p belongs to the rank
    with ``start <= p < end`` (the last rank for p = T): it carries its initial
    state to its final state there."""
    frags = []
    for doc in range(len(bounds) - 1):
        s, e = bounds[doc], bounds[doc + 1]
        lo, hi = max(s, start), min(e, end)
        if lo < hi or (s == e and (start <= s < end or (last_rank and s == end))):
            flags = (CROSSING_IN if s < start else 0) | (CROSSING_OUT if e > end else 0)
            frags.append((doc, lo - start, max(hi, lo) - start, flags))
    return frags


def check_same_everywhere(facts: dict[str, object], group: object, R: int, what: str) -> None:
    """One all_gather of one digest per fact; every rank raises a ``ValueError``
    naming the facts, and the ranks whose values differ from rank 0's."""
    device = group_device(group)
    mine = torch.tensor([digest(value) for value in facts.values()], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(R)]
    dist.all_gather(gathered, mine, group=group)
    every = torch.stack(gathered).cpu()
    for column, name in enumerate(facts):
        differ = [r for r in range(R) if every[r, column] != every[0, column]]
        if differ:
            raise ValueError(f"{what}: ranks {differ} were given a different {name} than rank 0")


_AGREED_CAPS: set[tuple] = set()
"""Caps a group's ranks were found to agree on (ints and names, no tensors):
a capped context per step runs no collective after the first."""


def build_kcp_context(
    cu_seqlens_global: torch.Tensor,
    group: object = None,
    *,
    rank_ranges: list[tuple[int, int]] | None = None,
    device: torch.device | str | None = None,
    max_docs: int | None = None,
    n_sms: int | None = None,
    n_tokens: int | None = None,
) -> KcpContext:
    """Split the packed stream of ``cu_seqlens_global`` (``[N + 1]``, int32/int64,
    or a list of ints; the same on every rank) across the ranks of ``group``:
    None (the default group), a ``ProcessGroup``, a 1-D ``DeviceMesh`` (e.g.
    ``mesh["cp"]``) or a ``(mesh, "cp")`` pair naming the context-parallel
    dimension of a larger mesh (:func:`gdn_kcp.groups.resolve_group`).

    A list needs no read of tensor data, so it also works under FakeTensorMode
    (the index tables are then fake tensors). A tensor whose values the host
    cannot read (a FakeTensor, or one traced by torch.compile) builds a capped
    context with no read at all: it needs ``max_docs`` and the stream's length
    ``n_tokens`` (or ``rank_ranges``, which end at it), and its values are
    checked by device-side asserts. ``n_tokens`` given with readable bounds
    must equal their last value.

    Default split: contiguous and as equal as possible. ``rank_ranges`` gives any
    contiguous split covering ``[0, T)`` (uneven, empty ranks allowed), the same
    on every rank. Without torch.distributed initialised and with ``group=None``
    the context is a single rank. ``device``: where the device copy of the
    metadata lives (default: CUDA for an NCCL group, else CPU).

    ``n_sms``: the streaming multiprocessors the segment plan fills
    (:func:`gdn_kcp.plan.plan_segments`); default: the SM count of ``device``
    when it is a CUDA device, else the CPU's cores. The ranks check that they
    agree on it (it decides P, which must be the same on every rank).

    ``max_docs=N_cap`` builds a *capped* context (DESIGN.md §5.1): the stream
    may hold at most ``N_cap`` documents (zero-length ones included; it is
    padded with zero-length documents at T), and every shape and int the calls
    see depends on R, ``rank_ranges`` and ``N_cap`` only, so one compiled
    graph, one CUDA graph and one :class:`~gdn_kcp.WorkspaceKcp` serve every
    packing. Its ranks check once per group and caps, with one small
    collective, that they agree on the caps; an exact context (``max_docs=None``)
    checks ``cu_seqlens_global`` and ``rank_ranges`` on every build.

    Example::

        ctx = build_kcp_context(torch.tensor([0, 700, 1000, 4096]), rank_ranges=[(0, 1000), (1000, 4096)])
        ctx = build_kcp_context(cu_seqlens_of_this_step, max_docs=64)   # training: one layout for every step
    """
    group = resolve_group(group)
    bounds, T = _global_bounds(cu_seqlens_global, max_docs, n_tokens, rank_ranges)
    if dist.is_available() and dist.is_initialized():
        R, rank = dist.get_world_size(group), dist.get_rank(group)
        if rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of group={group!r}")
        group_name = (group if group is not None else dist.group.WORLD).group_name
    elif group is None:
        R, rank, group_name = 1, 0, ""
    else:
        raise ValueError(f"group={group!r} was given but torch.distributed is not initialised")
    ranges = default_ranges(T, R) if rank_ranges is None else check_ranges(rank_ranges, T, R)
    if device is None:
        device = group_device(group) if R > 1 else torch.device("cpu")
    n_sms = device_sms(device) if n_sms is None else check_sms(n_sms)
    if R > 1 and torch._guards.detect_fake_mode() is not None:
        pass  # a fake all-gather carries no values: the ranks' agreement is checked by the real run
    elif R > 1 and max_docs is None:
        check_same_everywhere({"cu_seqlens_global": bounds, "rank_ranges": ranges, "n_sms": n_sms}, group, R,
                              "build_kcp_context")
    elif R > 1 and (group_name, tuple(ranges), max_docs, n_sms) not in _AGREED_CAPS:
        check_same_everywhere({"rank_ranges": ranges, "max_docs": max_docs, "n_sms": n_sms}, group, R,
                              "build_kcp_context (capped)")
        _AGREED_CAPS.add((group_name, tuple(ranges), max_docs, n_sms))
    if bounds is None:  # values on the device: pad to the cap with zero-length documents at T, read nothing
        cu = cu_seqlens_global.to(torch.int64)
        padded = torch.cat([cu, cu.new_full((max_docs + 1 - cu.shape[0],), T)])
        return capped_context(padded, ranges, rank, group=group, group_name=group_name, device=device, n_sms=n_sms)
    return context_from_split(bounds, ranges, rank, group=group, group_name=group_name, device=device,
                              max_docs=max_docs, n_sms=n_sms)


def _global_bounds(cu_seqlens_global: object, max_docs: object, n_tokens: object,
                   rank_ranges: object) -> tuple[list[int] | None, int]:
    """``(bounds, T)`` of :func:`build_kcp_context`'s stream, checked; bounds
    None for a tensor whose values the host cannot read (then checked on the
    device against the T of ``n_tokens`` or ``rank_ranges``)."""
    name = "cu_seqlens_global"
    if n_tokens is not None and (isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0):
        raise ValueError(f"n_tokens must be an int >= 0 or None, got {n_tokens!r}")
    if isinstance(cu_seqlens_global, (list, tuple)):
        bounds = check_bounds(name, cu_seqlens_global, n_tokens)
    elif isinstance(cu_seqlens_global, torch.Tensor) and values_readable(cu_seqlens_global):
        bounds = check_cu_seqlens(cu_seqlens_global, n_tokens, name=name)
    elif isinstance(cu_seqlens_global, torch.Tensor):
        check_bounds_tensor(name, cu_seqlens_global)
        if max_docs is None:
            raise ValueError(f"{name} is a fake or traced tensor, whose values cannot be read on the host: pass "
                             f"max_docs= for a capped context (its layout depends on the caps only), or the bounds "
                             f"as a list")
        check_max_docs(max_docs, cu_seqlens_global.shape[0] - 1, name)
        T = n_tokens if n_tokens is not None else _ranges_end(rank_ranges)
        if T is None:
            raise ValueError(f"{name} is a fake or traced tensor, whose values cannot be read on the host: pass "
                             f"n_tokens= (the stream's length T) or rank_ranges=")
        check_cu_seqlens_traced(cu_seqlens_global, T, name=name)
        return None, T
    else:
        raise TypeError(f"{name} must be a torch.Tensor or a list of ints [N + 1], got "
                        f"{type(cu_seqlens_global).__name__}")
    if max_docs is not None:
        check_max_docs(max_docs, len(bounds) - 1, name)
    return bounds, bounds[-1]


def _ranges_end(rank_ranges: object) -> int | None:
    """The end of the last rank range, when ``rank_ranges`` has one to read
    (:func:`check_ranges` checks the rest)."""
    try:
        return int(rank_ranges[-1][1])
    except (TypeError, IndexError, ValueError):
        return None


def check_sms(n_sms: object) -> int:
    if isinstance(n_sms, bool) or not isinstance(n_sms, int) or n_sms < 1:
        raise ValueError(f"n_sms must be an int >= 1, got {n_sms!r}")
    return n_sms


@torch.compiler.assume_constant_result
def device_sms(device: torch.device | str) -> int:
    """The SM count of a CUDA device, the cores this process may run on for the
    CPU (a constant to torch.compile: traced code reads it once)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def context_from_split(
    bounds: list[int],
    ranges: list[tuple[int, int]],
    rank: int,
    *,
    group: object = None,
    group_name: str = "",
    device: torch.device | str = "cpu",
    max_docs: int | None = None,
    n_sms: int = 1,
) -> KcpContext:
    """The context of ``rank`` for document bounds and checked rank ranges: a
    pure function (no collective), also used to ask byte queries about any rank
    of any split without a process group. ``max_docs``: a capped context
    (``bounds`` holds at most ``max_docs`` documents). ``n_sms``: the device's
    SM count the segment plan fills (default 1: the plan then keeps P = 1)."""
    check_sms(n_sms)
    R = len(ranges)
    if max_docs is not None:
        check_max_docs(max_docs, len(bounds) - 1, "bounds")
        padded = bounds + [bounds[-1]] * (max_docs + 1 - len(bounds))
        ctx = capped_context(torch.tensor(padded, dtype=torch.int64), ranges, rank, group=group,
                             group_name=group_name, device=device, n_sms=n_sms)
        mine = rank_fragments(padded, *ranges[rank], rank == R - 1)
        return replace(ctx, packing_digest=digest(bounds), doc_rows=_doc_rows(mine))
    every_rank = [rank_fragments(bounds, start, end, r == R - 1) for r, (start, end) in enumerate(ranges)]
    rank_n_in = tuple(int(any(f[3] & CROSSING_IN for f in frags)) for frags in every_rank)
    rank_n_out = tuple(int(any(f[3] & CROSSING_OUT for f in frags)) for frags in every_rank)
    rank_middle = tuple(
        int(len(frags) == 1 and frags[0][3] == CROSSING_IN | CROSSING_OUT) for frags in every_rank
    )
    chain_ranks: dict[int, list[int]] = {}
    for r, frags in enumerate(every_rank):
        for doc, _, _, flags in frags:
            if flags:
                chain_ranks.setdefault(doc, []).append(r)
    chains = tuple(tuple(chain_ranks[doc]) for doc in sorted(chain_ranks))
    rank_prev, rank_next = _neighbours(chains, R)

    mine = every_rank[rank]  # documents tile the stream, so their parts tile the range
    index = ChunkIndex.from_fragments(
        [0] + [f[2] for f in mine] if mine else [0],
        frag_doc=[f[0] for f in mine],
        frag_flags=[f[3] for f in mine],
    )
    return KcpContext(
        R=R, rank=rank, group=group, group_name=group_name, rank_ranges=tuple(ranges), n_docs=len(bounds) - 1,
        rank_n_in=rank_n_in, rank_n_out=rank_n_out, rank_middle=rank_middle,
        rank_prev=rank_prev, rank_next=rank_next, chains=chains,
        index=index, device_index=index.to(device), n_sms=n_sms,
        plan_chunks=max((-(-(f[2] - f[1]) // CHUNK_SIZE) for frags in every_rank for f in frags), default=0),
        plan_frags=max(len(frags) for frags in every_rank),
        segment_rows=summary_row_counts(  # from the host fragments: no read of the tables (they may be fake)
            [-(-(f[2] - f[1]) // CHUNK_SIZE) for f in mine], [f[3] for f in mine], index.max_frag_chunks,
            exchanges=bool(chains),
        ),
        doc_rows=_doc_rows(mine),
    )


def _doc_rows(frags: list[tuple[int, int, int, int]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(start_docs, end_docs)`` of a rank's fragments (:func:`rank_fragments`)."""
    return (tuple(doc for doc, _, _, flags in frags if not flags & CROSSING_IN),
            tuple(doc for doc, _, _, flags in frags if not flags & CROSSING_OUT))


def _neighbours(chains: tuple[tuple[int, ...], ...], R: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(rank_prev, rank_next)`` along the chains (-1 for none)."""
    rank_prev, rank_next = [-1] * R, [-1] * R
    for chain in chains:
        for before, after in zip(chain, chain[1:]):
            rank_next[before], rank_prev[after] = after, before
    return tuple(rank_prev), tuple(rank_next)


def capped_context(
    cu_seqlens: torch.Tensor,
    ranges: list[tuple[int, int]],
    rank: int,
    *,
    group: object = None,
    group_name: str = "",
    device: torch.device | str | None = None,
    n_sms: int = 1,
) -> KcpContext:
    """The capped context of ``rank`` for a stream of ``N = len(cu_seqlens) - 1``
    documents (``max_docs = N``): no host read of ``cu_seqlens`` (torch ops at
    static shapes, traceable; the caller checks its values). The index is built
    on ``cu_seqlens``'s device and copied to ``device`` when that differs."""
    R = len(ranges)
    filled = [r for r, (start, end) in enumerate(ranges) if end > start]
    chains = (tuple(filled),) if len(filled) > 1 else ()
    rank_prev, rank_next = _neighbours(chains, R)
    rank_n_in = tuple(int(p >= 0) for p in rank_prev)
    rank_n_out = tuple(int(n >= 0) for n in rank_next)
    rank_middle = tuple(a & b for a, b in zip(rank_n_in, rank_n_out))
    start, end = ranges[rank]
    index = capped_index(cu_seqlens, start, end, last_rank=rank == R - 1)
    n_docs = index.n_frag  # a capped index has a fragment row per document
    return KcpContext(
        R=R, rank=rank, group=group, group_name=group_name, rank_ranges=tuple(ranges),
        n_docs=n_docs, rank_n_in=rank_n_in, rank_n_out=rank_n_out, rank_middle=rank_middle,
        rank_prev=rank_prev, rank_next=rank_next, chains=chains, index=index,
        device_index=index if device is None else index.to(device), max_docs=n_docs, n_sms=n_sms,
        plan_chunks=max(-(-(end - start) // CHUNK_SIZE) for start, end in ranges), plan_frags=n_docs,
        segment_rows=tuple(capped_summary_rows(P, exchanges=bool(chains)) for P in range(1, MAX_SEGMENTS + 1)),
    )


def group_from_name(group_name: str):
    """The process group registered under ``group_name`` (what the ops take)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def context_from_meta(
    meta: list[int], chunk_table: torch.Tensor, frag_table: torch.Tensor, group_name: str
) -> KcpContext:
    """Rebuild a context from what the ops take (:attr:`KcpContext.meta`, the two
    index tables on the call's device, the group's name). No host sync: the
    tables are used as they are."""
    R, rank, n_tokens, n_chunks, n_frag, max_frag_chunks, n_docs, capped = meta[:8]
    flat = meta[8 : 8 + 2 * R]
    columns = [tuple(meta[8 + 2 * R + i * R : 8 + 2 * R + (i + 1) * R]) for i in range(5)]
    rank_n_in, rank_n_out, rank_middle, rank_prev, rank_next = columns
    n_sms, plan_chunks, plan_frags = meta[8 + 7 * R : 11 + 7 * R]
    segment_rows = tuple(meta[11 + 7 * R : 11 + 7 * R + MAX_SEGMENTS])
    chains: list[tuple[int, ...]] = []
    for r in range(R):
        if rank_n_out[r] and not rank_middle[r]:  # the document starts here
            chain = [r, rank_next[r]]
            while rank_middle[chain[-1]]:
                chain.append(rank_next[chain[-1]])
            chains.append(tuple(chain))
    index = ChunkIndex(chunk_table, frag_table, n_tokens, n_chunks, n_frag, max_frag_chunks)
    group = group_from_name(group_name) if group_name else None  # empty: one rank, or byte queries only
    return KcpContext(
        R=R, rank=rank, group=group, group_name=group_name,
        rank_ranges=tuple((flat[2 * r], flat[2 * r + 1]) for r in range(R)), n_docs=n_docs,
        rank_n_in=rank_n_in, rank_n_out=rank_n_out, rank_middle=rank_middle, rank_prev=rank_prev,
        rank_next=rank_next, chains=tuple(chains), index=index, device_index=index,
        max_docs=n_docs if capped else None, n_sms=n_sms, plan_chunks=plan_chunks, plan_frags=plan_frags,
        segment_rows=segment_rows,
    )
